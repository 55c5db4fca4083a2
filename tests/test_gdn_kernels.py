"""GDN replay kernels vs the float64 eager recurrence (sglang_replayssm.reference).

CPU runs use the Triton interpreter, which rounds fp32 -> bf16 by truncation
(the GPU rounds to nearest): the gates ``a``/``b`` are therefore fp32 here so
that ``beta``'s rounding to b's dtype is exact on both; the bf16 path of ``b``
is covered by the GPU test against SGLang's kernel.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from sglang_replayssm.kernels import cursors as cur
from sglang_replayssm.kernels import gdn_replay as gdn
from sglang_replayssm.kernels.common import LaunchConfig, SplitConfig
from sglang_replayssm.kernels.cursors import MODE_DECODE, MODE_FLUSH, MODE_VERIFY, commit
from sglang_replayssm.kernels.gdn_replay import (gdn_replay_decode, gdn_replay_flush,
                                                 gdn_replay_verify)
from sglang_replayssm.reference import gdn_prepare_ref, gdn_step_ref

from draft_trees import as_sglang_parents, random_paths, random_tree  # noqa: E402 (tests/ helper)

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 1e-5, BF16: 2e-2}
FOLD_TOL = 1e-5  # the fp32 fold copy vs float64, however coarse the read copy


def split(**knobs):
    """A split-route config: default (A) tile (block 32 = all of the tests'
    V, 2 warps) plus SplitConfig knobs."""
    return SplitConfig(block=32, num_warps=2, **knobs)


# Decode routes, each case run on both: the fused kernel and the split route
# with its knobs spread over the cases (a v-head pair per outputs program,
# the FMA fold, fold items of half a head, 1 or 3 persistent fold programs so
# that a program loops over several items, cursor scans in chunks of 2 rows).
ROUTES = {
    "fused": ("output_only", None),
    # the fused kernel reading the ring in storage order, two V tiles per v-head
    "fused_storage": ("output_only", LaunchConfig(block=16, num_warps=2, storage_order=True)),
    "split": ("split", split()),
    "split_pairs_fma": ("split", split(out_heads=2, fold_dot=False, fold_programs=1)),
    "split_halves_chunks": ("split", split(out_heads=2, fold_block=16, fold_rows=2,
                                           fold_programs=3)),
    # the fold inside the projection (A), no (C): a whole-V tile, and half-V
    # tiles (two (A) programs per v-head fold their halves) with v-head pairs
    "split_project_fold": ("split", split(project_fold=True)),
    "split_project_fold_halves": ("split", SplitConfig(block=16, num_warps=2, out_heads=2,
                                                       project_fold=True)),
    # the ring weights (W), then (A) finishing the outputs (no (B)): whole-V
    # and half-V tiles
    "split_outputs": ("split", split(project_fold=True, outputs_in_projection=True)),
    "split_outputs_halves": ("split", SplitConfig(block=16, num_warps=2, project_fold=True,
                                                  outputs_in_projection=True)),
    # (B) launched while (A) runs (programmatic dependent launch): GPU only,
    # the interpreter runs the launches in turn (test_split_route_overlapped)
    "split_overlap": ("split", split(project_fold=True, overlap=True)),
    # (A) launched while (W) runs
    "split_outputs_overlap": ("split", split(project_fold=True, outputs_in_projection=True,
                                             overlap=True)),
}


class Pool:
    """A GDN layer's pool (checkpoint, rings, cursors) plus its float64 twin."""

    def __init__(self, device, *, H=2, ratio=2, K=16, V=32, S=6, L=4, T=1, state=F32,
                 ring=F32, seed=0, route="fused", fold=False, kring=None):
        self.dev, self.H, self.HV, self.K, self.V, self.S, self.L, self.T = \
            device, H, H * ratio, K, V, S, L, T
        self.route, self.config = ROUTES[route]  # decode's
        self.gen = torch.Generator().manual_seed(seed)
        self.cap = cur.required_capacity(L, T)
        self.ckpt = (self.randn(S, self.HV, V, K) * 0.3).to(state).to(device)
        nan = float("nan")  # unwritten ring entries: reading one must show
        # dual precision: an fp32 fold copy, the checkpoint its rounded copy,
        # and the raw-input rings (v in the activation dtype, beta fp32)
        self.fold = self.vb = self.bb = None
        if fold:
            self.fold = (self.randn(S, self.HV, V, K) * 0.3).to(device)
            self.ckpt = self.fold.to(state)
            self.vb = torch.full((S, self.HV, self.cap, V), nan, dtype=ring, device=device)
            self.bb = torch.full((S, self.HV, self.cap), nan, dtype=F32, device=device)
        self.ref = (self.fold if fold else self.ckpt).double().cpu()
        self.kb = torch.full((S, H, self.cap, K), nan, dtype=kring or ring, device=device)
        self.ub = torch.full((S, self.HV, self.cap, V), nan, dtype=ring, device=device)
        self.gb = torch.full((S, self.HV, self.cap), nan, dtype=F32, device=device)
        self.fill = torch.zeros(S, dtype=torch.int32, device=device)
        self.origin = torch.zeros(S, dtype=torch.int32, device=device)
        self.A_log = (self.randn(self.HV) * 0.5).to(device)
        self.dt_bias = self.randn(self.HV).to(device)
        self.scale = K ** -0.5
        self.tol = max(TOL[state], TOL[ring])
        self.act = ring  # activations (and so outputs) in the ring's dtype

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def inputs(self, batch, T=None):
        shape = (batch,) if T is None else (batch, T)
        qkv = self.randn(*shape, 2 * self.H * self.K + self.HV * self.V).to(self.act)
        return qkv.to(self.dev), self.randn(*shape, self.HV).to(self.dev), \
            self.randn(*shape, self.HV).to(self.dev)

    def eager(self, slot, qkv, a, b, state=None):
        """One float64 step of the reference from the twin's slot (or from
        ``state`` [HV, V, K]); returns o [HV, V] and the state after it."""
        p = gdn_prepare_ref(qkv[None].cpu(), a[None].cpu(), b[None].cpu(), self.A_log.cpu(),
                            self.dt_bias.cpu(), self.H, self.HV, self.K, self.V, self.scale)
        st = (self.ref[slot] if state is None else state)[None].clone()
        o = gdn_step_ref(st, p["q"], p["k"], p["v"], p["g"], p["beta"])[0]
        return o, st[0]

    def pool_args(self):
        return (self.ckpt, self.kb, self.ub, self.gb, self.fill, self.origin)

    def fold_kw(self):
        return {} if self.fold is None else dict(checkpoint_fold=self.fold, v_buffer=self.vb,
                                                 beta_buffer=self.bb)

    def verify_kw(self):
        """A verify on the pool's route: a split pool verifies on the split
        route at its default launch shapes (the SplitConfig is decode's)."""
        split = self.route == "split"
        return dict(route=self.route, config=None if split else self.config)

    def decode(self, slots, qkv, a, b, **kw):
        return gdn_replay_decode(*self.pool_args(), slots, qkv, a, b, self.A_log, self.dt_bias,
                                 self.scale, buffer_len=self.L, num_k_heads=self.H,
                                 route=self.route, config=self.config, **self.fold_kw(), **kw)

    def check_flushed(self, s):
        """After a flush of slot s: the checkpoint (or, dual precision, the fold
        copy, at fp32 accuracy, and the checkpoint as its rounded copy)."""
        if self.fold is None:
            assert self.rel(self.ckpt[s], self.ref[s]) < self.tol
            return
        assert self.rel(self.fold[s], self.ref[s]) < FOLD_TOL
        assert self.rel(self.ckpt[s], self.fold[s].double().cpu()) < 2 ** -7

    def check_drafts(self, s, y, qkv, a, b, accepted):
        """Verify outputs of one row (y [T, HV, V] for drafts qkv/a/b [T, ...])
        against the float64 decode of the drafts in order from the twin's
        state; then the twin takes the state after the ``accepted`` first.
        A chain is the tree whose draft j follows draft j-1."""
        chain = [j - 1 for j in range(y.shape[0])]
        self.check_tree(s, y, qkv, a, b, chain, list(range(accepted)))

    def check_tree(self, s, y, qkv, a, b, parents, path):
        """Tree verify outputs of one row (y [T, HV, V]): draft j against the
        float64 decode of the drafts on its path from the twin's state; then
        the twin takes the state after the accepted ``path``."""
        after = {}
        for j, p in enumerate(parents):
            o, after[j] = self.eager(s, qkv[j], a[j], b[j], None if p < 0 else after[p])
            assert self.rel(y[j], o) < self.tol, f"draft {j} of tree {parents}"
        self.ref[s] = after[int(path[-1])].clone()

    def rel(self, got, ref):
        return float((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def decode_steps(pool, slots, steps, check=True):
    """Decode `steps` tokens for `slots`, comparing every output and every flush."""
    flushes = 0
    for _ in range(steps):
        qkv, a, b = pool.inputs(len(slots))
        fill0 = pool.fill.cpu().clone()
        y = pool.decode(slots, qkv, a, b, validate=True)
        commit(pool.fill, pool.origin, slots, mode=MODE_DECODE, buffer_len=pool.L,
               capacity=pool.cap)
        for r, s in enumerate(slots.tolist()):
            if s < 0:
                assert bool((y[r] == 0).all()), "padded row must output zeros"
                continue
            o, st = pool.eager(s, qkv[r], a[r], b[r])
            pool.ref[s] = st
            if check:
                assert pool.rel(y[r], o) < pool.tol
            if fill0[s] + 1 >= pool.L:
                flushes += 1
                pool.check_flushed(s)
    return flushes


# (ratio, route): every GVA ratio on the fused kernel and on the split route,
# the split knobs spread over the ratios (out_heads=2 needs ratio >= 2)
STAGGER_CASES = [(r, "fused") for r in (1, 2, 4)] + [(2, "fused_storage")] + [
    (1, "split"), (2, "split_pairs_fma"), (4, "split_halves_chunks"),
    (1, "split_project_fold"), (2, "split_project_fold_halves"), (4, "split_project_fold"),
    (1, "split_outputs_halves"), (2, "split_outputs"), (4, "split_outputs_halves")]


@pytest.mark.parametrize("ratio,route", STAGGER_CASES, ids=[f"{r}-{n}" for r, n in STAGGER_CASES])
def test_decode_across_flushes_staggered_and_padded(device, ratio, route):
    """Staggered cursors (so every fill level, flushing and not, meets the
    others in one launch), a padded row (zero output), >= 2 flushes per row,
    free slots bit-identical (NaN rings stay NaN: nothing wrote them)."""
    pool = Pool(device, ratio=ratio, L=4, route=route)
    untouched = [0, 2]
    names = ("ckpt", "kb", "ub", "gb")
    snap = [getattr(pool, n)[untouched].clone() for n in names]
    decode_steps(pool, torch.tensor([3], dtype=torch.int32, device=device), 2)  # stagger
    slots = torch.tensor([3, -1, 1, 5], dtype=torch.int32, device=device)
    flushes = decode_steps(pool, slots, 9)
    assert flushes >= 2 * 3  # every live row flushed at least twice
    assert pool.fill.cpu()[[3, 1, 5]].tolist() == [11 % 4, 9 % 4, 9 % 4]
    for n, a in zip(names, snap):
        b = getattr(pool, n)[untouched]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), n


@pytest.mark.parametrize("route", ["fused", "fused_storage", "split", "split_pairs_fma",
                                   "split_project_fold", "split_outputs"])
@pytest.mark.parametrize("state,ring", [(BF16, BF16), (F32, BF16)], ids=["bf16", "f32-bf16ring"])
def test_bf16_state_and_rings(device, state, ring, route):
    pool = Pool(device, state=state, ring=ring, L=4, seed=3, route=route)
    assert decode_steps(pool, torch.tensor([1, 4], dtype=torch.int32, device=device), 9) >= 4


@pytest.mark.parametrize("route", ["fused", "fused_storage", "split"])
def test_verify_random_acceptance(device, route):
    """Verify (the fused kernel in the route's ring order, or the split
    route) with random acceptance over 40 steps, then decode and a flush-only
    pass."""
    T, L = 2, 5
    pool = Pool(device, ratio=2, L=L, T=T, seed=7, route=route)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(11)
    flushes = {4: 0, 1: 0}
    for _ in range(40):
        qkv, a, b = pool.inputs(3, T)
        fill0 = pool.fill.cpu().clone()
        y = gdn_replay_verify(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                              pool.scale, buffer_len=L, num_k_heads=pool.H, validate=True,
                              **pool.verify_kw())
        acc = torch.randint(1, T + 1, (3,), generator=gen, dtype=torch.int32)
        for r, s in enumerate(slots.tolist()):
            if s < 0:
                assert bool((y[r] == 0).all())
                continue
            if fill0[s] + T >= L:  # flushed the committed history before the window
                flushes[s] += 1
                pool.check_flushed(s)
            pool.check_drafts(s, y[r], qkv[r], a[r], b[r], int(acc[r]))
        commit(pool.fill, pool.origin, slots, mode=MODE_VERIFY, buffer_len=L, capacity=pool.cap,
               window=T, accepted=acc.to(device), validate=True)
    assert min(flushes.values()) >= 2
    # decode after verify on the same pool, then a flush-only pass
    decode_steps(pool, slots, 5)
    gdn_replay_flush(*pool.pool_args(), slots, buffer_len=L, num_k_heads=pool.H,
                     config=None if pool.route == "split" else pool.config)
    commit(pool.fill, pool.origin, slots, mode=MODE_FLUSH, buffer_len=L, capacity=pool.cap)
    for s in (4, 1):
        assert int(pool.fill[s]) == 0 and pool.rel(pool.ckpt[s], pool.ref[s]) < pool.tol


@pytest.mark.parametrize("route,fold", [("fused_storage", False), ("fused", True),
                                        ("split", True)],
                         ids=["fused_storage", "fused-fold-copy", "split-fold-copy"])
def test_tree_verify_random_trees_and_paths(device, route, fold):
    """Tree verify: random draft trees (several roots at times), every
    draft's output against the float64 recurrence along its own path, then a
    random accepted path moved into place (accept_path) and committed, over
    >= 2 verify flushes per row; then decode on the same pool. Dual
    precision: the raw rings move with the others and the fold copy stays
    at fp32 accuracy."""
    T, L = 3, 5
    kw = dict(state=BF16, ring=BF16, kring=F32, fold=True) if fold else {}
    pool = Pool(device, ratio=2, L=L, T=T, seed=17, route=route, **kw)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(18)
    flushes = {4: 0, 1: 0}
    for _ in range(8):
        qkv, a, b = pool.inputs(3, T)
        trees = [random_tree(gen, T) for _ in range(3)]
        # SGLang's buffer as it is (int64, entry 0 unset) on odd steps
        parents = as_sglang_parents(trees) if _ % 2 else torch.tensor(trees, dtype=torch.int32)
        fill0 = pool.fill.cpu().clone()
        y = gdn_replay_verify(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                              pool.scale, buffer_len=L, num_k_heads=pool.H, validate=True,
                              parents=parents.to(device), **pool.verify_kw(), **pool.fold_kw())
        path, acc = random_paths(gen, trees, T)
        for r, s in enumerate(slots.tolist()):
            if s < 0:
                assert bool((y[r] == 0).all())
                continue
            if fill0[s] + T >= L:
                flushes[s] += 1
                pool.check_flushed(s)
            pool.check_tree(s, y[r], qkv[r], a[r], b[r], trees[r], path[r, :int(acc[r])])
        rings = [pool.kb, pool.ub, pool.gb] + ([pool.vb, pool.bb] if fold else [])
        cur.accept_path(rings, pool.fill, pool.origin, slots, path.to(device), acc.to(device),
                        capacity=pool.cap, parents=parents.to(device), validate=True)
        commit(pool.fill, pool.origin, slots, mode=MODE_VERIFY, buffer_len=L, capacity=pool.cap,
               window=T, accepted=acc.to(device), validate=True)
    assert min(flushes.values()) >= 2
    decode_steps(pool, slots, 2)  # reads the moved entries


def test_tree_verify_of_a_chain_is_chain_verify(device):
    """parents j-1 (a chain written as a tree) gives chain verify's outputs
    and ring entries."""
    T, L = 3, 5
    pools = [Pool(device, L=L, T=T, seed=19) for _ in range(2)]
    slots = torch.tensor([2, 5], dtype=torch.int32, device=device)
    chain = torch.tensor([[-1, 0, 1]] * 2, dtype=torch.int32, device=device)
    for _ in range(3):
        ys = []
        for p, parents in zip(pools, (None, chain)):
            qkv, a, b = p.inputs(2, T)
            ys.append(gdn_replay_verify(*p.pool_args(), slots, qkv, a, b, p.A_log, p.dt_bias,
                                        p.scale, buffer_len=L, num_k_heads=p.H, parents=parents))
            commit(p.fill, p.origin, slots, mode=MODE_VERIFY, buffer_len=L, capacity=p.cap,
                   window=T, accepted=torch.full((2,), T, dtype=torch.int32, device=device))
        assert (ys[0] - ys[1]).abs().max() <= 1e-6 * ys[0].abs().max()
    for name in ("ckpt", "kb", "ub", "gb"):
        a, b = (getattr(p, name)[[2, 5]].nan_to_num(7.0) for p in pools)
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), name


