"""Float64 PyTorch oracles for the SSM recurrences ReplaySSM must agree with.

Two forms per family:

* the *eager* recurrence, stepped token by token, with the semantics of
  SGLang 0.5.17's stock decode kernel (for Mamba-2: ``selective_state_update``
  with ``dt_bias``, softplus, ``D``, the optional ``z`` gate, ngroups and
  padded slots);
* the *replay* form: outputs computed from a checkpoint plus the buffered
  inputs seen since it, and the flush that folds the buffer into the
  checkpoint.

Every kernel in ``sglang_replayssm.kernels`` is tested against these. They are
written for clarity, not speed, and compute in float64 unless told otherwise.

Mamba-2 (per head, state h: [P, N], decay a_t = exp(dt_t * A)):

    h_t = a_t h_{t-1} + dt_t x_t B_t^T            y_t = h_t C_t + D x_t
    with cum_t = sum_{r<=t} dt_r A  (log of the decay since the checkpoint):
    y_t   = exp(cum_t) h_c C_t + sum_{s<=t} exp(cum_t - cum_s) dt_s (B_s . C_t) x_s + D x_t
    flush = exp(cum_n) h_c + sum_{s<=n} exp(cum_n - cum_s) dt_s x_s B_s^T
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "mamba2_dt_ref",
    "selective_state_update_ref",
    "mamba2_replay_outputs_ref",
    "mamba2_replay_fold_ref",
]


def _f64(t):
    return None if t is None else t.to(torch.float64)


def mamba2_dt_ref(dt: torch.Tensor, dt_bias: torch.Tensor | None = None,
                  dt_softplus: bool = True) -> torch.Tensor:
    """Effective step size: ``softplus(dt + dt_bias)`` as SGLang computes it
    (``F.softplus``'s threshold of 20, i.e. identity above 20), in float64."""
    dt = _f64(dt)
    if dt_bias is not None:
        dt = dt + _f64(dt_bias)
    return F.softplus(dt) if dt_softplus else dt


def _gate(y, z):
    if z is None:
        return y
    z = _f64(z)
    return y * z * torch.sigmoid(z)


def _expand_groups(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    ngroups = t.shape[-2]
    return t.repeat_interleave(nheads // ngroups, dim=-2)


def selective_state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus=True, state_batch_indices=None,
                               pad_slot_id: int = -1):
    """One eager Mamba-2 decode step on a state pool, in float64.

    Same contract as SGLang's ``selective_state_update`` at decode:

    state: [num_slots, H, P, N]  (any float dtype; updated in place, rounded
           back to its dtype, like the stock kernel)
    x:     [batch, H, P]          dt: [batch, H, P] or [batch, H]
    A:     [H, P, N] or [H]       B, C: [batch, G, N]
    D:     [H, P] or [H] or None  z: [batch, H, P] or None
    dt_bias: [H, P] or [H] or None
    state_batch_indices: [batch] int, rows equal to ``pad_slot_id`` are skipped
           (their output stays untouched: zeros in the returned tensor).
    Returns y: [batch, H, P] float64.
    """
    batch, H, P = x.shape
    idx = (torch.arange(batch, device=x.device) if state_batch_indices is None
           else state_batch_indices.long())
    live = idx != pad_slot_id
    y = torch.zeros(batch, H, P, dtype=torch.float64, device=x.device)
    if not bool(live.any()):
        return y
    rows = live.nonzero().flatten()
    slots = idx[rows]
    h = _f64(state[slots])                                       # [b, H, P, N]
    xr = _f64(x[rows])
    dtr = dt[rows]
    if dtr.dim() == 2:
        dtr = dtr[:, :, None].expand(-1, -1, P)
    bias = dt_bias
    if bias is not None and bias.dim() == 1:
        bias = bias[:, None].expand(-1, P)
    dte = mamba2_dt_ref(dtr, bias, dt_softplus)                  # [b, H, P]
    A_ = _f64(A)
    if A_.dim() == 1:
        A_ = A_[:, None, None].expand(-1, P, h.shape[-1])
    Bh = _expand_groups(_f64(B[rows]), H)                        # [b, H, N]
    Ch = _expand_groups(_f64(C[rows]), H)
    dA = torch.exp(A_[None] * dte[..., None])                    # [b, H, P, N]
    h = h * dA + (dte * xr)[..., None] * Bh[:, :, None, :]
    out = (h * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        D_ = _f64(D)
        if D_.dim() == 1:
            D_ = D_[:, None]
        out = out + xr * D_[None]
    out = _gate(out, None if z is None else z[rows])
    y[rows] = out
    state[slots] = h.to(state.dtype)
    return y


def _replay_terms(dt, A):
    """cum[s, h] = sum_{r<=s} dt[r, h] * A[h] (inclusive), float64."""
    return torch.cumsum(_f64(dt) * _f64(A)[None, :], dim=0)


def mamba2_replay_outputs_ref(checkpoint, x, dt, A, B, C, D=None, z=None):
    """Outputs of n tokens from one checkpoint and their inputs, no stepping.

    checkpoint: [H, P, N]   state before the first token (one request)
    x: [n, H, P]   dt: [n, H] effective step (after bias + softplus)
    A: [H]   B, C: [n, G, N]   D: [H] or None   z: [n, H, P] or None
    Returns y: [n, H, P] float64, token t computed as
        exp(cum_t) h_c C_t + sum_{s<=t} exp(cum_t - cum_s) dt_s (B_s . C_t) x_s
    """
    n, H, P = x.shape
    cum = _replay_terms(dt, A)                                   # [n, H]
    Bh = _expand_groups(_f64(B), H)                              # [n, H, N]
    Ch = _expand_groups(_f64(C), H)
    ckpt_read = torch.einsum("hpn,thn->thp", _f64(checkpoint), Ch)
    y = torch.exp(cum)[..., None] * ckpt_read
    cb = torch.einsum("shn,thn->tsh", Bh, Ch)                    # [t, s, H]
    decay = cum[:, None, :] - cum[None, :, :]                    # cum_t - cum_s
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    w = torch.where(causal[..., None], torch.exp(decay.clamp(max=0)), 0.0)
    w = w * _f64(dt)[None] * cb                                  # [t, s, H]
    y = y + torch.einsum("tsh,shp->thp", w, _f64(x))
    if D is not None:
        y = y + _f64(x) * _f64(D)[None, :, None]
    return _gate(y, z)


def mamba2_replay_fold_ref(checkpoint, x, dt, A, B):
    """Flush: fold n buffered tokens into the checkpoint, float64.

    Same shapes as ``mamba2_replay_outputs_ref``; returns the state after the
    n-th token, ``exp(cum_n) h_c + sum_s exp(cum_n - cum_s) dt_s x_s B_s^T``.
    """
    n, H, P = x.shape
    h = _f64(checkpoint)
    if n == 0:
        return h
    cum = _replay_terms(dt, A)
    Bh = _expand_groups(_f64(B), H)
    w = torch.exp(cum[-1][None] - cum) * _f64(dt)                # [n, H]
    return torch.exp(cum[-1])[:, None, None] * h + torch.einsum(
        "sh,shp,shn->hpn", w, _f64(x), Bh)
