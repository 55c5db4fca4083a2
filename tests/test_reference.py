"""The float64 oracles agree with each other.

The eager recurrence (``selective_state_update_ref``, SGLang's decode
semantics, stepped token by token) and the replay form (outputs from a
checkpoint plus the buffered inputs, then a fold into the next checkpoint)
must give the same outputs and states over many buffer cycles.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_replayssm.reference import (mamba2_dt_ref, mamba2_replay_fold_ref,
                                        mamba2_replay_outputs_ref, selective_state_update_ref)

F64 = torch.float64
H, P, N, G = 4, 6, 5, 2


def _rel_err(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def _params(gen, nheads=H):
    A = -(torch.rand(nheads, generator=gen, dtype=F64) * 2 + 0.2)
    D = torch.randn(nheads, generator=gen, dtype=F64)
    dt_bias = torch.randn(nheads, generator=gen, dtype=F64) * 0.5
    return A, D, dt_bias


def _tokens(gen, n, batch=None, nheads=H, headdim=P, dstate=N, ngroups=G):
    lead = (n,) if batch is None else (batch,)
    return dict(
        x=torch.randn(*lead, nheads, headdim, generator=gen, dtype=F64),
        dt=torch.randn(*lead, nheads, generator=gen, dtype=F64),
        B=torch.randn(*lead, ngroups, dstate, generator=gen, dtype=F64),
        C=torch.randn(*lead, ngroups, dstate, generator=gen, dtype=F64),
        z=torch.randn(*lead, nheads, headdim, generator=gen, dtype=F64),
    )


@pytest.mark.parametrize("use_z", [True, False])
@pytest.mark.parametrize("L", [1, 4, 7])
def test_eager_equals_replay_over_buffer_cycles(L, use_z):
    """Slots stepped eagerly vs replayed from a checkpoint over 6 cycles of L
    tokens each (the fold of one cycle is the next cycle's checkpoint)."""
    gen = torch.Generator().manual_seed(100 + L)
    A, D, dt_bias = _params(gen)
    num_slots, slots = 5, torch.tensor([3, -1, 0])
    live = slots >= 0
    pool = torch.randn(num_slots, H, P, N, generator=gen, dtype=F64)
    pool_start = pool.clone()
    ckpt = {int(s): pool[s].clone() for s in slots[live]}
    for cycle in range(6):
        toks = [_tokens(gen, None, batch=len(slots)) for _ in range(L)]
        y_eager = torch.stack([
            selective_state_update_ref(pool, t["x"], t["dt"], A, t["B"], t["C"], D=D,
                                       z=t["z"] if use_z else None, dt_bias=dt_bias,
                                       dt_softplus=True, state_batch_indices=slots)
            for t in toks])                                              # [L, b, H, P]
        for row in live.nonzero().flatten().tolist():
            s = int(slots[row])
            seq = {k: torch.stack([t[k][row] for t in toks]) for k in toks[0]}
            dte = mamba2_dt_ref(seq["dt"], dt_bias, True)
            y_rep = mamba2_replay_outputs_ref(ckpt[s], seq["x"], dte, A, seq["B"], seq["C"],
                                              D=D, z=seq["z"] if use_z else None)
            assert _rel_err(y_rep, y_eager[:, row]) < 1e-12, (cycle, s)
            ckpt[s] = mamba2_replay_fold_ref(ckpt[s], seq["x"], dte, A, seq["B"])
            assert _rel_err(ckpt[s], pool[s]) < 1e-12, (cycle, s)
        assert torch.equal(y_eager[:, ~live], torch.zeros_like(y_eager[:, ~live]))
    untouched = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], pool_start[untouched])


def test_replay_outputs_are_prefix_consistent():
    """Output t of the replay form depends only on tokens <= t, and folding a
    prefix then replaying the rest equals replaying everything."""
    gen = torch.Generator().manual_seed(7)
    A, D, _ = _params(gen)
    h = torch.randn(H, P, N, generator=gen, dtype=F64)
    t = _tokens(gen, 9)
    dte = F.softplus(t["dt"])
    y_all = mamba2_replay_outputs_ref(h, t["x"], dte, A, t["B"], t["C"], D=D, z=t["z"])
    k = 4
    y_pre = mamba2_replay_outputs_ref(h, t["x"][:k], dte[:k], A, t["B"][:k], t["C"][:k], D=D,
                                      z=t["z"][:k])
    h_k = mamba2_replay_fold_ref(h, t["x"][:k], dte[:k], A, t["B"][:k])
    y_post = mamba2_replay_outputs_ref(h_k, t["x"][k:], dte[k:], A, t["B"][k:], t["C"][k:],
                                       D=D, z=t["z"][k:])
    assert _rel_err(y_pre, y_all[:k]) < 1e-12
    assert _rel_err(y_post, y_all[k:]) < 1e-12
    assert torch.equal(mamba2_replay_fold_ref(h, t["x"][:0], dte[:0], A, t["B"][:0]), h)


