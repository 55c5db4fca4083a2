"""Mamba-2 ReplaySSM kernels against the float64 eager recurrence.

Every step runs the kernel on a pool (checkpoint + input ring + cursors) and
the eager reference ``selective_state_update_ref`` on a float64 state pool
stepped token by token, then checks:

* outputs of live rows (relative to max |y_ref|), padded rows' ``out`` entries
  untouched;
* on a row's flush step the checkpoint equals the reference state (the fp32
  fold copy, in dual precision, with the read copy equal to it rounded);
  otherwise the checkpoint is bit-identical to before the step;
* slots not in the batch: checkpoint, fold copy, buffers and cursors
  bit-identical;
* the launch itself leaves the cursors alone, and ``commit`` moves them as
  ``commit_ref`` does.

Unwritten ring entries start as NaN, so a kernel that reads (or fails to mask)
an entry outside a row's live range fails the output checks.

Shapes are small: the whole file runs under TRITON_INTERPRET=1 on CPU.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from sglang_replayssm.kernels import mamba2_replay as m2
from sglang_replayssm.kernels.cursors import (MODE_DECODE, MODE_FLUSH, MODE_VERIFY, accept_path,
                                              commit, commit_ref, required_capacity)
from sglang_replayssm.kernels.mamba2_replay import (mamba2_replay_decode, mamba2_replay_flush,
                                                    mamba2_replay_verify)
from sglang_replayssm.reference import selective_state_update_ref

from draft_trees import as_sglang_parents, random_paths, random_tree  # noqa: E402 (tests/ helper)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DT_NAMES = {F32: "f32", BF16: "bf16", F16: "f16"}
# Tolerances, relative to max |reference| over the compared tensor. fp32: the
# kernel accumulates in fp32 (interpreter: IEEE dots; GPU: tf32x3). bf16/fp16:
# one rounding of the output and of the checkpoint at each flush.
TOL = {F32: 1e-5, BF16: 2e-2, F16: 5e-3}
SENTINEL = 1234.5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    scale = expected.abs().max().item()
    return (actual.double() - expected).abs().max().item() / max(scale, 1e-30)


def rounded_copies(t: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """What a kernel's fp32 -> ``dtype`` store may give: round to nearest even
    (GPU); under TRITON_INTERPRET also round toward zero, since Triton 3.6's
    interpreter casts fp32 -> bf16 by dropping the low mantissa bits."""
    out = [t.to(dtype)]
    if dtype == BF16 and os.environ.get("TRITON_INTERPRET") == "1":
        bits = t.float().contiguous().view(torch.int32) & ~0xFFFF
        out.append(bits.view(F32).to(dtype))  # exact: low 16 bits are zero
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


@dataclass(frozen=True)
class Cfg:
    """One pool configuration (the parameters a test varies)."""
    state: torch.dtype = F32
    act: torch.dtype = F32
    route: str = "output_only"
    z: bool = True
    D: bool = True
    P: int = 16
    layout: str = "per_head"      # or "sglang": A/dt/D/dt_bias expanded with stride 0
    dt_mode: str = "bias_softplus"  # or "raw": no dt_bias, no softplus
    fold: bool = False            # dual precision: fp32 checkpoint_fold beside `checkpoint`
    G: int = 2                    # ngroups (H = 4 heads)
    config: tuple = ()            # LaunchConfig fields ((name, value), ...); (): default

    @property
    def id(self):
        parts = [f"s{DT_NAMES[self.state]}", f"a{DT_NAMES[self.act]}", self.route[:5],
                 f"P{self.P}", f"G{self.G}", self.layout]
        parts += [f"{k}={v}" for k, v in self.config]
        parts += [n for n, on in (("z", self.z), ("D", self.D), ("fold", self.fold)) if on]
        if self.dt_mode != "bias_softplus":
            parts.append("rawdt")
        return "-".join(parts)


class Pool:
    """A ReplaySSM pool for one Mamba-2 layer plus its float64 eager twin."""

    def __init__(self, device, cfg: Cfg = Cfg(), *, seed=0, S=6, H=4, N=16, L=4, T=1,
                 capacity=None):
        self.device, self.cfg = device, cfg
        self.S, self.H, self.P, self.N, self.G, self.L = S, H, cfg.P, N, cfg.G, L
        G = cfg.G
        self.config = None
        if cfg.config:  # the default launch config with some fields overridden
            self.config = m2.default_config(cfg.P, N, cfg.state, route=cfg.route)
            for k, v in cfg.config:
                assert hasattr(self.config, k), k
                setattr(self.config, k, v)
        self.gen = torch.Generator().manual_seed(seed)
        self.cap = capacity if capacity is not None else required_capacity(L, T)
        P, cap = self.P, self.cap
        h0 = self.randn(S, H, P, N) * 0.5
        if cfg.fold:
            self.checkpoint_fold = h0.clone()
            self.checkpoint = h0.to(cfg.state)
            self.ref = h0.double()
        else:
            self.checkpoint_fold = None
            self.checkpoint = h0.to(cfg.state)
            self.ref = self.checkpoint.double()
        nan = float("nan")
        self.x_buffer = torch.full((S, H, cap, P), nan, dtype=cfg.act, device=device)
        self.B_buffer = torch.full((S, G, cap, N), nan, dtype=cfg.act, device=device)
        self.dt_buffer = torch.full((S, H, cap), nan, dtype=F32, device=device)
        self.fill = torch.zeros(S, dtype=torch.int32, device=device)
        self.origin = torch.zeros(S, dtype=torch.int32, device=device)
        A = -(torch.rand(H, generator=self.gen) * 1.5 + 0.3).to(device)
        D = self.randn(H) if cfg.D else None
        self.softplus = cfg.dt_mode == "bias_softplus"
        dt_bias = self.randn(H) * 0.5 if self.softplus else None
        if cfg.layout == "sglang":  # expand on the device: .to() would materialize it
            A = A[:, None, None].expand(H, P, N)
            D = None if D is None else D[:, None].expand(H, P)
            dt_bias = None if dt_bias is None else dt_bias[:, None].expand(H, P)
        self.A, self.D, self.dt_bias = A, D, dt_bias
        if cfg.layout == "sglang":
            assert A.stride()[1:] == (0, 0) and all(
                t is None or t.stride(-1) == 0 for t in (D, dt_bias))
        self.tol_out = max(TOL[cfg.state], TOL[cfg.act])
        self.tol_state = TOL[F32] if cfg.fold else TOL[cfg.state]
        self.flushes = {}  # slot -> number of flushes seen
        self.wrapped = False  # some step's positions wrapped around the ring

    # ---- random data -------------------------------------------------
    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.device)

    def inputs(self, batch, T):
        H, P, N, G, act = self.H, self.P, self.N, self.G, self.cfg.act
        r = lambda *s: torch.randn(*s, generator=self.gen)  # noqa: E731
        if self.softplus:
            dt = r(batch, T, H)
        else:
            dt = torch.rand(batch, T, H, generator=self.gen) * 0.5 + 0.05
        inp = dict(x=r(batch, T, H, P), dt=dt, B=r(batch, T, G, N) * N ** -0.25,
                   C=r(batch, T, G, N) * N ** -0.25,
                   z=r(batch, T, H, P) if self.cfg.z else None)
        inp = {k: None if v is None else v.to(act).to(self.device) for k, v in inp.items()}
        if self.cfg.layout == "sglang":
            inp["dt"] = inp["dt"][..., None].expand(batch, T, H, P)
            assert inp["dt"].stride(-1) == 0
        return inp

    def slot_tensor(self, slots):
        return torch.tensor(slots, dtype=torch.int32, device=self.device)

    # ---- kernels -------------------------------------------------------
    def pool_args(self):
        return (self.checkpoint, self.x_buffer, self.B_buffer, self.dt_buffer, self.fill,
                self.origin)

    def kernel_kwargs(self, mode=MODE_DECODE):
        # a split pool verifies on the split route with its default launch
        # shapes (the SplitConfig is decode's)
        split = self.cfg.route in m2.SPLIT_ROUTES
        return dict(buffer_len=self.L, D=self.D, dt_bias=self.dt_bias,
                    dt_softplus=self.softplus, checkpoint_fold=self.checkpoint_fold,
                    route=self.cfg.route,
                    config=None if split and mode != MODE_DECODE else self.config,
                    validate=True)

    def run_kernel(self, mode, slots, inp=None, out=None, parents=None):
        """Launch one step's kernel (no commit); returns out [b, T, H, P]."""
        if mode == MODE_FLUSH:
            mamba2_replay_flush(*self.pool_args(), slots, self.A, buffer_len=self.L,
                                checkpoint_fold=self.checkpoint_fold, config=self.config,
                                validate=True)
            return None
        if out is None:
            out = torch.empty_like(inp["x"])
        if mode == MODE_DECODE:
            sq = {k: None if v is None else v[:, 0] for k, v in inp.items()}
            res = mamba2_replay_decode(*self.pool_args(), slots, sq["x"], sq["dt"], self.A,
                                       sq["B"], sq["C"], z=sq["z"], out=out[:, 0],
                                       **self.kernel_kwargs())
            assert res.data_ptr() == out.data_ptr() and res.shape == out[:, 0].shape
        else:
            res = mamba2_replay_verify(*self.pool_args(), slots, inp["x"], inp["dt"], self.A,
                                       inp["B"], inp["C"], z=inp["z"], out=out, parents=parents,
                                       **self.kernel_kwargs(mode))
            assert res is out
        return out

    def ref_chain(self, slots, inp, trees=None):
        """Eager float64 steps of the live rows over the window's tokens, from
        the reference state (not modified): in order, or with ``trees`` (per
        batch row a parents list) each draft from its parent's state. Returns
        (rows, y [nl, T, H, P], states after each token [T][nl, H, P, N])."""
        rows = (slots >= 0).nonzero().flatten()
        start = self.ref[slots[rows].long()]
        tmp = start.clone()
        idx = torch.arange(len(rows), device=self.device)
        ys, states = [], []
        pick = lambda k, j: None if inp[k] is None else inp[k][rows, j]  # noqa: E731
        for j in range(inp["x"].shape[1]):
            if trees is not None:
                tmp = torch.stack([start[i] if trees[r][j] < 0 else states[trees[r][j]][i]
                                   for i, r in enumerate(rows.tolist())])
            ys.append(selective_state_update_ref(
                tmp, pick("x", j), pick("dt", j), self.A, pick("B", j), pick("C", j), D=self.D,
                z=pick("z", j), dt_bias=self.dt_bias, dt_softplus=self.softplus,
                state_batch_indices=idx))
            states.append(tmp.clone())
        return rows, torch.stack(ys, 1), states

    # ---- checks --------------------------------------------------------
    def snapshot(self):
        names = ["checkpoint", "checkpoint_fold", "x_buffer", "B_buffer", "dt_buffer", "fill",
                 "origin"]
        return {n: getattr(self, n).clone() for n in names if getattr(self, n) is not None}

    def check_checkpoint(self, idx, what=""):
        """Checkpoint of slots ``idx`` equals the reference state."""
        if len(idx) == 0:
            return
        ref = self.ref[idx]
        if self.checkpoint_fold is not None:
            err = rel_err(self.checkpoint_fold[idx], ref)
            assert err <= self.tol_state, f"{what}: fold copy off the reference by {err:.2e}"
            ck = self.checkpoint[idx]
            ok = torch.zeros_like(ck, dtype=torch.bool)
            for r in rounded_copies(self.checkpoint_fold[idx], self.cfg.state):
                ok |= ck.view(torch.int16) == r.view(torch.int16) if ck.element_size() == 2 \
                    else ck == r
            assert bool(ok.all()), f"{what}: read copy is not the fold copy rounded"
        else:
            err = rel_err(self.checkpoint[idx], ref)
            assert err <= self.tol_state, f"{what}: checkpoint off the reference by {err:.2e}"

    def step(self, slots, mode, T=1, accepted=None, what="", trees=None):
        """Kernel + reference + all checks + commit. Returns the flushed slots.
        ``trees`` (verify): per batch row the drafts' parents (a tree verify,
        a random accepted path moved into place by accept_path)."""
        if not torch.is_tensor(slots):
            slots = self.slot_tensor(slots)
        T = 1 if mode == MODE_DECODE else (0 if mode == MODE_FLUSH else T)
        live = slots >= 0
        ls = slots[live].long()
        assert len(set(ls.tolist())) == len(ls), "a slot twice in one batch"
        before = self.snapshot()
        fill_b = self.fill[ls].clone()
        self.wrapped |= bool((self.origin[ls] + fill_b + T > self.cap).any())
        if mode == MODE_FLUSH:
            self.run_kernel(mode, slots)
            flushed = fill_b > 0
        else:
            inp = self.inputs(len(slots), T)
            sentinel = torch.full_like(inp["x"], SENTINEL)
            # a tree's parents as SGLang's buffer holds them (int64, entry 0 unset)
            parents = None if trees is None else as_sglang_parents(trees).to(self.device)
            out = self.run_kernel(mode, slots, inp, out=sentinel.clone(), parents=parents)
            rows, y_ref, states = self.ref_chain(slots, inp, trees)
            err = rel_err(out[rows], y_ref)
            assert err <= self.tol_out, f"{what}: outputs off the reference by {err:.2e}"
            assert bit_equal(out[~live], sentinel[~live]), f"{what}: padded row's out written"
            flushed = fill_b + T >= self.L
            if mode == MODE_DECODE:  # the flush folds the current token too
                self.ref[ls] = states[0]
        # the checkpoint: written exactly on flush rows
        self.check_checkpoint(ls[flushed], what)
        for n in ("checkpoint", "checkpoint_fold"):
            if n in before:
                keep = ls[~flushed]
                assert bit_equal(getattr(self, n)[keep], before[n][keep]), \
                    f"{what}: {n} written without a flush"
        for s in ls[flushed].tolist():
            self.flushes[s] = self.flushes.get(s, 0) + 1
        # slots outside the batch: untouched; cursors: untouched by the launch
        others = [s for s in range(self.S) if s not in ls.tolist()]
        for n, t in before.items():
            assert bit_equal(getattr(self, n)[others], t[others]), f"{what}: {n} of a free slot"
        assert bit_equal(self.fill, before["fill"]) and bit_equal(self.origin, before["origin"])
        if mode == MODE_VERIFY and trees is not None:
            path, accepted = random_paths(self.gen, trees, T)
            last = path.gather(1, (accepted[:, None] - 1).long())[:, 0][live.cpu()]
            self.ref[ls] = torch.stack([states[j][i] for i, j in enumerate(last.tolist())])
            accepted = accepted.to(self.device)
            accept_path([self.x_buffer, self.B_buffer, self.dt_buffer], self.fill, self.origin,
                        slots, path.to(self.device), accepted, capacity=self.cap,
                        parents=parents, validate=True)
        elif mode == MODE_VERIFY:
            if accepted is None:
                accepted = torch.randint(1, T + 1, (len(slots),), generator=self.gen)
            accepted = torch.as_tensor(accepted, dtype=torch.int32).to(self.device)
            acc = accepted[live].long()
            self.ref[ls] = torch.stack([states[a - 1][i] for i, a in enumerate(acc.tolist())])
        # commit: kernel == commit_ref, invariant fill < L
        f_exp, o_exp = self.fill.clone(), self.origin.clone()
        commit_ref(f_exp, o_exp, slots, accepted, T, self.L, self.cap, mode)
        commit(self.fill, self.origin, slots, mode=mode, buffer_len=self.L, capacity=self.cap,
               window=max(T, 1), accepted=accepted, validate=True)
        assert torch.equal(self.fill, f_exp) and torch.equal(self.origin, o_exp), what
        assert bool((self.fill >= 0).all() and (self.fill < self.L).all()), what
        if mode == MODE_FLUSH:
            assert bool((self.fill[ls] == 0).all() and (self.origin[ls] == 0).all())
        return ls[flushed].tolist()