@pytest.mark.parametrize("route", ["fused", "split"])
def test_flush_only_then_decode(device, route):
    """Decode, a flush-only pass (always the fused kernel), decode again."""
    pool = Pool(device, L=6, seed=5, route=route)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=device)
    decode_steps(pool, slots, 3)
    gdn_replay_flush(*pool.pool_args(), slots, buffer_len=pool.L, num_k_heads=pool.H)
    commit(pool.fill, pool.origin, slots, mode=MODE_FLUSH, buffer_len=pool.L, capacity=pool.cap)
    assert pool.fill.cpu()[[2, 0]].tolist() == [0, 0]
    for s in (2, 0):
        assert pool.rel(pool.ckpt[s], pool.ref[s]) < pool.tol
    decode_steps(pool, slots, 7)


@pytest.mark.parametrize("route", ["split_pairs_fma", "split_project_fold_halves",
                                   "split_outputs_halves", "fused_storage"])
def test_decode_after_verify_wrapped_ring(device, route):
    """Decode on a pool the fused kernel verified: a verify flush moves
    origin (4 of a 6-entry ring), so the ring reads and the append wrap
    around (storage order: logical positions 2, 3, 4 at ring indices 0, 1, 2);
    then >= 1 decode flush per row (split: through (C) or (A))."""
    T, L = 2, 5
    pool = Pool(device, L=L, T=T, seed=8, route=route)
    slots = torch.tensor([4, 1], dtype=torch.int32, device=device)
    acc = torch.full((2,), T, dtype=torch.int32, device=device)
    for _ in range(3):  # fills 0 -> 2 -> 4 -> flush: fill 2, origin 4
        qkv, a, b = pool.inputs(2, T)
        gdn_replay_verify(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                          pool.scale, buffer_len=L, num_k_heads=pool.H, validate=True,
                          **pool.verify_kw())
        for r, s in enumerate(slots.tolist()):
            for j in range(T):  # all drafts accepted: the twin steps through them all
                _, pool.ref[s] = pool.eager(s, qkv[r, j], a[r, j], b[r, j])
        commit(pool.fill, pool.origin, slots, mode=MODE_VERIFY, buffer_len=L, capacity=pool.cap,
               window=T, accepted=acc)
    assert pool.origin.cpu()[[4, 1]].tolist() == [4, 4] and pool.fill.cpu()[[4, 1]].tolist() == [2, 2]
    assert decode_steps(pool, slots, 4) >= 2


