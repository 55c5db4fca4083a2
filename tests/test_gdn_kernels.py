"""GDN replay kernels vs the float64 eager recurrence (sglang_replayssm.reference).

CPU runs use the Triton interpreter, which rounds fp32 -> bf16 by truncation
(the GPU rounds to nearest): the gates ``a``/``b`` are therefore fp32 here so
that ``beta``'s rounding to b's dtype is exact on both; the bf16 path of ``b``
is covered by the GPU test against SGLang's kernel.
"""
from __future__ import annotations

import pytest
import torch

from sglang_replayssm.kernels import cursors as cur
from sglang_replayssm.kernels.cursors import MODE_DECODE, MODE_FLUSH, MODE_VERIFY, commit
from sglang_replayssm.kernels.gdn_replay import (gdn_replay_decode, gdn_replay_flush,
                                                 gdn_replay_verify)
from sglang_replayssm.reference import gdn_prepare_ref, gdn_step_ref

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 1e-5, BF16: 2e-2}


class Pool:
    """A GDN layer's pool (checkpoint, rings, cursors) plus its float64 twin."""

    def __init__(self, device, *, H=2, ratio=2, K=16, V=32, S=6, L=4, T=1, state=F32,
                 ring=F32, seed=0):
        self.dev, self.H, self.HV, self.K, self.V, self.S, self.L, self.T = \
            device, H, H * ratio, K, V, S, L, T
        self.gen = torch.Generator().manual_seed(seed)
        self.cap = cur.required_capacity(L, T)
        self.ckpt = (self.randn(S, self.HV, V, K) * 0.3).to(state).to(device)
        self.ref = self.ckpt.double().cpu()
        nan = float("nan")  # unwritten ring entries: reading one must show
        self.kb = torch.full((S, H, self.cap, K), nan, dtype=ring, device=device)
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

    def eager(self, slot, qkv, a, b):
        """One float64 step of the reference on the twin's slot; returns o [HV, V]."""
        p = gdn_prepare_ref(qkv[None].cpu(), a[None].cpu(), b[None].cpu(), self.A_log.cpu(),
                            self.dt_bias.cpu(), self.H, self.HV, self.K, self.V, self.scale)
        st = self.ref[slot:slot + 1].clone()
        o = gdn_step_ref(st, p["q"], p["k"], p["v"], p["g"], p["beta"])[0]
        return o, st[0]

    def pool_args(self):
        return (self.ckpt, self.kb, self.ub, self.gb, self.fill, self.origin)

    def rel(self, got, ref):
        return float((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def decode_steps(pool, slots, steps, check=True):
    """Decode `steps` tokens for `slots`, comparing every output and every flush."""
    flushes = 0
    for _ in range(steps):
        qkv, a, b = pool.inputs(len(slots))
        fill0 = pool.fill.cpu().clone()
        y = gdn_replay_decode(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                              pool.scale, buffer_len=pool.L, num_k_heads=pool.H, validate=True)
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
                assert pool.rel(pool.ckpt[s], pool.ref[s]) < pool.tol
    return flushes


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_decode_across_flushes_staggered_and_padded(device, ratio):
    pool = Pool(device, ratio=ratio, L=4)
    untouched = [0, 2]
    snap = [t.clone() for t in (pool.ckpt[untouched], pool.kb[untouched], pool.ub[untouched])]
    decode_steps(pool, torch.tensor([3], dtype=torch.int32, device=device), 2)  # stagger
    slots = torch.tensor([3, -1, 1, 5], dtype=torch.int32, device=device)
    flushes = decode_steps(pool, slots, 9)
    assert flushes >= 2 * 3  # every live row flushed at least twice
    assert pool.fill.cpu()[[3, 1, 5]].tolist() == [11 % 4, 9 % 4, 9 % 4]
    for a, b in zip(snap, (pool.ckpt[untouched], pool.kb[untouched], pool.ub[untouched])):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())


def test_bf16_state_and_rings(device):
    pool = Pool(device, state=BF16, ring=BF16, L=4, seed=3)
    assert decode_steps(pool, torch.tensor([1, 4], dtype=torch.int32, device=device), 9) >= 4


def test_verify_random_acceptance(device):
    T, L = 2, 5
    pool = Pool(device, ratio=2, L=L, T=T, seed=7)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(11)
    flushes = {4: 0, 1: 0}
    for _ in range(40):
        qkv, a, b = pool.inputs(3, T)
        fill0 = pool.fill.cpu().clone()
        y = gdn_replay_verify(*pool.pool_args(), slots, qkv, a, b, pool.A_log, pool.dt_bias,
                              pool.scale, buffer_len=L, num_k_heads=pool.H, validate=True)
        acc = torch.randint(1, T + 1, (3,), generator=gen, dtype=torch.int32)
        for r, s in enumerate(slots.tolist()):
            if s < 0:
                assert bool((y[r] == 0).all())
                continue
            if fill0[s] + T >= L:  # flushed the committed history before the window
                flushes[s] += 1
                assert pool.rel(pool.ckpt[s], pool.ref[s]) < pool.tol
            state = pool.ref[s].clone()
            for j in range(T):  # every draft's output = sequential decode of the drafts
                saved, pool.ref[s] = pool.ref[s], state
                o, state = pool.eager(s, qkv[r, j], a[r, j], b[r, j])
                pool.ref[s] = saved
                assert pool.rel(y[r, j], o) < pool.tol
                if j + 1 == int(acc[r]):
                    accepted = state.clone()
            pool.ref[s] = accepted
        commit(pool.fill, pool.origin, slots, mode=MODE_VERIFY, buffer_len=L, capacity=pool.cap,
               window=T, accepted=acc.to(device), validate=True)
    assert min(flushes.values()) >= 2
    # decode after verify on the same pool, then a flush-only pass
    decode_steps(pool, slots, 5)
    gdn_replay_flush(*pool.pool_args(), slots, buffer_len=L, num_k_heads=pool.H)
    commit(pool.fill, pool.origin, slots, mode=MODE_FLUSH, buffer_len=L, capacity=pool.cap)
    for s in (4, 1):
        assert int(pool.fill[s]) == 0 and pool.rel(pool.ckpt[s], pool.ref[s]) < pool.tol


def test_flush_only_then_decode(device):
    pool = Pool(device, L=6, seed=5)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=device)
    decode_steps(pool, slots, 3)
    gdn_replay_flush(*pool.pool_args(), slots, buffer_len=pool.L, num_k_heads=pool.H)
    commit(pool.fill, pool.origin, slots, mode=MODE_FLUSH, buffer_len=pool.L, capacity=pool.cap)
    assert pool.fill.cpu()[[2, 0]].tolist() == [0, 0]
    for s in (2, 0):
        assert pool.rel(pool.ckpt[s], pool.ref[s]) < pool.tol
    decode_steps(pool, slots, 7)


def test_corrupted_ring_entry_is_caught(device):
    """Teeth: one corrupted corrected value must move the output off the reference."""
    pool = Pool(device, L=8, seed=9)
    slots = torch.tensor([1], dtype=torch.int32, device=device)
    decode_steps(pool, slots, 3)
    pool.ub[1, 0, 1] += 1.0
    with pytest.raises(AssertionError):
        decode_steps(pool, slots, 1)


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
    assert int(pool.fill[1]) == 0 and bool(pool.kb.isnan().all())  # nothing was written


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