# --------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------

# Launch configs: P=24/40 leave the last headdim slice of a program partly
# masked (default block: one power-of-two slice per head; block=16: 2-3
# slices per head); num_warps=2 is the serving-batch configuration.
BP16, NW2 = ("block", 16), ("num_warps", 2)
# the fused kernel reading the ring in storage order (LaunchConfig.storage_order)
SO = ("storage_order", True)
FUSED_DECODE_CASES = [
    Cfg(P=24),
    Cfg(P=24, route="reconstruct", layout="sglang"),
    Cfg(P=40, z=False, D=False, layout="sglang", config=(BP16,)),
    Cfg(P=16, route="reconstruct", z=False, D=False, dt_mode="raw", G=4),
    Cfg(P=24, G=1, config=(BP16, NW2)),
    Cfg(P=16, G=1, route="reconstruct", config=(NW2,)),
    Cfg(state=BF16, P=24),
    Cfg(state=F16, act=BF16, route="reconstruct"),
    Cfg(state=BF16, act=BF16, route="reconstruct", z=False, P=24),
    Cfg(act=BF16, D=False),
    Cfg(act=F16, state=F16, layout="sglang", P=24),
    # storage order (no split twins: SPLIT_KNOBS is two shorter)
    Cfg(P=24, config=(BP16, SO)),
    Cfg(state=BF16, act=BF16, route="reconstruct", z=False, config=(SO,)),
]
# The same pools on the split route, with its own knobs spread over them
# (SplitConfig fields): several heads per outputs program, the FMA fold, fold
# work items of part of a head, 1 or 3 persistent fold programs (so a program
# loops over several items) and cursor scans in chunks of 2 rows (3 rows of
# the batch: two chunks).
SPLIT_KNOBS = [
    (),
    (("out_heads", 2),),
    (("fold_dot", False), ("fold_block", 16)),
    (("fold_programs", 1), ("fold_rows", 2)),
    (("out_heads", 1), ("fold_programs", 3), ("out_warps", 1)),
    (("fold_dot", False), ("fold_programs", 1)),
    (("fold_rows", 2), ("fold_block", 16)),
    (("out_heads", 2), ("fold_dot", False)),
    (("fold_programs", 3),),
    (("fold_block", 16), ("fold_rows", 2)),
    (("out_heads", 2), ("fold_programs", 1)),
]
assert len(SPLIT_KNOBS) == len(FUSED_DECODE_CASES) - 2
# the fold in its own launch (C) after (B): not the default, so said explicitly
FOLD_LAUNCH = (("project_fold", False), ("overlap", False), ("outputs_in_projection", False))
SPLIT_DECODE_CASES = [replace(c, route="split", config=c.config + FOLD_LAUNCH + k)
                      for c, k in zip(FUSED_DECODE_CASES, SPLIT_KNOBS)]