def test_storage_order_covers_a_ring_wider_than_the_decode_window(device):
    """A pool sized for verify windows of T=2 at L=16 has 17 ring entries, one
    more than a decode step's 16 positions: in storage order the fused kernel
    must read the whole ring (BLOCK_S 32, not 16). A verify flush at fill 14
    leaves origin 14, so decode's third entry lands at ring index 16."""
    T, L = 2, 16
    pool = Pool(device, L=L, T=T, seed=21, route="fused_storage")
    slots = torch.tensor([3], dtype=torch.int32, device=device)
    acc = torch.full((1,), T, dtype=torch.int32, device=device)
    for _ in range(8):  # fills 0, 2, .., 14 -> flush: fill 2, origin 14
        qkv, a, b = pool.inputs(1, T)
        y = gdn_replay_verify(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                              pool.scale, buffer_len=L, num_k_heads=pool.H, validate=True,
                              config=pool.config)
        pool.check_drafts(3, y[0], qkv[0], a[0], b[0], T)
        commit(pool.fill, pool.origin, slots, mode=MODE_VERIFY, buffer_len=L, capacity=pool.cap,
               window=T, accepted=acc)
    assert (int(pool.fill[3]), int(pool.origin[3]), pool.cap) == (2, 14, 17)
    assert decode_steps(pool, slots, 16) == 1