def test_eager_step_matches_scalar_loop():
    """One eager step against a plain per-element loop: group h // (H/G),
    softplus(dt + bias), D skip, silu(z) gate."""
    gen = torch.Generator().manual_seed(3)
    A, D, dt_bias = _params(gen)
    state = torch.randn(2, H, P, N, generator=gen, dtype=F64)
    t = _tokens(gen, None, batch=1)
    h0 = state[1].clone()
    y = selective_state_update_ref(state, t["x"], t["dt"], A, t["B"], t["C"], D=D, z=t["z"],
                                   dt_bias=dt_bias, state_batch_indices=torch.tensor([1]))
    for hd in range(H):
        g = hd // (H // G)
        dte = float(F.softplus(t["dt"][0, hd] + dt_bias[hd]))
        decay = torch.exp(torch.tensor(dte * float(A[hd]), dtype=F64))
        for p in range(P):
            acc = 0.0
            for n in range(N):
                hn = decay * h0[hd, p, n] + dte * t["x"][0, hd, p] * t["B"][0, g, n]
                assert abs(float(state[1, hd, p, n] - hn)) < 1e-13
                acc += float(hn * t["C"][0, g, n])
            out = acc + float(D[hd] * t["x"][0, hd, p])
            zz = float(t["z"][0, hd, p])
            out *= zz / (1.0 + torch.exp(torch.tensor(-zz, dtype=F64)).item())
            assert abs(float(y[0, hd, p]) - out) < 1e-12 * max(1.0, abs(out))


def test_dt_softplus_threshold():
    dt = torch.tensor([-30.0, -1.0, 0.0, 5.0, 19.9, 20.0, 20.5, 40.0], dtype=F64)
    got = mamba2_dt_ref(dt, None, True)
    want = torch.where(dt <= 20, torch.log1p(torch.exp(dt)), dt)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-300)
    assert torch.equal(mamba2_dt_ref(dt, None, False), dt)


@pytest.mark.parametrize("state_dtype", [F64, torch.float32])
def test_expanded_sglang_layouts_equal_per_head(state_dtype):
    """A [H,P,N], dt [b,H,P], D/dt_bias [H,P], all stride 0 over the expanded
    dims (what SGLang passes), give exactly what the per-head tensors give."""
    gen = torch.Generator().manual_seed(11)
    A, D, dt_bias = _params(gen)
    slots = torch.tensor([2, 0, -1], dtype=torch.int32)
    s_head = torch.randn(3, H, P, N, generator=gen, dtype=F64).to(state_dtype)
    s_exp = s_head.clone()
    A_e, D_e, b_e = A[:, None, None].expand(H, P, N), D[:, None].expand(H, P), \
        dt_bias[:, None].expand(H, P)
    assert A_e.stride() == (1, 0, 0) and D_e.stride() == (1, 0) and b_e.stride() == (1, 0)
    for _ in range(3):
        t = _tokens(gen, None, batch=3)
        dt_e = t["dt"][:, :, None].expand(3, H, P)
        assert dt_e.stride(-1) == 0
        y_head = selective_state_update_ref(s_head, t["x"], t["dt"], A, t["B"], t["C"], D=D,
                                            z=t["z"], dt_bias=dt_bias, state_batch_indices=slots)
        y_exp = selective_state_update_ref(s_exp, t["x"], dt_e, A_e, t["B"], t["C"], D=D_e,
                                           z=t["z"], dt_bias=b_e, state_batch_indices=slots)
        assert torch.equal(y_head, y_exp)
        assert torch.equal(s_head, s_exp)


@pytest.mark.parametrize("slots", [[-1, 2, -1], [-1, -1]], ids=["some_pad", "all_pad"])
def test_pad_slots_leave_pool_untouched(slots):
    gen = torch.Generator().manual_seed(5)
    A, D, dt_bias = _params(gen)
    idx = torch.tensor(slots)
    pool = torch.randn(4, H, P, N, generator=gen, dtype=F64)
    before = pool.clone()
    t = _tokens(gen, None, batch=len(slots))
    y = selective_state_update_ref(pool, t["x"], t["dt"], A, t["B"], t["C"], D=D, z=t["z"],
                                   dt_bias=dt_bias, state_batch_indices=idx)
    pad = idx == -1
    assert torch.equal(y[pad], torch.zeros_like(y[pad]))
    used = idx[~pad].tolist()
    others = [s for s in range(4) if s not in used]
    assert torch.equal(pool[others], before[others])
    for s in used:
        assert not torch.equal(pool[s], before[s])