# ... and with the fold inside the projection (A) (no (C)), on the fused
# cases' projection tiles (block 16: several headdim slices per head) and
# outputs knobs
PROJECT_FOLD = (("project_fold", True), ("outputs_in_projection", False))
PROJECT_FOLD_CASES = [replace(c, route="split", config=c.config + PROJECT_FOLD
                              + tuple(kv for kv in k if kv[0].startswith("out_")))
                      for c, k in zip(FUSED_DECODE_CASES, SPLIT_KNOBS)]
# ... and with the outputs finished in (A) after the ring weights (W), on
# every other of those pools (all dtypes, z / D on and off, both layouts)
OUTPUTS = (("outputs_in_projection", True),)
OUTPUTS_CASES = [replace(c, config=c.config + OUTPUTS) for c in PROJECT_FOLD_CASES[::2]]
DECODE_CASES = FUSED_DECODE_CASES + SPLIT_DECODE_CASES + PROJECT_FOLD_CASES + OUTPUTS_CASES


@pytest.mark.parametrize("cfg", DECODE_CASES, ids=lambda c: c.id)
def test_decode_every_fill_level(device, cfg):
    """2L+2 decode steps from an empty buffer: every fill level twice, >= 2
    flushes per row."""
    L = 4
    pool = Pool(device, cfg, seed=zlib.crc32(cfg.id.encode()), S=6, L=L)
    slots = [4, 1, 2]
    seen = {}
    for step in range(2 * L + 2):
        for f in pool.fill[slots].tolist():
            seen[f] = seen.get(f, 0) + 1
        pool.step(slots, MODE_DECODE, what=f"step {step}")
    assert all(seen.get(f, 0) >= 2 * len(slots) for f in range(L)), seen
    assert all(pool.flushes.get(s, 0) >= 2 for s in slots), pool.flushes