@pytest.mark.parametrize("route", ["fused", "fused_storage", "split", "split_project_fold",
                                   "split_outputs"])
@pytest.mark.parametrize("target", ["u", "k", "g"])
def test_corrupted_ring_entry_is_caught(device, route, target):
    """Teeth: one corrupted ring entry (a corrected value, a key, a log decay)
    must move the next output off the reference."""
    pool = Pool(device, L=8, seed=9, route=route)
    slots = torch.tensor([1], dtype=torch.int32, device=device)
    decode_steps(pool, slots, 3)
    if target == "u":
        pool.ub[1, 0, 1] += 1.0
    elif target == "k":
        pool.kb[1, 0, 1] += 1.0
    else:
        pool.gb[1, 0, 1] -= 1.0
    with pytest.raises(AssertionError):
        decode_steps(pool, slots, 1)


def stagger_fills(pools, device, L):
    """Two decode steps on each pool (same inputs in pools of the same seed):
    slots 5, 0, 2 then hold fills 2, 1, 0, so their flushes fall on
    different steps of the cycles that follow."""
    for p in pools:
        for rows in ([5, -1, -1], [5, 0, -1]):
            qkv, a, b = p.inputs(3)
            p.decode(torch.tensor(rows, dtype=torch.int32, device=device), qkv, a, b)
            commit(p.fill, p.origin, torch.tensor(rows, dtype=torch.int32, device=device),
                   mode=MODE_DECODE, buffer_len=L, capacity=p.cap)


