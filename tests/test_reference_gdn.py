"""The Gated DeltaNet float64 oracles agree with each other (and, on CUDA,
with SGLang's stock packed decode kernel).

* eager stepping (``gdn_step_ref``, SGLang's packed-decode semantics) and the
  replay form (``gdn_replay_outputs_ref`` from a checkpoint, then
  ``gdn_replay_fold_ref`` into the next checkpoint) give the same outputs and
  states over many buffer cycles, for GVA ratios HV/H in {1, 2, 4};
* ``gdn_packed_decode_ref`` is exactly prepare + step; padded rows leave the
  pool untouched and output zeros; the gates and the q/k l2 norm follow the
  stock kernel's formulas;
* ``gdn_packed_decode_ref`` vs SGLang's own
  ``fused_recurrent_gated_delta_rule_packed_decode``: on a small shape under
  TRITON_INTERPRET (one global of the kernel module rebound, see
  ``_stock_packed_decode``), and, ``@pytest.mark.gpu``, on a reduced
  Qwen3-Next shape with bf16 inputs.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sglang_replayssm.reference import (gdn_packed_decode_ref, gdn_prepare_ref,
                                        gdn_replay_fold_ref, gdn_replay_outputs_ref,
                                        gdn_step_ref)

F64 = torch.float64


def _rel_err(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def _params(gen, HV, dtype=F64):
    A_log = (torch.rand(HV, generator=gen, dtype=F64) * 2 - 1.5).to(dtype)
    dt_bias = (torch.randn(HV, generator=gen, dtype=F64) * 0.5).to(dtype)
    return A_log, dt_bias


def _raw(gen, batch, H, HV, K, V, dtype=F64):
    mixed = torch.randn(batch, 2 * H * K + HV * V, generator=gen, dtype=F64)
    a = torch.randn(batch, HV, generator=gen, dtype=F64)
    b = torch.randn(batch, HV, generator=gen, dtype=F64) * 2
    return mixed.to(dtype), a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("K,V", [(16, 16), (16, 32)])
def test_replay_matches_eager_over_cycles(ratio, K, V):
    gen = torch.Generator().manual_seed(100 * ratio + V)
    H = 2
    HV = H * ratio
    A_log, dt_bias = _params(gen, HV)
    scale = K ** -0.5
    cycles = [1, 4, 7, 0, 3, 8, 5]          # >= 5 non-empty buffer cycles
    ckpt = torch.randn(HV, V, K, generator=gen, dtype=F64) * 0.3
    pool = ckpt[None].clone()               # one-slot pool stepped eagerly
    for L in cycles:
        mixed, a, b = _raw(gen, L, H, HV, K, V)
        p = gdn_prepare_ref(mixed, a, b, A_log, dt_bias, H, HV, K, V, scale)
        o_eager = torch.stack([
            gdn_step_ref(pool, p["q"][t:t + 1], p["k"][t:t + 1], p["v"][t:t + 1],
                         p["g"][t:t + 1], p["beta"][t:t + 1])[0]
            for t in range(L)]) if L else torch.zeros(0, HV, V, dtype=F64)
        o_rep, u = gdn_replay_outputs_ref(ckpt, p["q"], p["k"], p["v"], p["g"], p["beta"])
        assert o_rep.shape == (L, HV, V) and u.shape == (L, HV, V)
        if L:
            assert _rel_err(o_rep, o_eager) < 1e-12
        ckpt = gdn_replay_fold_ref(ckpt, p["k"], p["g"], u)
        assert ckpt.shape == (HV, V, K)
        assert _rel_err(ckpt, pool[0]) < 1e-12


def test_replay_u_is_the_eager_delta():
    """u_t from the replay form is the v' the eager step writes into the state."""
    gen = torch.Generator().manual_seed(7)
    H, HV, K, V, n = 2, 4, 16, 32, 6
    A_log, dt_bias = _params(gen, HV)
    p = gdn_prepare_ref(*_raw(gen, n, H, HV, K, V), A_log, dt_bias, H, HV, K, V, K ** -0.5)
    h = torch.randn(HV, V, K, generator=gen, dtype=F64)
    _, u = gdn_replay_outputs_ref(h, p["q"], p["k"], p["v"], p["g"], p["beta"])
    kh = p["k"].repeat_interleave(HV // H, dim=1)
    for t in range(n):
        h = h * torch.exp(p["g"][t])[:, None, None]
        ut = p["beta"][t][:, None] * (p["v"][t] - torch.einsum("hvk,hk->hv", h, kh[t]))
        assert _rel_err(u[t], ut) < 1e-12
        h = h + ut[:, :, None] * kh[t][:, None, :]


def test_gva_mapping_is_hv_div_ratio():
    """v-head hv reads k-head hv // (HV // H) (fused_recurrent.py l.214), checked
    head by head against a hand-written single-head step."""
    gen = torch.Generator().manual_seed(3)
    H, HV, K, V, batch = 2, 8, 16, 16, 3
    r = HV // H
    A_log, dt_bias = _params(gen, HV)
    p = gdn_prepare_ref(*_raw(gen, batch, H, HV, K, V), A_log, dt_bias, H, HV, K, V, 0.25)
    pool = torch.randn(batch, HV, V, K, generator=gen, dtype=F64)
    before = pool.clone()
    o = gdn_step_ref(pool, p["q"], p["k"], p["v"], p["g"], p["beta"])
    for n in range(batch):
        for hv in range(HV):
            q, k = p["q"][n, hv // r], p["k"][n, hv // r]
            h = before[n, hv] * math.exp(p["g"][n, hv].item())
            u = p["beta"][n, hv] * (p["v"][n, hv] - h @ k)
            h = h + torch.outer(u, k)
            assert torch.allclose(pool[n, hv], h, rtol=0, atol=1e-13)
            assert torch.allclose(o[n, hv], h @ q, rtol=0, atol=1e-13)


def test_packed_decode_is_prepare_plus_step_and_pads_untouched():
    gen = torch.Generator().manual_seed(11)
    H, HV, K, V, S = 2, 4, 16, 32, 8
    A_log, dt_bias = _params(gen, HV)
    idx = torch.tensor([5, -1, 0, 3, -7, 6], dtype=torch.int32)   # -7: any negative pads
    mixed, a, b = _raw(gen, idx.numel(), H, HV, K, V)
    pool = torch.randn(S, HV, V, K, generator=gen, dtype=F64)
    p1, p2 = pool.clone(), pool.clone()
    o1 = gdn_packed_decode_ref(p1, mixed, a, b, A_log, dt_bias, K ** -0.5, idx, H, HV, K, V)
    p = gdn_prepare_ref(mixed, a, b, A_log, dt_bias, H, HV, K, V, K ** -0.5)
    o2 = gdn_step_ref(p2, p["q"], p["k"], p["v"], p["g"], p["beta"], state_batch_indices=idx)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
    live = idx >= 0
    assert torch.all(o1[~live] == 0)                  # stock kernel stores zeros (l.225-228)
    assert torch.all(o1[live].abs().sum((-1, -2)) > 0)
    touched = set(idx[live].tolist())
    for s in range(S):
        assert torch.equal(p1[s], pool[s]) == (s not in touched)
    # a non-default pad id is honoured too
    p3 = pool.clone()
    o3 = gdn_step_ref(p3, p["q"], p["k"], p["v"], p["g"], p["beta"],
                      state_batch_indices=idx, pad_slot_id=5)
    assert torch.all(o3[0] == 0) and torch.equal(p3[5], pool[5])
    # all padded: nothing happens
    p4 = pool.clone()
    o4 = gdn_step_ref(p4, p["q"], p["k"], p["v"], p["g"], p["beta"],
                      state_batch_indices=torch.full_like(idx, -1))
    assert torch.all(o4 == 0) and torch.equal(p4, pool)


def test_step_rounds_pool_back_to_its_dtype():
    gen = torch.Generator().manual_seed(5)
    H, HV, K, V = 1, 2, 16, 16
    A_log, dt_bias = _params(gen, HV)
    p = gdn_prepare_ref(*_raw(gen, 2, H, HV, K, V), A_log, dt_bias, H, HV, K, V, 0.25)
    pool32 = torch.randn(2, HV, V, K, generator=gen)
    pool64 = pool32.to(F64)
    o32 = gdn_step_ref(pool32, p["q"], p["k"], p["v"], p["g"], p["beta"])
    o64 = gdn_step_ref(pool64, p["q"], p["k"], p["v"], p["g"], p["beta"])
    assert pool32.dtype == torch.float32 and o32.dtype == F64
    assert torch.equal(o32, o64)                      # computed in float64 from the same state
    assert torch.equal(pool32, pool64.to(torch.float32))


def test_l2norm_scale_and_gates():
    gen = torch.Generator().manual_seed(9)
    H, HV, K, V, batch = 2, 4, 16, 16, 5
    A_log, dt_bias = _params(gen, HV)
    mixed, a, b = _raw(gen, batch, H, HV, K, V)
    mixed[0, :H * K] *= 1e-4                          # tiny q: eps matters
    a[1, 0] = 30.0                                    # above the softplus threshold
    scale = 0.37
    p = gdn_prepare_ref(mixed, a, b, A_log, dt_bias, H, HV, K, V, scale)
    q_raw = mixed[:, :H * K].reshape(batch, H, K)
    k_raw = mixed[:, H * K:2 * H * K].reshape(batch, H, K)
    for raw, got, s in ((q_raw, p["q"], scale), (k_raw, p["k"], 1.0)):
        ss = (raw * raw).sum(-1)
        expect = raw / torch.sqrt(ss + 1e-6)[..., None] * s
        assert torch.allclose(got, expect, rtol=1e-15, atol=0)
        norm = got.norm(dim=-1) / s
        assert torch.allclose(norm, torch.sqrt(ss / (ss + 1e-6)), rtol=1e-14, atol=0)
        big = ss > 1.0
        assert torch.all((norm[big] - 1).abs() < 1e-6)
    assert p["q"][0].norm(dim=-1).max() < 0.99 * scale    # eps visible for a tiny q
    assert torch.equal(p["v"], mixed[:, 2 * H * K:].reshape(batch, HV, V))
    x = a + dt_bias[None]
    sp = torch.where(x <= 20, torch.log1p(torch.exp(x)), x)
    assert torch.allclose(p["g"], -torch.exp(A_log)[None] * sp, rtol=1e-15, atol=0)
    assert p["g"][1, 0] == -torch.exp(A_log[0]) * x[1, 0]
    assert torch.allclose(p["beta"], torch.sigmoid(b), rtol=1e-15, atol=0)
    # no l2 norm: raw q * scale, raw k
    p0 = gdn_prepare_ref(mixed, a, b, A_log, dt_bias, H, HV, K, V, scale, use_qk_l2norm=False)
    assert torch.equal(p0["q"], q_raw * scale) and torch.equal(p0["k"], k_raw)
    # beta is rounded to b's dtype like the stock kernel (l.254)
    b16 = b.to(torch.bfloat16)
    p16 = gdn_prepare_ref(mixed, a, b16, A_log, dt_bias, H, HV, K, V, scale)
    assert p16["beta"].dtype == F64
    assert torch.equal(p16["beta"], torch.sigmoid(b16.to(F64)).to(torch.bfloat16).to(F64))
    with pytest.raises(ValueError):
        gdn_prepare_ref(mixed[:, 1:], a, b, A_log, dt_bias, H, HV, K, V, scale)


def _stock_packed_decode(monkeypatch):
    """SGLang's stock packed decode, runnable on CPU under TRITON_INTERPRET=1.

    The kernel calls ``exp`` imported from fla/op.py (a bare ``tl.exp``); the
    interpreter only patches ``tl.*`` reached through the module, so under
    the interpreter that global is rebound to a wrapper for this test. On a
    GPU nothing is patched."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    import sglang.kernels.ops.attention.fla.fused_recurrent as fr
    interpreted = isinstance(fr.fused_recurrent_gated_delta_rule_packed_decode_kernel,
                             InterpretedFunction)
    if interpreted:
        monkeypatch.setattr(fr, "exp", lambda x: tl.exp(x))
    elif not torch.cuda.is_available():
        pytest.skip("stock kernel needs CUDA or TRITON_INTERPRET=1 at import")
    return fr.fused_recurrent_gated_delta_rule_packed_decode, ("cpu" if interpreted else "cuda")


@pytest.mark.filterwarnings("ignore:Triton is not supported on current platform")
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_packed_decode_ref_matches_stock_kernel_small(monkeypatch, ratio):
    """The real SGLang kernel (interpreted on CPU, native on CUDA), small shape.

    a / b are fp32 here: the Triton interpreter casts fp32 -> bf16 by
    truncation (triton/runtime/interpreter.py, cast_impl -> _convert_float
    with rounding_mode None) whereas GPUs round to nearest even, so the
    kernel's ``sigmoid(b).to(b.dtype)`` for a bf16 b is an interpreter
    artefact on CPU; the bf16-b path is checked by the GPU test below."""
    stock, dev = _stock_packed_decode(monkeypatch)
    gen = torch.Generator().manual_seed(40 + ratio)
    H, K, V, S = 2, 16, 32, 6
    HV = H * ratio
    idx = torch.tensor([4, -1, 0, 2], dtype=torch.int32, device=dev)
    B = idx.numel()
    A_log, dt_bias = (t.to(dev, torch.float32) for t in _params(gen, HV))
    pool = (torch.randn(S, HV, V, K, generator=gen) * 0.1).to(dev)
    pool_ref, pool0 = pool.clone(), pool.clone()
    for step in range(4):
        mixed, a, b = _raw(gen, B, H, HV, K, V)
        mixed = mixed.to(dev, torch.bfloat16)
        a, b = a.to(dev, torch.float32), b.to(dev, torch.float32)
        out = torch.full((B, 1, HV, V), 7.0, dtype=torch.float32, device=dev)
        stock(mixed_qkv=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5,
              initial_state=pool, out=out, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
        o_ref = gdn_packed_decode_ref(pool_ref, mixed, a, b, A_log, dt_bias, K ** -0.5, idx,
                                      H, HV, K, V)
        assert torch.all(out[1] == 0)
        assert _rel_err(out[:, 0].to(F64), o_ref) < 1e-5, f"step {step}"
        assert _rel_err(pool.to(F64), pool_ref.to(F64)) < 1e-5, f"step {step}"
    for s in (1, 3, 5):
        assert torch.equal(pool[s], pool0[s]) and torch.equal(pool_ref[s], pool0[s])


@pytest.mark.gpu
def test_packed_decode_ref_matches_sglang_stock_kernel():
    """Reduced Qwen3-Next shape: H=4, HV=8, K=V=128, fp32 state pool, bf16
    mixed_qkv / a / b, fp32 A_log / dt_bias, 8 decode steps, one padded row.
    ``out`` is fp32 here (SGLang allocates it in mixed_qkv's dtype) so the
    comparison is not limited by bf16 output rounding."""
    from sglang.kernels.ops.attention.fla.fused_recurrent import (
        fused_recurrent_gated_delta_rule_packed_decode)

    dev = "cuda"
    gen = torch.Generator(device="cpu").manual_seed(2024)
    H, HV, K, V, S, steps = 4, 8, 128, 128, 10, 8
    scale = K ** -0.5
    idx = torch.tensor([7, 2, -1, 0, 9, 4], dtype=torch.int32, device=dev)
    B = idx.numel()
    A_log = (torch.rand(HV, generator=gen) * 2 - 1.5).to(dev)          # fp32
    dt_bias = (torch.randn(HV, generator=gen) * 0.5).to(dev)
    pool = (torch.randn(S, HV, V, K, generator=gen) * 0.1).to(dev)     # fp32
    pool_ref = pool.clone()
    untouched = [s for s in range(S) if s not in set(idx.tolist())]
    pool0 = pool.clone()
    for step in range(steps):
        mixed = torch.randn(B, 2 * H * K + HV * V, generator=gen).to(dev, torch.bfloat16)
        a = torch.randn(B, HV, generator=gen).to(dev, torch.bfloat16)
        b = (torch.randn(B, HV, generator=gen) * 2).to(dev, torch.bfloat16)
        out = torch.full((B, 1, HV, V), 7.0, dtype=torch.float32, device=dev)
        fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=scale,
            initial_state=pool, out=out, ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=True)
        o_ref = gdn_packed_decode_ref(pool_ref, mixed, a, b, A_log, dt_bias, scale, idx,
                                      H, HV, K, V, use_qk_l2norm=True)
        torch.cuda.synchronize()
        o = out[:, 0].to(F64)
        assert torch.all(o[2] == 0), "padded row must be zeroed by the stock kernel"
        assert _rel_err(o, o_ref) < 1e-5, f"step {step}: out rel err {_rel_err(o, o_ref)}"
        assert _rel_err(pool.to(F64), pool_ref.to(F64)) < 1e-5, f"step {step}: state"
    assert torch.equal(pool[untouched], pool0[untouched])
    assert torch.equal(pool_ref[untouched], pool0[untouched])