@pytest.mark.parametrize("route", m2.ROUTES)
def test_decode_staggered_sparse_padded(device, route):
    """Rows join at different steps (so their cursors are staggered), the
    batch order is reshuffled every step, one row is always padded; free slots
    (and slots before they join) stay bit-identical, padded out untouched."""
    L = 4
    pool = Pool(device, Cfg(route=route, P=24), seed=1, S=8, L=L)
    join = {6: 0, 1: 1, 3: 3, 4: 6}
    free = [0, 2, 5, 7]
    start = pool.snapshot()
    for step in range(6 + 2 * L + 1):
        rows = [s if step >= t else -1 for s, t in join.items()] + [-1]
        perm = torch.randperm(len(rows), generator=pool.gen).tolist()
        pool.step([rows[i] for i in perm], MODE_DECODE, what=f"step {step}")
        fills = {s: int(pool.fill[s]) for s, t in join.items() if step >= t}
        assert fills == {s: (step - t + 1) % L for s, t in join.items() if step >= t}
    assert len({(t % L) for t in join.values()}) > 2  # genuinely staggered fill levels
    for n, t in start.items():
        assert bit_equal(getattr(pool, n)[free], t[free]), n
    assert all(pool.flushes.get(s, 0) >= 2 for s in join), pool.flushes


@pytest.mark.parametrize("route,config", [("output_only", ()), ("reconstruct", (NW2,)),
                                          ("output_only", (SO,)),
                                          ("split", ()),
                                          ("split", FOLD_LAUNCH + (("fold_dot", False),
                                                                   ("out_heads", 2))),
                                          ("split", PROJECT_FOLD),
                                          ("split", PROJECT_FOLD + OUTPUTS)])
def test_dual_precision_fold_copy(device, route, config):
    """bf16 read copy + fp32 fold copy: at each flush the fold copy is the fp32
    reference state (no bf16 drift across flushes), the read copy is it rounded."""
    L = 4
    pool = Pool(device, Cfg(state=BF16, fold=True, route=route, config=config), seed=2, S=5,
                L=L)
    slots = [3, 0, 4]
    pool.step([3, -1, -1], MODE_DECODE)          # stagger: fills 2, 1, 0
    pool.step([3, 0, -1], MODE_DECODE)
    for step in range(3 * L + 1):
        pool.step(slots, MODE_DECODE, what=f"step {step}")
    assert all(pool.flushes.get(s, 0) >= 3 for s in slots), pool.flushes


@pytest.mark.parametrize("state,tol", [(F32, 1e-6), (BF16, 1e-2)], ids=["fp32", "bf16"])
def test_project_fold_bf16_mma_matches_tf32x3(device, state, tol):
    """SplitConfig.fold_bf16 with bf16 activations (a bf16 B ring): (A)'s fold
    dot as bf16 MMAs on the weighted values cut into 3 (fp32 state) or 2
    (bf16) bf16 parts (fold.weighted_dot) against the tf32x3 fold on the same
    pool and inputs, two buffer cycles from staggered cursors: checkpoints
    agree to the state's precision at every step (fp32: 1e-6, the parts keep
    all 24 bits of the values), and both stay on the float64 reference
    (Pool.step checks every output and flushed checkpoint)."""
    L = 4
    cfgs = [Cfg(P=24, state=state, act=BF16, route="split",
                config=PROJECT_FOLD + (("fold_bf16", on),)) for on in (False, True)]
    pools = [Pool(device, c, seed=6, S=6, L=L) for c in cfgs]
    for p in pools:  # stagger: fills 2, 1, 0 before the cycles
        p.step([5, -1, -1], MODE_DECODE)
        p.step([5, 0, -1], MODE_DECODE)
    slots = [5, 0, 2]
    for step in range(2 * L):  # same seed: the same inputs in both pools
        for p in pools:
            p.step(slots, MODE_DECODE, what=f"step {step}")
        assert rel_err(pools[1].checkpoint, pools[0].checkpoint) <= tol, f"step {step}"
    assert all(pools[1].flushes.get(s, 0) >= 2 for s in slots), pools[1].flushes


@pytest.mark.parametrize("cfg", [
    Cfg(P=24, route="split", config=PROJECT_FOLD + (("fold_cols", 16),)),
    Cfg(P=40, state=BF16, fold=True, layout="sglang", route="split",
        config=PROJECT_FOLD + (("fold_cols", 32), BP16)),
], ids=lambda c: c.id)
def test_project_fold_in_column_chunks(device, cfg):
    """The projection's fold over dstate in chunks re-read from memory
    (fold_cols): N=48 (BLOCK_N 64) in chunks of 16 (the last one masked) or
    32, every fill level, >= 2 flushes per row, staggered, one padded row."""
    L = 4
    pool = Pool(device, cfg, seed=21, S=6, L=L, N=48)
    pool.step([2, -1], MODE_DECODE)  # stagger
    slots = [2, -1, 5]
    for step in range(2 * L + 1):
        pool.step(slots, MODE_DECODE, what=f"step {step}")
    assert all(pool.flushes.get(s, 0) >= 2 for s in (2, 5)), pool.flushes


@pytest.mark.parametrize("knobs", [FOLD_LAUNCH + (("fold_dot", True),),
                                   FOLD_LAUNCH + (("fold_dot", False),), PROJECT_FOLD,
                                   PROJECT_FOLD + OUTPUTS],
                         ids=["dot", "fma", "project_fold", "outputs_in_projection"])