@pytest.mark.parametrize("knobs", [dict(), dict(out_heads=2, fold_dot=False),
                                   dict(project_fold=True),
                                   dict(project_fold=True, outputs_in_projection=True)],
                         ids=["dot", "pairs_fma", "project_fold", "outputs_in_projection"])
def test_split_matches_fused_over_two_cycles(device, knobs):
    """The split route against the fused one on the same pool and inputs: two
    full buffer cycles from staggered cursors (every row flushes twice, at
    different steps), outputs and checkpoints equal to fp32 rounding at every
    step, cursors identical, the live ring entries of k, g and u to fp32
    rounding. k and g are the same formulas in both kernels (bit-identical in
    the interpreter, an ulp apart once ptxas schedules each kernel's sqrt/exp
    on the H200); u_t depends on h_c k_t, which the split route forms as
    (h_c k_raw) / |k_raw| in (A) + (B), the fused kernel as h_c (k_raw / |k_raw|)."""
    L = 4
    pools = [Pool(device, L=L, seed=4), Pool(device, L=L, seed=4)]
    pools[1].config = split(**knobs)
    pools[1].route = "split"
    stagger_fills(pools, device, L)
    slots = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)
    # fp32 rounding of a different summation order compounding over flushes
    tol = 1e-6 if knobs.get("fold_dot", True) else 3e-6
    for step in range(2 * L):
        inp = pools[0].inputs(3)
        pools[1].inputs(3)  # keep the generators in step
        outs = [p.decode(slots, *inp) for p in pools]
        rel = lambda x, y: float((x - y).abs().max() / y.abs().max())  # noqa: E731
        assert rel(outs[1], outs[0]) <= tol, f"step {step}: outputs"
        assert rel(pools[1].ckpt, pools[0].ckpt) <= tol, f"step {step}: checkpoint"
        for p in pools:
            commit(p.fill, p.origin, slots, mode=MODE_DECODE, buffer_len=L, capacity=p.cap)
        assert torch.equal(pools[0].fill, pools[1].fill)
        assert torch.equal(pools[0].origin, pools[1].origin)
        for s in slots.tolist():
            live = [(int(pools[0].origin[s]) + i) % pools[0].cap
                    for i in range(int(pools[0].fill[s]))]
            for n in ("kb", "gb", "ub"):
                x, y = getattr(pools[0], n)[s][:, live], getattr(pools[1], n)[s][:, live]
                assert not live or rel(y, x) <= tol, f"step {step}: {n} of slot {s}"
    assert int((pools[0].fill[slots] == 0).sum()) >= 1


@pytest.mark.parametrize("state,tol", [(F32, 1e-6), (BF16, 1e-2)], ids=["fp32", "bf16"])
def test_project_fold_bf16_mma_matches_tf32x3(device, state, tol):
    """SplitConfig.fold_bf16 with a bf16 key ring: (A)'s fold dot as bf16 MMAs
    on the weighted values cut into 3 (fp32 state) or 2 (bf16) bf16 parts
    (fold.weighted_dot), this token's fp32 key added outside the dot, against
    the tf32x3 fold on the same pool and inputs over two buffer cycles from
    staggered cursors: checkpoints and outputs agree to the state's precision
    at every step (fp32: 1e-6, the parts keep all 24 bits of the values), and
    both stay on the float64 reference (Pool.decode checks every output)."""
    L = 4
    pools = [Pool(device, L=L, seed=5, state=state, ring=BF16) for _ in range(2)]
    for p, on in zip(pools, (False, True)):
        p.config, p.route = split(project_fold=True, fold_bf16=on), "split"
    stagger_fills(pools, device, L)
    slots = torch.tensor([5, 0, 2], dtype=torch.int32, device=device)
    rel = lambda x, y: float((x.float() - y.float()).abs().max() / y.float().abs().max())  # noqa: E731
    flushed = 0
    for step in range(2 * L):
        inp = pools[0].inputs(3)
        pools[1].inputs(3)  # keep the generators in step
        outs = [p.decode(slots, *inp) for p in pools]
        assert rel(outs[1], outs[0]) <= tol, f"step {step}: outputs"
        assert rel(pools[1].ckpt, pools[0].ckpt) <= tol, f"step {step}: checkpoint"
        flushed += int((pools[0].fill[slots] + 1 >= L).sum())
        for p in pools:
            commit(p.fill, p.origin, slots, mode=MODE_DECODE, buffer_len=L, capacity=p.cap)
    assert flushed >= 2 * len(slots)


