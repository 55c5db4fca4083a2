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
    "gdn_prepare_ref",
    "gdn_step_ref",
    "gdn_packed_decode_ref",
    "gdn_replay_outputs_ref",
    "gdn_replay_fold_ref",
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


# ---------------------------------------------------------------------------
# Gated DeltaNet (GDN)
# ---------------------------------------------------------------------------
#
# Semantics pinned from SGLang 0.5.17's stock packed decode,
# sglang/kernels/ops/attention/fla/fused_recurrent.py
# (``fused_recurrent_gated_delta_rule_packed_decode_kernel``, l.186-265, and
# its launcher ``fused_recurrent_gated_delta_rule_packed_decode``, l.268-402),
# as called by sglang/srt/layers/attention/linear/kernels/gdn_triton.py
# (``TritonGDNKernel.packed_decode``, l.46-136) from
# sglang/srt/layers/attention/linear/gdn_backend.py l.418-434:
#
# * Grid: one program per (V tile, request n, v-head hv) (l.212-213).
# * GVA: v-head hv reads k-head ``i_h = hv // (HV // H)`` (l.214), i.e.
#   q/k are repeat_interleave'd over v-heads (NOT hv % H).
# * Packed ``mixed_qkv`` row [2*H*K + HV*V] = cat(q [H, K], k [H, K],
#   v [HV, V]), heads contiguous (l.235-237); H is inferred from the width
#   (l.341-351).
# * State pool ``initial_state`` [num_slots, HV, V, K] (V before K, i.e. h^T of
#   the FLA [K, V] convention), read at ``state_idx*stride0 + hv*V*K + v*K + k``
#   (l.231, l.264); updated in place (h0 = ht = initial_state, l.381-382),
#   loaded as fp32 and stored back in the pool dtype (l.232, l.265).
# * Padded rows: ``state_idx < 0`` (any negative, not only -1) writes ZEROS to
#   out[n, 0, hv, :] and returns: state untouched (l.225-228).
# * q, k, v are loaded and upcast to fp32 (l.238-240). With
#   ``USE_QK_L2NORM_IN_KERNEL`` (always True from gdn_triton.py l.131):
#   ``x / sqrt(sum(x*x) + 1e-6)`` for q and k (l.242-244); THEN q *= scale
#   (l.245); scale = head_k_dim ** -0.5 (gdn_backend.py l.424).
# * Gates, per (n, hv), in fp32 (l.247-254):
#   ``g = -exp(A_log) * softplus(a + dt_bias)`` with softplus(x) =
#   log(1 + exp(x)) for x <= 20, else x (SOFTPLUS_THRESHOLD=20.0, l.397);
#   ``beta = sigmoid(b)`` ROUNDED TO b's DTYPE then back to fp32 (l.254).
#   ``exp`` is tl.exp unless FLA_USE_FAST_OPS=1 (fla/op.py l.13-19).
# * Update, in this order (l.256-260):
#       h  = exp(g) * h                  # decay first
#       v' = beta * (v - h k)            # delta against the DECAYED state
#       h  = h + v' k^T                  # rank-1 write ([V, K] layout)
#       o  = h q                         # read the UPDATED state
#   o is stored in out's dtype (out = mixed_qkv.new_empty(B, 1, HV, V) in
#   gdn_triton.py l.82, so bf16 in production), shape [B, 1, HV, V].
#
# Replay form for one request (per v-head; h: [V, K]; u_t = v'_t above):
#   cum_t = sum_{r<=t} g_r
#   u_t = beta_t (v_t - exp(cum_t) h_c k_t - sum_{s<t} exp(cum_t - cum_s) (k_s . k_t) u_s)
#   o_t = exp(cum_t) h_c q_t + sum_{s<=t} exp(cum_t - cum_s) (k_s . q_t) u_s
#   fold = exp(cum_n) h_c + sum_s exp(cum_n - cum_s) u_s k_s^T
# (h_c the checkpoint: the state before the first buffered token).

GDN_L2NORM_EPS = 1e-6
GDN_SOFTPLUS_THRESHOLD = 20.0