def test_split_matches_fused_over_a_cycle(device, knobs):
    """The split route against the fused one on the same pool and inputs: two
    full buffer cycles from staggered cursors (every row flushes twice, at
    different steps), outputs and checkpoints equal to fp32 rounding at every
    step, the live ring entries bit-identical, the cursors identical."""
    L = 4
    cfgs = [Cfg(P=24), Cfg(P=24, route="split", config=knobs)]
    fold_dot = dict(knobs).get("fold_dot", True)
    pools = [Pool(device, c, seed=3, S=6, L=L) for c in cfgs]
    for p in pools:  # stagger: fills 2, 1, 0 before the cycles
        p.step([5, -1, -1], MODE_DECODE)
        p.step([5, 0, -1], MODE_DECODE)
    slots = [5, 0, 2]
    # fp32 rounding of a different summation order (and, for the FMA fold, of
    # a running instead of a scanned sum of A dt) compounding over flushes
    tol = 1e-6 if fold_dot else 3e-6
    for step in range(2 * L):
        inp = pools[0].inputs(3, 1)
        pools[1].inputs(3, 1)  # keep the generators in step
        outs = [p.run_kernel(MODE_DECODE, p.slot_tensor(slots), inp) for p in pools]
        assert rel_err(outs[1], outs[0]) <= tol, f"step {step}: outputs"
        assert rel_err(pools[1].checkpoint, pools[0].checkpoint) <= tol, f"step {step}"
        for p in pools:
            commit(p.fill, p.origin, p.slot_tensor(slots), mode=MODE_DECODE, buffer_len=L,
                   capacity=p.cap)
        assert bit_equal(pools[0].fill, pools[1].fill)
        assert bit_equal(pools[0].origin, pools[1].origin)
        for s in slots:
            live = [(int(pools[0].origin[s]) + i) % pools[0].cap for i in range(int(pools[0].fill[s]))]
            for n in ("x_buffer", "B_buffer", "dt_buffer"):
                a, b = getattr(pools[0], n)[s][:, live], getattr(pools[1], n)[s][:, live]
                assert bit_equal(a, b), f"step {step}: {n} of slot {s}"
    assert int((pools[0].fill[slots] == 0).sum()) >= 1


@pytest.mark.parametrize("state_dtype,V,hpg", [(F32, 1, 2), (BF16, 3, 4), (F16, 2, 1)])
def test_projection_kernel(device, state_dtype, V, hpg):
    """project_state alone (the split route's (A), family-agnostic): a strided
    state pool (slot stride > H*R*K), rows not a multiple of the tile, K not
    a power of two, V vectors per (row, group), padded rows left untouched."""
    from sglang_replayssm.kernels.common import LaunchConfig
    from sglang_replayssm.kernels.projection import project_state
    gen = torch.Generator().manual_seed(80 + V)
    S, H, R, K = 5, 4, 24, 20
    G = H // hpg
    big = torch.randn(S, H + 1, R, K, generator=gen).to(state_dtype).to(device)
    state = big[:, :H]
    slots = torch.tensor([3, -1, 0, 4], dtype=torch.int64, device=device)
    vec = torch.randn(4, V, G, K, generator=gen).to(BF16).to(device)
    for cfg in (None, LaunchConfig(block=16, num_warps=2)):
        out = torch.full((4, V, H, R), SENTINEL, device=device)
        res = project_state(state, slots, vec if V > 1 else vec[:, 0],
                            out=out if V > 1 else out[:, 0], config=cfg)
        assert res.data_ptr() == out.data_ptr()
        live = slots >= 0
        h = state[slots[live]].double()                               # [nl, H, R, K]
        v = vec[live].double().repeat_interleave(hpg, dim=2)          # [nl, V, H, K]
        ref = torch.einsum("bhrk,bjhk->bjhr", h, v)
        assert rel_err(out[live], ref) <= 1e-6
        assert bool((out[~live] == SENTINEL).all())
    assert project_state(state, slots, vec[:, 0]).shape == (4, H, R)


def test_projection_kernel_window_of_vector_pairs(device):
    """project_state with two window dims, as a GDN verify calls it: vec
    [b, T, 2, G, K] a view into packed rows (q and k of each draft side by
    side, the row wider than both), out [b, T, 2, H, R]."""
    from sglang_replayssm.kernels.projection import project_state
    gen = torch.Generator().manual_seed(85)
    S, H, R, K, T, hpg = 4, 4, 24, 20, 3, 2
    G = H // hpg
    state = torch.randn(S, H, R, K, generator=gen).to(device)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    packed = torch.randn(3, T, 2 * G * K + 7, generator=gen).to(BF16).to(device)
    vec = packed[:, :, :2 * G * K].unflatten(-1, (2, G, K))
    out = project_state(state, slots, vec, heads_per_group=hpg)
    assert out.shape == (3, T, 2, H, R)
    live = slots >= 0
    h = state[slots[live].long()].double()
    v = vec[live].double().repeat_interleave(hpg, dim=3)              # [nl, T, 2, H, K]
    assert rel_err(out[live], torch.einsum("bhrk,btjhk->btjhr", h, v)) <= 1e-6


# --------------------------------------------------------------------------
# verify (chain speculative decoding)
# --------------------------------------------------------------------------

# Each case is 40 interpreted steps (~40-60 s on CI's cores): the
# configurations share cases where they do not interact (the reconstruct
# route takes SGLang's stride-0 layout, a head dim that is not a power of 2
# and the storage ring order in one case).
VERIFY_CASES = [
    (2, 5, Cfg(P=24, config=(BP16, NW2))),
    (3, 6, Cfg(P=24, route="reconstruct", layout="sglang", config=(SO,))),
    (3, 5, Cfg(state=BF16, fold=True, act=BF16, G=1)),
    (2, 5, Cfg(state=BF16, fold=True, config=(BP16, SO))),
]


@pytest.mark.parametrize("T,L,cfg", VERIFY_CASES, ids=lambda v: getattr(v, "id", str(v)))
def test_verify_random_acceptance(device, T, L, cfg):
    """40 verify steps, per-row random accepted counts in [1, T].

    The reference state follows the accepted stream only. For window position
    j the kernel must give the output a sequential decode of drafts 0..j from
    that state gives: for accepted positions these are the accepted tokens'
    outputs; for rejected positions, the draft's output after the accepted
    prefix and the drafts before it. On a flush step the checkpoint must be
    the reference state before the step's window (the committed history)."""
    pool = Pool(device, cfg, seed=10 * T + L, S=7, L=L, T=T)
    slots = [5, 0, -1, 3]
    for step in range(40):
        pool.step(slots, MODE_VERIFY, T=T, what=f"step {step}")
    assert all(pool.flushes.get(s, 0) >= 2 for s in (5, 0, 3)), pool.flushes
    assert pool.wrapped


TREE_CASES = [
    (3, 5, Cfg(P=24, config=(BP16, NW2))),
    (3, 5, Cfg(P=24, state=BF16, fold=True, route="split")),
    (3, 5, Cfg(state=BF16, fold=True, route="reconstruct", config=(SO,))),
]