@pytest.mark.parametrize("state,cols", [(F32, 16), (BF16, 32)])
def test_project_fold_in_column_chunks(device, state, cols):
    """The projection's fold over K in chunks re-read from memory (fold_cols):
    K=48 (BLOCK_K 64) in chunks of 16 (the last one masked) or 32, staggered
    cursors, a padded row, >= 2 flushes per row."""
    pool = Pool(device, K=48, L=4, seed=23, state=state, ring=state, route="split")
    pool.config = SplitConfig(block=16, num_warps=2, project_fold=True, fold_cols=cols)
    decode_steps(pool, torch.tensor([3], dtype=torch.int32, device=device), 2)  # stagger
    slots = torch.tensor([3, -1, 1], dtype=torch.int32, device=device)
    assert decode_steps(pool, slots, 9) >= 2 * 2


# Dual precision: bf16 read copy + fp32 fold copy; k in fp32 (the fold needs
# the normalised keys exactly), u in bf16 (read by the outputs only)
FOLD_ROUTES = ["fused", "fused_storage", "split", "split_halves_chunks"]


@pytest.mark.parametrize("route", FOLD_ROUTES)
def test_fold_copy_keeps_the_recurrence_at_fp32(device, route):
    """Outputs read the bf16 copy (bf16 accuracy); every flush recomputes the
    corrected values from the fp32 copy and the raw v/beta rings, so the fold
    copy stays at fp32 accuracy over >= 3 flushes per row while the bf16
    copy alone is ~1e-3 off (which the 1e-5 check would catch if the fold
    used the read copy's u), and padded / free slots stay untouched."""
    pool = Pool(device, state=BF16, ring=BF16, kring=F32, L=4, seed=12, route=route, fold=True)
    snap = [t[[0, 2]].clone() for t in (pool.fold, pool.vb, pool.bb)]
    decode_steps(pool, torch.tensor([3], dtype=torch.int32, device=device), 1)  # stagger
    slots = torch.tensor([3, -1, 1, 5], dtype=torch.int32, device=device)
    assert decode_steps(pool, slots, 12) >= 3 * 3
    gdn_replay_flush(*pool.pool_args(), slots, buffer_len=pool.L, num_k_heads=pool.H,
                     **pool.fold_kw())
    commit(pool.fill, pool.origin, slots, mode=MODE_FLUSH, buffer_len=pool.L, capacity=pool.cap)
    live = (3, 1, 5)
    assert max(pool.rel(pool.fold[s], pool.ref[s]) for s in live) < FOLD_TOL
    assert min(pool.rel(pool.ckpt[s], pool.ref[s]) for s in live) > 1e-4  # bf16 rounding
    for a, t in zip(snap, (pool.fold, pool.vb, pool.bb)):
        b = t[[0, 2]]
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_fold_copy_recompute_in_column_chunks(device):
    """(C)'s recomputing fold over K in chunks (fold_cols): K=48 (BLOCK_K 64)
    in chunks of 16, the last one wholly masked, half-V items, 3 persistent
    programs; the fold copy stays at fp32 accuracy over >= 2 flushes a row."""
    pool = Pool(device, state=BF16, ring=BF16, kring=F32, K=48, L=4, seed=24, route="split",
                fold=True)
    pool.config = split(fold_block=16, fold_cols=16, fold_programs=3)
    decode_steps(pool, torch.tensor([3], dtype=torch.int32, device=device), 2)  # stagger
    slots = torch.tensor([3, -1, 1], dtype=torch.int32, device=device)
    assert decode_steps(pool, slots, 9) >= 2 * 2
    gdn_replay_flush(*pool.pool_args(), slots, buffer_len=pool.L, num_k_heads=pool.H,
                     **pool.fold_kw())
    commit(pool.fill, pool.origin, slots, mode=MODE_FLUSH, buffer_len=pool.L, capacity=pool.cap)
    assert max(pool.rel(pool.fold[s], pool.ref[s]) for s in (3, 1)) < FOLD_TOL