def _gdn_expand_heads(t: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[..., H, K] -> [..., HV, K]: v-head hv reads k-head hv // (HV // H)."""
    H = t.shape[-2]
    if num_v_heads % H != 0:
        raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={H}")
    return t.repeat_interleave(num_v_heads // H, dim=-2)


def _gdn_l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + GDN_L2NORM_EPS)


def gdn_prepare_ref(mixed_qkv, a, b, A_log, dt_bias, num_k_heads, num_v_heads,
                    head_k_dim, head_v_dim, scale, use_qk_l2norm=True):
    """Unpack and gate one decode token per row, as SGLang's packed decode does.

    mixed_qkv: [batch, 2*H*K + HV*V] = cat(q [H*K], k [H*K], v [HV*V])
    a, b: [batch, HV]      A_log, dt_bias: [HV]
    Returns a dict of float64 tensors:
        q [batch, H, K]  (l2-normalised if ``use_qk_l2norm``, then * scale)
        k [batch, H, K]  (l2-normalised if ``use_qk_l2norm``)
        v [batch, HV, V]
        g [batch, HV]    log decay, -exp(A_log) * softplus(a + dt_bias)
        beta [batch, HV] sigmoid(b) rounded to b's dtype (like the kernel)
    """
    H, HV, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    batch = mixed_qkv.shape[0]
    if mixed_qkv.shape[-1] != 2 * H * K + HV * V:
        raise ValueError(f"mixed_qkv last dim {mixed_qkv.shape[-1]} != 2*{H}*{K} + {HV}*{V}")
    m = _f64(mixed_qkv)
    q = m[:, :H * K].reshape(batch, H, K)
    k = m[:, H * K:2 * H * K].reshape(batch, H, K)
    v = m[:, 2 * H * K:].reshape(batch, HV, V)
    if use_qk_l2norm:
        q = _gdn_l2norm(q)
        k = _gdn_l2norm(k)
    q = q * float(scale)
    x = _f64(a) + _f64(dt_bias)[None, :]
    g = -torch.exp(_f64(A_log))[None, :] * F.softplus(x, beta=1.0,
                                                      threshold=GDN_SOFTPLUS_THRESHOLD)
    beta = torch.sigmoid(_f64(b)).to(b.dtype).to(torch.float64)
    return dict(q=q, k=k, v=v.clone(), g=g, beta=beta)


def gdn_step_ref(state, q, k, v, g, beta, state_batch_indices=None, pad_slot_id: int = -1):
    """One eager GDN decode step on a state pool, float64.

    state: [num_slots, HV, V, K] (any float dtype; updated in place, rounded
           back to its dtype, like the stock kernel)
    q, k: [batch, H, K] (already normalised / scaled, see ``gdn_prepare_ref``)
    v: [batch, HV, V]   g, beta: [batch, HV]
    state_batch_indices: [batch] int or None (row i -> slot i). Rows whose
           index is negative (the stock kernel's test) or equals
           ``pad_slot_id`` are skipped: state untouched, output row zero
           (the stock kernel writes zeros there too). Duplicate live slots
           are not supported (the stock kernel races on them).
    Returns o: [batch, HV, V] float64.
    """
    batch, HV, V = v.shape
    idx = (torch.arange(batch, device=v.device) if state_batch_indices is None
           else state_batch_indices.to(v.device).long())
    live = (idx >= 0) & (idx != pad_slot_id)
    o = torch.zeros(batch, HV, V, dtype=torch.float64, device=v.device)
    if not bool(live.any()):
        return o
    rows = live.nonzero().flatten()
    slots = idx[rows]
    h = _f64(state[slots])                                       # [b, HV, V, K]
    qh = _gdn_expand_heads(_f64(q[rows]), HV)                    # [b, HV, K]
    kh = _gdn_expand_heads(_f64(k[rows]), HV)
    h = h * torch.exp(_f64(g[rows]))[..., None, None]            # decay first
    hk = torch.einsum("bhvk,bhk->bhv", h, kh)
    u = _f64(beta[rows])[..., None] * (_f64(v[rows]) - hk)       # delta vs decayed h
    h = h + u[..., :, None] * kh[..., None, :]
    o[rows] = torch.einsum("bhvk,bhk->bhv", h, qh)               # read updated h
    state[slots] = h.to(state.dtype)
    return o


def gdn_packed_decode_ref(state, mixed_qkv, a, b, A_log, dt_bias, scale, state_batch_indices,
                          num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                          use_qk_l2norm=True):
    """Float64 twin of SGLang's ``fused_recurrent_gated_delta_rule_packed_decode``.

    state: [num_slots, HV, V, K] pool (the stock ``initial_state``), updated in
    place; state_batch_indices: [batch] (the stock ``ssm_state_indices``),
    negative = padded row. Returns o: [batch, HV, V] float64 (the stock ``out``
    is [batch, 1, HV, V]).
    """
    p = gdn_prepare_ref(mixed_qkv, a, b, A_log, dt_bias, num_k_heads, num_v_heads,
                        head_k_dim, head_v_dim, scale, use_qk_l2norm)
    return gdn_step_ref(state, p["q"], p["k"], p["v"], p["g"], p["beta"],
                        state_batch_indices=state_batch_indices)


def gdn_replay_outputs_ref(checkpoint, q, k, v, g, beta):
    """Outputs of n tokens of one request from a checkpoint, no state stepping.

    checkpoint: [HV, V, K]   state before the first token
    q, k: [n, H, K] (prepared)   v: [n, HV, V]   g, beta: [n, HV]
    Returns (o [n, HV, V], u [n, HV, V]) float64, with cum_t = sum_{r<=t} g_r:
        u_t = beta_t (v_t - exp(cum_t) h_c k_t
                      - sum_{s<t} exp(cum_t - cum_s) (k_s . k_t) u_s)
        o_t = exp(cum_t) h_c q_t + sum_{s<=t} exp(cum_t - cum_s) (k_s . q_t) u_s
    u is solved sequentially in t (a triangular system); no state is formed.
    """
    n, HV, V = v.shape
    hc = _f64(checkpoint)
    o = torch.zeros(n, HV, V, dtype=torch.float64, device=v.device)
    u = torch.zeros_like(o)
    if n == 0:
        return o, u
    qh = _gdn_expand_heads(_f64(q), HV)                          # [n, HV, K]
    kh = _gdn_expand_heads(_f64(k), HV)
    v_, beta_ = _f64(v), _f64(beta)
    cum = torch.cumsum(_f64(g), dim=0)                           # [n, HV]
    ck = torch.einsum("hvk,thk->thv", hc, kh)                    # h_c k_t
    cq = torch.einsum("hvk,thk->thv", hc, qh)                    # h_c q_t
    kk = torch.einsum("shk,thk->tsh", kh, kh)                    # k_s . k_t
    kq = torch.einsum("shk,thk->tsh", kh, qh)                    # k_s . q_t
    causal = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
    expo = torch.where(causal[..., None], cum[:, None, :] - cum[None, :, :],
                       torch.tensor(float("-inf"), dtype=torch.float64, device=v.device))
    w = torch.exp(expo)                                          # [t, s, HV], 0 above diag
    e = torch.exp(cum)                                           # [n, HV]
    for t in range(n):
        acc = e[t][:, None] * ck[t]
        if t > 0:
            acc = acc + torch.einsum("sh,shv->hv", w[t, :t] * kk[t, :t], u[:t])
        u[t] = beta_[t][:, None] * (v_[t] - acc)
    o = e[..., None] * cq + torch.einsum("tsh,shv->thv", w * kq, u)
    return o, u


def gdn_replay_fold_ref(checkpoint, k, g, u):
    """Flush: fold n buffered tokens into the checkpoint, float64.

    checkpoint: [HV, V, K]   k: [n, H, K]   g: [n, HV]   u: [n, HV, V]
    (u from ``gdn_replay_outputs_ref``). Returns the state after the n-th
    token, ``exp(cum_n) h_c + sum_s exp(cum_n - cum_s) u_s k_s^T`` [HV, V, K].
    """
    h = _f64(checkpoint)
    n = u.shape[0]
    if n == 0:
        return h.clone()
    kh = _gdn_expand_heads(_f64(k), h.shape[0])
    cum = torch.cumsum(_f64(g), dim=0)
    w = torch.exp(cum[-1][None] - cum)                           # [n, HV]
    return torch.exp(cum[-1])[:, None, None] * h + torch.einsum(
        "sh,shv,shk->hvk", w, _f64(u), kh)