@pytest.mark.parametrize("T,L,cfg", TREE_CASES, ids=lambda v: getattr(v, "id", str(v)))
def test_tree_verify_random_trees_and_paths(device, T, L, cfg):
    """Tree verify: random draft trees (several roots at times); every
    draft's output against the float64 recurrence along its own path; a
    random accepted path moved into place (accept_path) and committed; >= 2
    verify flushes per row, then decode steps reading the moved entries."""
    pool = Pool(device, cfg, seed=31, S=6, L=L, T=T)
    slots = [4, -1, 1]
    for step in range(10):
        pool.step(slots, MODE_VERIFY, T=T, what=f"step {step}",
                  trees=[random_tree(pool.gen, T) for _ in slots])
    assert all(pool.flushes.get(s, 0) >= 2 for s in (4, 1)), pool.flushes
    for step in range(2):
        pool.step(slots, MODE_DECODE, what=f"decode {step}")


@pytest.mark.parametrize("route,config", [("reconstruct", ()), ("split", ()),
                                          ("output_only", (SO,))])
def test_verify_mixed_with_decode_and_flush(device, route, config):
    """Decode (T=1), verify (T=3) and flush-only steps interleaved on one pool
    sized required_capacity(L, T): decode after verify starts from a moved
    origin, so the ring wraps. route="split": split decode steps between
    fused verify steps (its appended flush token must not disturb them)."""
    T, L = 3, 5
    pool = Pool(device, Cfg(route=route, config=config), seed=21, S=6, L=L, T=T)
    assert pool.cap == required_capacity(L, T)
    slots = [2, -1, 5, 0]
    modes = []
    for step in range(36):
        u = float(torch.rand(1, generator=pool.gen))
        mode = MODE_FLUSH if u < 0.08 else (MODE_DECODE if u < 0.54 else MODE_VERIFY)
        modes.append(mode)
        pool.step(slots, mode, T=T, what=f"step {step} mode {mode}")
    assert modes.count(MODE_DECODE) > 8 and modes.count(MODE_VERIFY) > 8
    assert MODE_FLUSH in modes
    assert all(pool.flushes.get(s, 0) >= 2 for s in (2, 5, 0)), pool.flushes
    assert pool.wrapped


def test_storage_order_covers_a_ring_wider_than_the_decode_window(device):
    """A pool sized for verify windows of T=2 at L=16 has 17 ring entries, one
    more than a decode step's 16 positions: in storage order the fused kernel
    must read the whole ring (BLOCK_S 32, not 16). A verify flush at fill 14
    leaves origin 14, so decode's third entry lands at ring index 16."""
    L, T = 16, 2
    pool = Pool(device, Cfg(config=(SO,)), seed=61, S=3, L=L, T=T)
    for step in range(8):  # fills 0, 2, .., 14 -> flush: fill 2, origin 14
        pool.step([1], MODE_VERIFY, T=T, accepted=[T], what=f"verify {step}")
    assert (int(pool.fill[1]), int(pool.origin[1]), pool.cap) == (2, 14, 17)
    for step in range(16):
        pool.step([1], MODE_DECODE, what=f"decode {step}")
    assert pool.flushes.get(1, 0) == 2, pool.flushes


# --------------------------------------------------------------------------
# flush only
# --------------------------------------------------------------------------

@pytest.mark.parametrize("config", [(), (NW2,), (SO,)], ids=["default", "nw2", "storage"])
@pytest.mark.parametrize("history", ["decode", "verify"])
def test_flush_only(device, history, config):
    """After steps that leave rows at fills 0, 1, 3 (origin moved by verify),
    mamba2_replay_flush + commit(MODE_FLUSH) makes the checkpoint the
    reference state (an empty row's untouched), fill = origin = 0; decoding
    then still matches."""
    L, T = 5, 2
    pool = Pool(device, Cfg(P=24, config=config), seed=31, S=6, L=L, T=T)
    mode = MODE_DECODE if history == "decode" else MODE_VERIFY
    slots = [2, 5, 0]
    if mode == MODE_DECODE:
        schedule = [[-1, 5, 0], [-1, -1, 0], [-1, -1, 0]]
        accepted = [None] * 3
    else:  # slot 0: fill 2 -> 4 -> flush (fill 1, origin 4) -> 3
        schedule = [[-1, 5, 0], [-1, -1, 0], [-1, -1, 0], [-1, -1, 0]]
        accepted = [[1, 1, 2], [1, 1, 2], [1, 1, 1], [1, 1, 2]]
    for rows, acc in zip(schedule, accepted):
        pool.step(rows, mode, T=T, accepted=acc)
    assert pool.fill[slots].tolist() == [0, 1, 3]
    if mode == MODE_VERIFY:
        assert int(pool.origin[0]) != 0
    ckpt_empty = pool.checkpoint[2].clone()
    flushed = pool.step(slots, MODE_FLUSH)
    assert sorted(flushed) == [0, 5]
    assert bit_equal(pool.checkpoint[2], ckpt_empty)
    pool.check_checkpoint(slots)
    for step in range(L + 1):
        pool.step(slots, MODE_DECODE, what=f"decode after flush {step}")


# --------------------------------------------------------------------------
# teeth: the checks above do catch a wrong buffer / checkpoint
# --------------------------------------------------------------------------

@pytest.mark.parametrize("target,live", [
    ("x_buffer", True), ("B_buffer", True), ("dt_buffer", True), ("checkpoint", True),
    ("x_buffer", False), ("B_buffer", False), ("dt_buffer", False),
])
def test_corrupted_entry_is_detected(device, target, live):
    """Corrupting a live ring entry (or the checkpoint) of one row makes that
    row's output miss the reference far beyond tolerance; corrupting a dead
    entry (past the row's fill) changes nothing."""
    L = 6
    pool = Pool(device, Cfg(), seed=50, S=4, L=L)
    slots = pool.slot_tensor([1, 3])
    for _ in range(3):                       # fill 3, entries 0..2 live
        pool.step(slots, MODE_DECODE)
    s = 1
    pos = (int(pool.origin[s]) + (1 if live else int(pool.fill[s]) + 1)) % pool.cap
    with torch.no_grad():
        if target == "x_buffer":
            buf = pool.x_buffer[s, :, pos, :]
        elif target == "B_buffer":
            buf = pool.B_buffer[s, :, pos, :]
        elif target == "dt_buffer":
            buf = pool.dt_buffer[s, :, pos]
        if target != "checkpoint":  # live: a plausible wrong value; dead: NaN -> huge
            buf.copy_(buf + 1.0 if live else torch.full_like(buf, 1e30))
        else:
            pool.checkpoint[s] += 0.5
    inp = pool.inputs(2, 1)
    out = pool.run_kernel(MODE_DECODE, slots, inp)
    _, y_ref, _ = pool.ref_chain(slots, inp)
    err_bad, err_good = rel_err(out[0], y_ref[0]), rel_err(out[1], y_ref[1])
    assert err_good <= pool.tol_out
    if live:
        assert err_bad > 100 * pool.tol_out, f"corruption of {target} not detected: {err_bad:.2e}"
    else:
        assert err_bad <= pool.tol_out


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------