@pytest.mark.parametrize("route", ["fused", "fused_storage"])
def test_fold_copy_through_verify_and_flush(device, route):
    """Chain verify with random acceptance and flush-only passes on a dual
    precision pool: the verify flush and MODE_FLUSH recompute u too."""
    T, L = 2, 5
    pool = Pool(device, state=BF16, ring=BF16, kring=F32, L=L, T=T, seed=13, fold=True,
                route=route)
    slots = torch.tensor([4, 1], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(14)
    flushes = 0
    for _ in range(12):
        qkv, a, b = pool.inputs(2, T)
        fill0 = pool.fill.cpu().clone()
        y = gdn_replay_verify(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                              pool.scale, buffer_len=L, num_k_heads=pool.H, validate=True,
                              config=pool.config, **pool.fold_kw())
        acc = torch.randint(1, T + 1, (2,), generator=gen, dtype=torch.int32)
        for r, s in enumerate(slots.tolist()):
            if fill0[s] + T >= L:
                flushes += 1
                pool.check_flushed(s)
            pool.check_drafts(s, y[r], qkv[r], a[r], b[r], int(acc[r]))
        commit(pool.fill, pool.origin, slots, mode=MODE_VERIFY, buffer_len=L, capacity=pool.cap,
               window=T, accepted=acc.to(device), validate=True)
    assert flushes >= 4
    decode_steps(pool, slots, 2)
    gdn_replay_flush(*pool.pool_args(), slots, buffer_len=L, num_k_heads=pool.H,
                     config=pool.config, **pool.fold_kw())
    commit(pool.fill, pool.origin, slots, mode=MODE_FLUSH, buffer_len=L, capacity=pool.cap)
    for s in (4, 1):
        assert int(pool.fill[s]) == 0
        pool.check_flushed(s)


@pytest.mark.parametrize("route", ["fused", "split"])
@pytest.mark.parametrize("target", ["v", "beta"])
def test_corrupted_raw_ring_entry_is_caught(device, route, target):
    """Teeth: the raw rings feed only the fold copy, so a corrupted v or beta
    entry leaves the outputs alone and must show at the next flush."""
    pool = Pool(device, state=BF16, ring=BF16, kring=F32, L=4, seed=15, route=route, fold=True)
    slots = torch.tensor([1], dtype=torch.int32, device=device)
    decode_steps(pool, slots, 2)
    if target == "v":
        pool.vb[1, 0, 1] += 1.0
    else:
        pool.bb[1, 0, 1] *= 0.5
    with pytest.raises(AssertionError):
        decode_steps(pool, slots, 2)  # the second step flushes


def test_fold_copy_bad_input_is_rejected(device):
    pool = Pool(device, state=BF16, ring=BF16, kring=F32, L=4, fold=True)
    slots = torch.tensor([1], dtype=torch.int32, device=device)
    qkv, a, b = pool.inputs(1)
    with pytest.raises(ValueError, match="go together"):
        gdn_replay_decode(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                          pool.scale, buffer_len=4, num_k_heads=pool.H,
                          checkpoint_fold=pool.fold, v_buffer=pool.vb)
    with pytest.raises(ValueError, match="checkpoint_fold dtype torch.bfloat16 not supported"):
        gdn_replay_decode(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                          pool.scale, buffer_len=4, num_k_heads=pool.H,
                          checkpoint_fold=pool.fold.to(BF16), v_buffer=pool.vb,
                          beta_buffer=pool.bb)
    with pytest.raises(ValueError, match="fold_dot=False"):
        gdn_replay_decode(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                          pool.scale, buffer_len=4, num_k_heads=pool.H, route="split",
                          config=split(fold_dot=False), **pool.fold_kw())
    with pytest.raises(ValueError, match="project_fold=True folds the u_t"):
        gdn_replay_decode(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                          pool.scale, buffer_len=4, num_k_heads=pool.H, route="split",
                          config=split(project_fold=True), **pool.fold_kw())


def test_bad_input_is_rejected(device):
    pool = Pool(device, L=4, T=2)
    slots = torch.tensor([1], dtype=torch.int32, device=device)
    qkv, a, b = pool.inputs(1, 2)
    args = (slots, qkv, a, b, pool.A_log, pool.dt_bias, pool.scale)
    kw = dict(buffer_len=4, num_k_heads=pool.H)
    with pytest.raises(ValueError, match="must exceed the speculative window"):
        gdn_replay_verify(*pool.pool_args(), *args, buffer_len=2, num_k_heads=pool.H)
    with pytest.raises(ValueError, match="g_buffer must be float32"):
        gdn_replay_verify(pool.ckpt, pool.kb, pool.ub, pool.gb.to(BF16), pool.fill, pool.origin,
                          *args, **kw)
    with pytest.raises(ValueError, match="too short"):
        gdn_replay_verify(pool.ckpt, pool.kb[:, :, :3], pool.ub[:, :, :3], pool.gb[:, :, :3],
                          pool.fill, pool.origin, *args, **kw)
    with pytest.raises(ValueError, match="cursors fill/origin must be int32"):
        gdn_replay_verify(pool.ckpt, pool.kb, pool.ub, pool.gb, pool.fill.long(), pool.origin,
                          *args, **kw)
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        gdn_replay_verify(*pool.pool_args(), *args, buffer_len=4, num_k_heads=3)
    bad = qkv.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="mixed_qkv` contains NaN"):
        gdn_replay_verify(*pool.pool_args(), slots, bad, a, b, pool.A_log, pool.dt_bias,
                          pool.scale, validate=True, **kw)
    i32 = dict(dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="parents must be int32 or int64"):
        gdn_replay_verify(*pool.pool_args(), *args,
                          parents=torch.tensor([[-1, 0]], dtype=torch.int16, device=device), **kw)
    with pytest.raises(ValueError, match=r"parents\[:, j\] must lie in \[-1, j\)"):
        gdn_replay_verify(*pool.pool_args(), *args, parents=torch.tensor([[-1, 1]], **i32),
                          validate=True, **kw)
    assert int(pool.fill[1]) == 0 and bool(pool.kb.isnan().all())  # nothing was written
    ok = dict(capacity=pool.cap, validate=True)
    with pytest.raises(ValueError, match="path must list"):  # not increasing
        cur.accept_path([pool.kb], pool.fill, pool.origin, slots, torch.tensor([[1, 0]], **i32),
                        torch.tensor([2], **i32), **ok)
    with pytest.raises(ValueError, match="path must list"):  # 1 is not a child of 0
        cur.accept_path([pool.kb], pool.fill, pool.origin, slots, torch.tensor([[0, 1]], **i32),
                        torch.tensor([2], **i32), parents=torch.tensor([[-1, -1]], **i32), **ok)
    with pytest.raises(ValueError, match=r"ring must be \[S, heads, capacity"):
        cur.accept_path([pool.kb[:, :, :3]], pool.fill, pool.origin, slots,
                        torch.tensor([[0, 1]], **i32), torch.tensor([2], **i32), **ok)