def _bad_cases():
    def set_(**changes):
        def f(kw):
            for k, fn in changes.items():
                kw[k] = fn(kw)
        return f

    def nan_x(kw):
        kw["x"] = kw["x"].clone()
        kw["x"][0, 1, 2] = float("nan")

    def short_ring(kw):  # capacity L - 2 < required_capacity(L, 1) = L - 1
        for n in ("x_buffer", "B_buffer", "dt_buffer"):
            kw[n] = kw[n][:, :, :-1].contiguous()

    H, P, N = lambda kw: kw["x"].shape[1], lambda kw: kw["x"].shape[2], \
        lambda kw: kw["B"].shape[-1]
    return [
        ("dt_buffer_bf16", set_(dt_buffer=lambda kw: kw["dt_buffer"].bfloat16()),
         "dt_buffer must be float32"),
        ("cursors_int64", set_(fill=lambda kw: kw["fill"].long()),
         "cursors fill/origin must be int32"),
        ("checkpoint_f64", set_(checkpoint=lambda kw: kw["checkpoint"].double()),
         "checkpoint dtype"),
        ("x_buffer_shape", set_(x_buffer=lambda kw: kw["x_buffer"][..., :-1].contiguous()),
         r"x_buffer must be \["),
        ("dt_buffer_shape", set_(dt_buffer=lambda kw: kw["dt_buffer"][:-1]),
         r"dt_buffer must be \["),
        ("B_shape", set_(B=lambda kw: kw["B"][..., :-1].contiguous()), r"B must be \["),
        ("x_headdim", set_(x=lambda kw: torch.cat([kw["x"], kw["x"][..., :1]], -1)),
         r"x must be \["),
        ("slot_ids_float", set_(slot_ids=lambda kw: kw["slot_ids"].float()),
         "slot_ids must be a 1-D"),
        ("ring_too_short", short_ring, r"capacity \d+ is too short"),
        ("A_untied", set_(A=lambda kw: -torch.rand(H(kw), P(kw), N(kw), device=kw["x"].device)),
         "`A` tied across headdim"),
        ("D_untied", set_(D=lambda kw: torch.randn(H(kw), P(kw), device=kw["x"].device)),
         "`D` tied across headdim"),
        ("dt_untied", set_(dt=lambda kw: kw["dt"][..., None].repeat(1, 1, P(kw))),
         "`dt` tied across headdim"),
        ("nan_in_x", nan_x, "`x` contains NaN"),
        ("fill_out_of_range", set_(fill=lambda kw: torch.full_like(kw["fill"], 9)),
         "cursor fill out of range"),
        ("fold_shape", set_(checkpoint_fold=lambda kw: kw["checkpoint"][:-1].float()),
         "checkpoint_fold must have the checkpoint.s shape"),
    ]


BAD_CASES = _bad_cases()


@pytest.mark.parametrize("name,mutate,match", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_decode_rejects_bad_input(device, name, mutate, match):
    pool = Pool(device, Cfg(), seed=60, S=4, L=4)
    inp = pool.inputs(2, 1)
    kw = dict(zip(["checkpoint", "x_buffer", "B_buffer", "dt_buffer", "fill", "origin"],
                  pool.pool_args()))
    kw.update(slot_ids=pool.slot_tensor([2, 0]), A=pool.A,
              **{k: None if v is None else v[:, 0] for k, v in inp.items()},
              **pool.kernel_kwargs())
    mamba2_replay_decode(**dict(kw, checkpoint=kw["checkpoint"].clone(),
                                x_buffer=kw["x_buffer"].clone(), B_buffer=kw["B_buffer"].clone(),
                                dt_buffer=kw["dt_buffer"].clone()))  # the unmodified call is fine
    mutate(kw)
    before = pool.snapshot()
    with pytest.raises((ValueError, TypeError), match=match):
        mamba2_replay_decode(**kw)
    for n, t in before.items():  # rejected before any launch: nothing written
        assert bit_equal(getattr(pool, n), t), n


def test_split_route_rejects_bad_config(device):
    """A SplitConfig whose out_heads does not divide the heads per group, or
    that overlaps (B) with a projection that does not fold, is refused before
    any launch."""
    pool = Pool(device, Cfg(route="split"), seed=62, S=4, L=4, T=2)
    inp = pool.inputs(2, 2)
    kw = dict(pool.kernel_kwargs(), route="split")
    before = pool.snapshot()
    cfg = replace(m2.default_config(pool.P, pool.N, F32, route="split"), out_heads=3)
    sq = {k: None if v is None else v[:, 0] for k, v in inp.items()}
    with pytest.raises(ValueError, match="out_heads=3 must divide"):
        mamba2_replay_decode(*pool.pool_args(), pool.slot_tensor([0, 1]), sq["x"], sq["dt"],
                             pool.A, sq["B"], sq["C"], z=sq["z"], **dict(kw, config=cfg))
    # overlapping (B) with (A) needs the fold inside (A): else (C) follows (B)
    cfg = replace(m2.default_config(pool.P, pool.N, F32, route="split"), project_fold=False,
                  overlap=True)
    with pytest.raises(ValueError, match="SplitConfig.overlap needs project_fold"):
        mamba2_replay_decode(*pool.pool_args(), pool.slot_tensor([0, 1]), sq["x"], sq["dt"],
                             pool.A, sq["B"], sq["C"], z=sq["z"], **dict(kw, config=cfg))
    for n, t in before.items():
        assert bit_equal(getattr(pool, n), t), n


@pytest.mark.parametrize("case", ["window_ge_buffer_len", "ring_too_short"])
def test_verify_rejects_bad_window(device, case):
    L = 4
    if case == "window_ge_buffer_len":
        T, pool_T, match = L, 1, "must exceed the speculative window"
    else:  # a decode-sized ring cannot hold a verify window of 3
        T, pool_T, match = 3, 1, r"capacity \d+ is too short .* window of 3"
    pool = Pool(device, Cfg(), seed=61, S=4, L=L, T=pool_T)
    inp = pool.inputs(2, T)
    with pytest.raises(ValueError, match=match):
        mamba2_replay_verify(*pool.pool_args(), pool.slot_tensor([0, 1]), inp["x"], inp["dt"],
                             pool.A, inp["B"], inp["C"], z=inp["z"], **pool.kernel_kwargs())


def test_kernels_run_interpreted_without_cuda():
    """conftest set TRITON_INTERPRET early enough (before the kernels' import)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction
    from sglang_replayssm.kernels import cursors, projection
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for fn in (m2._mamba2_replay_kernel, m2._mamba2_split_outputs_kernel,
               m2._mamba2_split_fold_kernel, m2._mamba2_split_projection_kernel,
               projection._projection_kernel,
               cursors._commit_kernel):
        assert isinstance(fn, InterpretedFunction)


# --------------------------------------------------------------------------
# GPU: against SGLang's own stock decode kernel
# --------------------------------------------------------------------------

@pytest.mark.gpu
def test_decode_matches_sglang_stock_kernel():
    """Decode kernel (fp32 state) vs SGLang 0.5.17's Triton
    ``selective_state_update`` called the way SGLang's Mamba-2 mixer calls it:
    A [H,P,N], dt [b,H,P], D / dt_bias [H,P] all expanded with stride 0,
    z=None, dt_softplus=True, int32 state_batch_indices with a padded row."""
    mamba_ssm = pytest.importorskip("sglang.kernels.ops.mamba.triton_ops.mamba_ssm")
    dev = "cuda"
    H, P, N, G, L, S = 8, 64, 128, 2, 4, 6
    gen = torch.Generator().manual_seed(70)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    A_h = -torch.exp(torch.rand(H, generator=gen) * torch.log(torch.tensor(16.0)))
    A = A_h.to(dev)[:, None, None].expand(H, P, N)
    D = r(H).to(dev)[:, None].expand(H, P)
    dt_bias = (r(H) * 0.5 - 2.0).to(dev)[:, None].expand(H, P)
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device=dev)
    live = slots >= 0
    ls = slots[live].long()
    b = len(slots)
    h0 = (r(S, H, P, N) * 0.5).to(dev)
    stock_state = h0.clone()
    ref_state = h0.double()
    cap = required_capacity(L, 1)
    checkpoint = h0.clone()
    x_buffer = torch.zeros(S, H, cap, P, device=dev)
    B_buffer = torch.zeros(S, G, cap, N, device=dev)
    dt_buffer = torch.zeros(S, H, cap, device=dev)
    fill = torch.zeros(S, dtype=torch.int32, device=dev)
    origin = torch.zeros(S, dtype=torch.int32, device=dev)
    n_flush = 0
    for step in range(2 * L + 1):
        x = r(b, H, P).to(dev)
        dt = r(b, H).to(dev)[:, :, None].expand(b, H, P)
        B = (r(b, G, N) * N ** -0.25).to(dev)
        C = (r(b, G, N) * N ** -0.25).to(dev)
        assert A.stride(-1) == A.stride(-2) == dt.stride(-1) == D.stride(-1) == 0
        out_stock = torch.full((b, H, P), SENTINEL, device=dev)
        mamba_ssm.selective_state_update(
            stock_state, x, dt, A, B, C, D=D, z=None, dt_bias=dt_bias, dt_softplus=True,
            state_batch_indices=slots, pad_slot_id=-1, out=out_stock)
        y_ref = selective_state_update_ref(ref_state, x, dt, A, B, C, D=D, dt_bias=dt_bias,
                                           dt_softplus=True, state_batch_indices=slots)
        flush = bool((fill[ls] + 1 >= L).all())
        out = torch.full((b, H, P), SENTINEL, device=dev)
        mamba2_replay_decode(checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slots,
                             x, dt, A, B, C, buffer_len=L, D=D, z=None, dt_bias=dt_bias,
                             dt_softplus=True, out=out, validate=True)
        commit(fill, origin, slots, mode=MODE_DECODE, buffer_len=L, capacity=cap)
        torch.cuda.synchronize()
        err = rel_err(out[live], out_stock[live].double())
        assert err <= 1e-5, f"step {step}: replay vs stock {err:.2e}"
        assert rel_err(out_stock[live], y_ref[live]) <= 1e-5, f"step {step}: stock vs f64"
        assert bool((out[~live] == SENTINEL).all())
        if flush:
            n_flush += 1
            err = rel_err(checkpoint[ls], stock_state[ls].double())
            assert err <= 1e-5, f"step {step}: checkpoint vs stock state {err:.2e}"
    assert n_flush == 2


def test_auto_route_follows_the_measured_crossover():
    """"auto": decode takes the fused kernel below SPLIT_MIN_BATCH, split from
    it on; a GDN verify split from VERIFY_SPLIT_MIN_BATCH (Mamba-2's verify
    split route is not timed yet); flush only the fused kernel."""
    from sglang_replayssm.kernels import gdn_replay

    for mod in (m2, gdn_replay):
        for dt in (torch.float32, torch.bfloat16):
            assert mod.default_route(1, dt) == "output_only"
            assert mod.default_route(mod.SPLIT_MIN_BATCH - 1, dt) == "output_only"
            assert mod.default_route(mod.SPLIT_MIN_BATCH, dt) == "split"
            assert mod.default_route(256, dt, MODE_FLUSH) == "output_only"
    v = gdn_replay.VERIFY_SPLIT_MIN_BATCH
    for dt in (torch.float32, torch.bfloat16):
        assert m2.default_route(256, dt, MODE_VERIFY) == "output_only"
        assert gdn_replay.default_route(v - 1, dt, MODE_VERIFY) == "output_only"
        assert gdn_replay.default_route(v, dt, MODE_VERIFY) == "split"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    Cfg(P=24, route="split", config=PROJECT_FOLD + (("overlap", True),)),
    Cfg(P=24, state=BF16, act=BF16, layout="sglang", route="split",
        config=PROJECT_FOLD + (("overlap", True), ("out_heads", 2), ("fold_cols", 16))),
    Cfg(P=24, route="split", config=PROJECT_FOLD + OUTPUTS + (("overlap", True),)),
    Cfg(P=24, state=BF16, act=BF16, layout="sglang", route="split",
        config=PROJECT_FOLD + OUTPUTS + (("overlap", True), ("fold_cols", 16))),
], ids=lambda c: c.id)
def test_split_route_overlapped(cfg):
    """SplitConfig.overlap: (B) starts before (A) has finished and waits for
    it only before reading the projection; every fill level, >= 2 flushes
    per row, staggered, one padded row, against the float64 reference."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    L = 4
    pool = Pool("cuda", cfg, seed=31, S=6, L=L)
    pool.step([2, -1], MODE_DECODE)  # stagger
    slots = [2, -1, 5, 1]
    for step in range(2 * L + 1):
        pool.step(slots, MODE_DECODE, what=f"step {step}")
    assert all(pool.flushes.get(s, 0) >= 2 for s in (2, 5, 1)), pool.flushes