def test_split_route_rejects_flush_and_bad_config(device):
    """route="split" is for decode and verify: flush names the route in its
    error; a SplitConfig whose out_heads does not divide the v-heads per
    k-head, or an unknown route, is refused before any launch."""
    pool = Pool(device, L=4, T=2, ratio=2)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    kw = dict(buffer_len=4, num_k_heads=pool.H)
    qkv, a, b = pool.inputs(2, 2)
    before = [t.clone() for t in pool.pool_args()]
    with pytest.raises(ValueError, match="route 'split' is for decode and verify"):
        gdn_replay_flush(*pool.pool_args(), slots, route="split", **kw)
    qkv, a, b = pool.inputs(2)
    pool.route, pool.config = "split", split(out_heads=3)
    with pytest.raises(ValueError, match="out_heads=3 must divide"):
        pool.decode(slots, qkv, a, b)
    pool.config = replace(split(), fold_block=24)
    with pytest.raises(ValueError, match="powers of 2"):
        pool.decode(slots, qkv, a, b)
    pool.route = "reconstruct"  # a Mamba-2 route
    with pytest.raises(ValueError, match="route must be one of"):
        pool.decode(slots, qkv, a, b)
    for x, y in zip(before, pool.pool_args()):
        assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


def test_gdn_kernels_run_interpreted_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction
    from sglang_replayssm.kernels import fold
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for fn in (gdn._gdn_replay_kernel, gdn._gdn_split_outputs_kernel,
               gdn._gdn_split_projection_kernel, fold.split_fold_kernel):
        assert isinstance(fn, InterpretedFunction)


@pytest.mark.gpu
def test_decode_matches_sglang_packed_decode():
    """fp32 parity with SGLang's stock GDN decode at a Qwen3-Next-like reduced shape."""
    from sglang.kernels.ops.attention.fla.fused_recurrent import (
        fused_recurrent_gated_delta_rule_packed_decode)
    dev = "cuda"
    H, HV, K, V, S, L, batch = 4, 8, 128, 128, 8, 4, 3
    g = torch.Generator(device=dev).manual_seed(0)
    state = torch.randn(S, HV, V, K, device=dev, generator=g) * 0.05
    stock = state.clone()
    cap = cur.required_capacity(L, 1)
    kb = torch.zeros(S, H, cap, K, device=dev)
    ub = torch.zeros(S, HV, cap, V, device=dev)
    gb = torch.zeros(S, HV, cap, device=dev)
    fill = torch.zeros(S, dtype=torch.int32, device=dev)
    origin = torch.zeros_like(fill)
    slots = torch.tensor([5, 2, 7], dtype=torch.int32, device=dev)
    A_log = torch.randn(HV, device=dev, generator=g) * 0.5
    dt_bias = torch.randn(HV, device=dev, generator=g).to(BF16)
    for step in range(2 * L + 1):
        qkv = torch.randn(batch, 2 * H * K + HV * V, device=dev, generator=g).to(BF16)
        a = torch.randn(batch, HV, device=dev, generator=g).to(BF16)
        b = torch.randn(batch, HV, device=dev, generator=g).to(BF16)
        o_stock = torch.empty(batch, 1, HV, V, device=dev)
        fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5,
            initial_state=stock, out=o_stock, ssm_state_indices=slots,
            use_qk_l2norm_in_kernel=True)
        o = gdn_replay_decode(state, kb, ub, gb, fill, origin, slots, qkv, a, b, A_log,
                              dt_bias, K ** -0.5, buffer_len=L, num_k_heads=H,
                              out=torch.empty(batch, HV, V, device=dev))
        flushed = bool((fill[slots] + 1 >= L).all())
        commit(fill, origin, slots, mode=MODE_DECODE, buffer_len=L, capacity=cap)
        ref = o_stock[:, 0]
        assert float((o - ref).abs().max() / ref.abs().max()) < 1e-5, step
        if flushed:
            d = (state[slots] - stock[slots]).abs().max() / stock[slots].abs().max()
            assert float(d) < 1e-5, step


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_split_route_overlapped(ratio):
    """SplitConfig.overlap: (B) starts before (A) has finished and waits for
    it only before reading the projections; same cases as the other routes
    (staggered cursors, a padded row, >= 2 flushes per row, free slots
    untouched), against the float64 reference."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    test_decode_across_flushes_staggered_and_padded("cuda", ratio, "split_overlap")
    test_decode_across_flushes_staggered_and_padded("cuda", ratio, "split_outputs_overlap")
