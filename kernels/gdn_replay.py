"""Gated DeltaNet ReplaySSM kernels: decode, verify (a chain or a tree of drafts) and flush.

Per request slot and layer the pool holds a checkpoint ``h_c`` in SGLang's
layout [HV, V, K] (the transposed state: ``h_c[v, :] . k`` is a V-row times
a key) and an input buffer (a ring of ``capacity`` entries) of what the
recurrence needs since the checkpoint: the L2-normalised keys ``k``
[H, cap, K], the *corrected values* ``u`` [HV, cap, V] and the log decays
``g`` [HV, cap] (float32). Cursors and the flush rule are those of
:mod:`sglang_replayssm.kernels.cursors`, shared with the Mamba-2 kernels.

The recurrence (SGLang's packed decode: h <- exp(g) h; v' = beta (v - h k);
h <- h + v' k^T; o = h q) is rewritten with u_t = v'_t as

    h_t = exp(g_t) h_{t-1} + u_t k_t^T,    cum_t = sum_{r<=t} g_r,
    u_t = beta_t (v_t - exp(cum_t) h_c k_t - sum_{s<t} exp(cum_t - cum_s) (k_s . k_t) u_s)
    o_t = exp(cum_t) h_c q_t + sum_{s<=t} exp(cum_t - cum_s) (k_s . q_t) u_s

so a step reads the checkpoint once (two reductions over K: ``h_c k`` and
``h_c q``) and writes nothing but its ring entry; a flush folds
``h_c <- exp(cum_n) h_c + sum_s exp(cum_n - cum_s) u_s k_s^T`` (tl.dot),
after the step's outputs, re-reading the tile (an L2 hit).
``u_s`` is exact for the checkpoint it was computed from, which is the one
folded, so a single-precision checkpoint accumulates no extra error (a
verify window that triggers a flush computed its u_s from the checkpoint
before it plus the folded history: the same state up to the fold's rounding).

Inputs are read as SGLang's GDN decode passes them: the post-conv packed row
``mixed_qkv`` = [q (H*K) | k (H*K) | v (HV*V)], gates ``a``/``b`` [.., HV],
``A_log``/``dt_bias`` [HV]; q and k are L2-normalised in the kernel
(x / sqrt(sum x^2 + 1e-6)), q is scaled, ``g = -exp(A_log) softplus(a +
dt_bias)``, ``beta = sigmoid(b)`` rounded to b's dtype (as the stock kernel).
V-head ``hv`` reads k-head ``hv // (HV // H)``.

One program handles (row, v-head, BLOCK_V rows of V) with all of K. The float64
oracles are in :mod:`sglang_replayssm.reference`.

Decode also has the ``split`` route (benchmarks/NOTES.md, design A/B/C, as
Mamba-2's): three launches per step, so that the checkpoint read does not
wait on the cursor -> ring chain and no program carries the fold's registers:

* (A) :func:`~sglang_replayssm.kernels.projection.project_state` with two
  vectors per k-head: proj = h_c q_raw, h_c k_raw (fp32 scratch
  [b, 2, HV, V]) straight from mixed_qkv (a view, no copy); the L2 norms
  and the scale are divided out in (B), where q_t and k_t are loaded anyway
  (A is linear), which saves a prep launch;
* (B) ``_gdn_split_outputs_kernel``: per (row, out_heads v-heads of one
  k-head): cursors, g/k/u ring, u_t and o_t, then appends k_t (the k-head's
  first program), u_t and g_t at position ``fill`` -- always, the flushing
  token too (decode capacity is buffer_len, so the entry exists);
* (C) :func:`~sglang_replayssm.kernels.fold.split_fold_kernel` (shared with
  Mamba-2; u as the per-head rows, k as the per-group keys, g the log decay):
  persistent; folds the fill + 1 ring entries of the flushing rows only.

With ``SplitConfig.project_fold`` (the default without a fold copy) (A) is
``_gdn_split_projection_kernel``: the same projections, and on a row's flush
step the fold of the tile it just read (u_t for its V rows computed there
from h_c k_t and the ring), so there is no (C) and a flush step reads the
checkpoint once. With ``SplitConfig.outputs_in_projection`` as well (not
the default: measured slower for GDN, see ``default_config``) there is no
(B) either: ``_gdn_ring_weights_kernel`` (W) runs first, one program per
(row, k-head), and (A) finishes o_t and u_t from its weights.

Verify has a split route too (``route="split"``; "auto" from batch 256, timed there):
(A) :func:`~sglang_replayssm.kernels.projection.project_state` of every
draft's raw q and k (a [b, T, 2, H, K] view of mixed_qkv), a plain
streaming read of the checkpoint; (B) the fused kernel with ``PROJECTED``,
which divides the norms out of those projections instead of reading a state
tile, and flushes nothing; (C) the fused kernel's flush mode for the rows
the window fills (rule fill + T >= buffer_len), after (A) has read them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (ACT_DTYPES, LaunchConfig, SplitConfig, check, check_finite, check_fold_copy,
                     check_live_cursors, check_parents, check_pool, dot_precision,
                     let_dependents_launch, on_path, overlap_launch, ring_block, ring_cumsum,
                     ring_index, ring_positions, softplus, split_config, split_step_cursors,
                     tree_paths, wait_for_prior_launch)
from .cursors import MODE_DECODE, MODE_FLUSH, MODE_VERIFY
from .fold import fold_bf16_terms, fold_dot, gdn_recompute_values, launch_split_fold
from .projection import project_state

__all__ = ["gdn_replay_decode", "gdn_replay_verify", "gdn_replay_flush", "ROUTES",
           "SPLIT_ROUTES", "SplitConfig", "default_config", "default_route"]

# "output_only": the fused kernel (one launch: checkpoint read, outputs, ring
# append, fold on the flush step); "split": three launches, decode and verify
ROUTES = ("output_only", "split")
SPLIT_ROUTES = ("split",)
# "auto" takes the split route from this decode batch on (see default_route)
SPLIT_MIN_BATCH = 8
# ... and for a verify from this batch on (the one batch measured so far)
VERIFY_SPLIT_MIN_BATCH = 256


@triton.jit
def _fold(h, us, ks, g_cum, pos, last, DOT_PRECISION: tl.constexpr):
    """State after logical positions 0..last (none if last < 0):
    exp(cum_last) h + sum_{s<=last} exp(cum_last - cum_s) u_s k_s^T.
    us: [S, BV]; ks: [S, K]; g_cum, pos (logical positions): [S]; h: [BV, K]."""
    total = tl.sum(tl.where(pos == last, g_cum, 0.0), axis=0)
    w = tl.where(pos <= last, tl.exp(tl.minimum(total - g_cum, 0.0)), 0.0)
    return h * tl.exp(total) + tl.dot(tl.trans(us * w[:, None]), ks,
                                      input_precision=DOT_PRECISION)


@triton.jit
def _flush(us, ks, cum, pos, last, ckpt_ptr, fold_ptr, vbuf_ptr, betabuf_ptr, ck_off,
           m_vk, vb_off, bb_off, ring_ok, is_hist, mask_v, vwin, bwin, is_win,
           HAS_FOLD_COPY: tl.constexpr, BLOCK_S: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold logical positions 0..last into the checkpoint and store it. With a
    fold copy the fold starts from the precise copy and recomputes the
    corrected values from the raw inputs (ring history, loaded at ``ring_ok``
    and kept at ``is_hist``, + the window's ``vwin``/``bwin``; ``pos`` as
    ring_positions returns it): the u_s in ``us`` were computed from the read
    copy, and folding them would carry its rounding into the recurrence. Both
    copies are written.

    The tile folded is read here, not passed in from the step's read of it
    (an L2 hit: the same program just read it). Folding the caller's tile
    made Triton (3.6) convert a bf16 checkpoint to the dot's MMA layout right
    at that load, outside the flush branch, so every plain step paid a shared
    memory round trip of the whole tile (scripts/kernel_regs.py lists such
    conversions)."""
    if HAS_FOLD_COPY:
        h = tl.load(fold_ptr + ck_off, mask=m_vk, other=0.0).to(tl.float32)
        vs = tl.load(vbuf_ptr + vb_off, mask=ring_ok[:, None] & mask_v[None, :],
                     other=0.0).to(tl.float32)
        vs = tl.where(is_win[:, None], vwin, tl.where(is_hist[:, None], vs, 0.0))
        bs = tl.load(betabuf_ptr + bb_off, mask=ring_ok, other=0.0)
        bs = tl.where(is_win, bwin, tl.where(is_hist, bs, 0.0))
        upto = pos <= last
        us = gdn_recompute_values(h, vs, bs, ks, cum, pos, upto, BLOCK_S, DOT_PRECISION)
        h = _fold(h, us, ks, cum, pos, last, DOT_PRECISION)
        tl.store(fold_ptr + ck_off, h.to(fold_ptr.dtype.element_ty), mask=m_vk)
    else:
        h = tl.load(ckpt_ptr + ck_off, mask=m_vk, other=0.0).to(tl.float32)
        h = _fold(h, us, ks, cum, pos, last, DOT_PRECISION)
    tl.store(ckpt_ptr + ck_off, h.to(ckpt_ptr.dtype.element_ty), mask=m_vk)


@triton.jit
def _head_vector(ptr, mask_k, USE_QK_L2NORM: tl.constexpr):
    """A q or k head vector [K] of mixed_qkv in fp32, L2-normalised as the
    stock kernel does (x / sqrt(sum x^2 + 1e-6))."""
    x = tl.load(ptr, mask=mask_k, other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        x = x / tl.sqrt(tl.sum(x * x) + 1e-6)
    return x


@triton.jit
def _token_qk(q_in, k_in, scale, USE_QK_L2NORM: tl.constexpr):
    """This token's loaded q and k heads [K]: fp32, L2-normalised as the
    stock kernel (and _head_vector) does, q times ``scale``. Returns (q_t,
    k_t, |q|, |k|), the norms 1 without USE_QK_L2NORM."""
    q_t = q_in.to(tl.float32)
    k_t = k_in.to(tl.float32)
    if USE_QK_L2NORM:
        n_q = tl.sqrt(tl.sum(q_t * q_t) + 1e-6)
        n_k = tl.sqrt(tl.sum(k_t * k_t) + 1e-6)
        q_t = q_t / n_q
        k_t = k_t / n_k
    else:
        n_q = 1.0
        n_k = 1.0
    return q_t * scale, k_t, n_q, n_k


@triton.jit
def _ring_keys(kbuf_ptr, kb_off, ring_ok, is_hist, key_ptr, s_qkv_t, pos, fill, offs_k, mask_k,
               WINDOW: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """The keys [S, K] a step sees in fp32: the ring's history (loaded at
    ``ring_ok``, kept at ``is_hist``) and the first WINDOW window tokens'
    keys, normalised from their input (``key_ptr`` = this row's k-head in
    mixed_qkv). Zero elsewhere. Called again by a flush rather than keeping
    the step's tile alive to it: a [S, K] tile held across the step is 64
    registers a thread at one warp (the 1-warp launches of batch 1)."""
    ks = tl.load(kbuf_ptr + kb_off, mask=ring_ok[:, None] & mask_k[None, :],
                 other=0.0).to(tl.float32)
    ks = tl.where(is_hist[:, None], ks, 0.0)
    for j in tl.static_range(WINDOW):
        k_j = _head_vector(key_ptr + j * s_qkv_t + offs_k, mask_k, USE_QK_L2NORM)
        ks = tl.where((pos == fill + j)[:, None], k_j[None, :], ks)
    return ks


@triton.jit
def _beta(b):
    """beta = sigmoid(b), computed in fp32 and rounded to b's dtype (as the stock
    kernel), returned in fp32."""
    return tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)


@triton.jit
def _gdn_replay_kernel(
    ckpt_ptr, fold_ptr, kbuf_ptr, ubuf_ptr, gbuf_ptr, vbuf_ptr, betabuf_ptr,
    fill_ptr, origin_ptr, slot_ptr, parent_ptr,
    qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, out_ptr, proj_ptr, scale,
    H, HV, K, V, buffer_len, capacity, flush_window,
    s_ck_slot, s_ck_head, s_ck_v,
    s_kb_slot, s_kb_head, s_kb_pos,
    s_ub_slot, s_ub_head, s_ub_pos,
    s_gb_slot, s_gb_head,
    s_vb_slot, s_vb_head, s_vb_pos, s_bb_slot, s_bb_head,
    s_qkv_row, s_qkv_t, s_a_row, s_a_t, s_b_row, s_b_t,
    s_o_row, s_o_t, s_o_head, s_par_row, s_pr_row, s_pr_t, s_pr_qk, s_pr_head,
    T: tl.constexpr, MODE: tl.constexpr, TREE: tl.constexpr, PROJECTED: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, HAS_FOLD_COPY: tl.constexpr, STORAGE_ORDER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_v = tl.program_id(0)
    hv = tl.program_id(1)
    row = tl.program_id(2)
    hk = hv // (HV // H)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_S)
    mask_v = offs_v < V
    mask_k = offs_k < K
    m_vk = mask_v[:, None] & mask_k[None, :]
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: output zeros (as the stock kernel), pool untouched
        if MODE != 2:
            for j in tl.static_range(T):
                tl.store(out_ptr + row * s_o_row + j * s_o_t + hv * s_o_head + offs_v,
                         tl.zeros([BLOCK_V], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                         mask=mask_v)
        return
    ck_off = slot * s_ck_slot + hv * s_ck_head + offs_v[:, None] * s_ck_v + offs_k[None, :]
    if not PROJECTED:  # a PROJECTED verify takes h_c q_j, h_c k_j from proj_ptr
        h = tl.load(ckpt_ptr + ck_off, mask=m_vk, other=0.0).to(tl.float32)  # [BV, K]
    fill = tl.load(fill_ptr + slot)
    origin = tl.load(origin_ptr + slot)
    if MODE == 2:  # the rows whose buffer is not empty and whose flush rule fires
        if (fill == 0) | (fill + flush_window < buffer_len):
            return

    # logical positions: [0, fill) = history in the ring, [fill, fill+T) = window;
    # entries not in the history are zeroed after the load (storage order
    # reads the whole ring, stale entries included)
    pos, is_hist, is_win, win, ring, ring_ok = ring_positions(offs_s, fill, origin, capacity,
                                                              T, STORAGE_ORDER)
    g_s = tl.load(gbuf_ptr + slot * s_gb_slot + hv * s_gb_head + ring, mask=ring_ok, other=0.0)
    g_s = tl.where(is_hist, g_s, 0.0)
    kb_off = slot * s_kb_slot + hk * s_kb_head + ring[:, None] * s_kb_pos + offs_k[None, :]
    key_ptr = qkv_ptr + row * s_qkv_row + H * K + hk * K
    # history keys [S, K] and the window's but the last (verify's token j
    # reads the keys of tokens < j; decode's only token reads the history)
    ks = _ring_keys(kbuf_ptr, kb_off, ring_ok, is_hist, key_ptr, s_qkv_t, pos, fill, offs_k,
                    mask_k, T - 1, USE_QK_L2NORM)
    us = tl.load(ubuf_ptr + slot * s_ub_slot + hv * s_ub_head + ring[:, None] * s_ub_pos
                 + offs_v[None, :], mask=ring_ok[:, None] & mask_v[None, :],
                 other=0.0).to(tl.float32)                                   # [S, BV]
    us = tl.where(is_hist[:, None], us, 0.0)
    # raw-input rings (fold copy only): read by _flush, the window appended below
    vb_off = slot * s_vb_slot + hv * s_vb_head + ring[:, None] * s_vb_pos + offs_v[None, :]
    bb_off = slot * s_bb_slot + hv * s_bb_head + ring
    vwin = tl.zeros([BLOCK_S, BLOCK_V], dtype=tl.float32)
    bwin = tl.zeros([BLOCK_S], dtype=tl.float32)

    # window gates (the window's u is computed below, token by token)
    A_log = tl.load(A_log_ptr + hv).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
    for j in tl.static_range(T):
        a_j = tl.load(a_ptr + row * s_a_row + j * s_a_t + hv).to(tl.float32)
        g_j = -tl.exp(A_log) * softplus(a_j + dt_bias)
        g_s = tl.where(pos == fill + j, g_j, g_s)
    cum = ring_cumsum(g_s, pos, STORAGE_ORDER)
    if TREE:  # verify of a draft tree: each draft decays along its own path
        cum, path = tree_paths(g_s, cum, pos, fill, parent_ptr + row * s_par_row, T)

    no_win = offs_s < 0
    if MODE == 2:
        _flush(us, ks, cum, pos, fill - 1, ckpt_ptr, fold_ptr, vbuf_ptr, betabuf_ptr,
               ck_off, m_vk, vb_off, bb_off, ring_ok, is_hist, mask_v, vwin, bwin, no_win,
               HAS_FOLD_COPY, BLOCK_S, DOT_PRECISION)
    else:
        if MODE == 0:  # decode: a full buffer folds history + this token, appends nothing
            flush = fill + 1 >= buffer_len
            n_write = tl.where(flush, 0, 1)
        else:  # verify: the window is appended; a window that fills the buffer folds the history
            flush = fill + T >= buffer_len
            n_write = T
        # the k ring gets the window's keys from the k-head's first v-head, first V slice
        k_writer = (pid_v == 0) & (hv % (HV // H) == 0)
        # outputs from the checkpoint as read, over history + window; a flush
        # comes after them (decode and verify alike), so the tile the outputs
        # reduce keeps one layout (a fold before the outputs made Triton move
        # the tile to the dot's layout on every verify step)
        for j in tl.static_range(T):
            q_pos = fill + j
            cum_q = tl.sum(tl.where(pos == q_pos, cum, 0.0), axis=0)
            if PROJECTED:  # (A) projected the raw q_j, k_j: divide the norms out
                q_j, k_j, n_q, n_k = _token_qk(
                    tl.load(qkv_ptr + row * s_qkv_row + j * s_qkv_t + hk * K + offs_k,
                            mask=mask_k, other=0.0),
                    tl.load(key_ptr + j * s_qkv_t + offs_k, mask=mask_k, other=0.0),
                    scale, USE_QK_L2NORM)
                pr = proj_ptr + row * s_pr_row + j * s_pr_t + hv * s_pr_head + offs_v
                hq_c = tl.load(pr, mask=mask_v, other=0.0) / n_q * scale
                hk_c = tl.load(pr + s_pr_qk, mask=mask_v, other=0.0) / n_k
            else:
                # the key from its input again (the same load and norm as
                # above, which the compiler may share), not picked out of the
                # ring tile: h_c k_j then waits for the checkpoint read only,
                # not for the cursor -> ring loads as well
                k_j = _head_vector(key_ptr + j * s_qkv_t + offs_k, mask_k, USE_QK_L2NORM)
                q_j = _head_vector(qkv_ptr + row * s_qkv_row + j * s_qkv_t + hk * K + offs_k,
                                   mask_k, USE_QK_L2NORM) * scale
                hq_c = tl.sum(h * q_j[None, :], axis=1)
                hk_c = tl.sum(h * k_j[None, :], axis=1)
            v_j = tl.load(qkv_ptr + row * s_qkv_row + j * s_qkv_t + 2 * H * K + hv * V + offs_v,
                          mask=mask_v, other=0.0).to(tl.float32)
            beta = _beta(tl.load(b_ptr + row * s_b_row + j * s_b_t + hv))
            decay = tl.exp(cum_q)
            if TREE:  # the history and the draft's ancestors
                sees = on_path(path, pos, q_pos, is_hist, is_win, win) & (pos != q_pos)
            else:  # the history and every earlier draft
                sees = pos < q_pos
            w = tl.where(sees, tl.exp(tl.minimum(cum_q - cum, 0.0)), 0.0)       # [S]
            kk = tl.sum(ks * k_j[None, :], axis=1)                              # k_s . k_j
            kq = tl.sum(ks * q_j[None, :], axis=1)                              # k_s . q_j
            # u_j = beta (v_j - (decayed state before j) k_j)
            hk_j = decay * hk_c + tl.sum(us * (w * kk)[:, None], axis=0)
            u_j = beta * (v_j - hk_j)
            o_j = decay * hq_c + tl.sum(us * (w * kq)[:, None], axis=0) + tl.sum(k_j * q_j) * u_j
            us = tl.where((pos == q_pos)[:, None], u_j[None, :], us)
            if HAS_FOLD_COPY:
                vwin = tl.where((pos == q_pos)[:, None], v_j[None, :], vwin)
                bwin = tl.where(pos == q_pos, beta, bwin)
            tl.store(out_ptr + row * s_o_row + j * s_o_t + hv * s_o_head + offs_v,
                     o_j.to(out_ptr.dtype.element_ty), mask=mask_v)
            # append this token's key at logical position fill + j
            r_j = ring_index(origin, fill + j, capacity)
            tl.store(kbuf_ptr + slot * s_kb_slot + hk * s_kb_head + r_j * s_kb_pos + offs_k,
                     k_j.to(kbuf_ptr.dtype.element_ty), mask=mask_k & k_writer & (j < n_write))
        if not PROJECTED:  # a PROJECTED verify is flushed by a MODE 2 launch after it
            if flush:
                # decode folds history + this token; verify the committed history
                # (the window's u do not depend on which checkpoint they were
                # computed from: they are the recurrence's corrected values). The
                # keys are read again (L2 hits), not kept alive from the step.
                if MODE == 0:
                    fold_keys = _ring_keys(kbuf_ptr, kb_off, ring_ok, is_hist, key_ptr, s_qkv_t,
                                           pos, fill, offs_k, mask_k, 1, USE_QK_L2NORM)
                    last = fill
                    folded_win = is_win
                else:
                    fold_keys = _ring_keys(kbuf_ptr, kb_off, ring_ok, is_hist, key_ptr, s_qkv_t,
                                           pos, fill, offs_k, mask_k, 0, USE_QK_L2NORM)
                    last = fill - 1
                    folded_win = no_win
                _flush(us, fold_keys, cum, pos, last, ckpt_ptr, fold_ptr, vbuf_ptr, betabuf_ptr,
                       ck_off, m_vk, vb_off, bb_off, ring_ok, is_hist, mask_v, vwin, bwin,
                       folded_win, HAS_FOLD_COPY, BLOCK_S, DOT_PRECISION)
        # append the window: u by every V slice, g by the first V slice of each
        # v-head (k went in above, token by token)
        write = is_win & (win < n_write)
        tl.store(ubuf_ptr + slot * s_ub_slot + hv * s_ub_head + ring[:, None] * s_ub_pos
                 + offs_v[None, :], us.to(ubuf_ptr.dtype.element_ty),
                 mask=write[:, None] & mask_v[None, :])
        if HAS_FOLD_COPY:
            tl.store(vbuf_ptr + vb_off, vwin.to(vbuf_ptr.dtype.element_ty),
                     mask=write[:, None] & mask_v[None, :])
        if pid_v == 0:
            tl.store(gbuf_ptr + slot * s_gb_slot + hv * s_gb_head + ring, g_s, mask=write)
            if HAS_FOLD_COPY:
                tl.store(betabuf_ptr + bb_off, bwin, mask=write)


@triton.jit
def _token_gates(a_t, b_t, A_log, dt_bias):
    """This token's log decay g = -exp(A_log) softplus(a + dt_bias) and
    beta = sigmoid(b), rounded to b's dtype (as the stock kernel)."""
    g_t = -tl.exp(A_log.to(tl.float32)) * softplus(a_t.to(tl.float32) + dt_bias.to(tl.float32))
    return g_t, _beta(b_t)


@triton.jit
def _corrected_value(v_t, beta, decay, hk_c, us, w, kk):
    """u_t = beta (v_t - S k_t) with S k_t = decay h_c k_t + sum_s w_s (k_s . k_t) u_s:
    hk_c = h_c k_t [BV]; us [S, BV] ring history; w [S] = exp(cum_t - cum_s)
    on the history, 0 elsewhere; kk [S] = k_s . k_t."""
    return beta * (v_t - (decay * hk_c + tl.sum(us * (w * kk)[:, None], axis=0)))


@triton.jit
def _gdn_split_projection_kernel(
    ckpt_ptr, kbuf_ptr, ubuf_ptr, gbuf_ptr, fill_ptr, origin_ptr, slot_ptr,
    qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, proj_ptr, weights_ptr, out_ptr, scale,
    H, HV, K, V, buffer_len, capacity,
    s_ck_slot, s_ck_head, s_ck_row,
    s_kb_slot, s_kb_head, s_kb_pos,
    s_ub_slot, s_ub_head, s_ub_pos,
    s_gb_slot, s_gb_head,
    s_qkv_row, s_a_row, s_b_row, s_pr_row, s_pr_j, s_pr_head,
    s_w_row, s_w_head, s_o_row, s_o_head,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    FOLD_COLS: tl.constexpr, BF16_TERMS: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, OVERLAP: tl.constexpr, OUTPUTS: tl.constexpr,
):
    """(A) with the fold: one program per (row, v-head, BLOCK_R rows of V)
    projects its checkpoint tile onto the raw q_t and k_t (proj[row, 0/1]),
    and on the row's flush step (fill + 1 >= buffer_len) folds the history
    and this token into the same tile and writes it back: a flush step reads
    the checkpoint once, and the folds spread over the projection's grid.
    This token's u_t for the tile's V rows is computed here (as (B) does,
    from h_c k_t of the tile just read and the ring; (B), launched after,
    appends its own u_t, which the flush then discards with the buffer).
    FOLD_COLS as in the Mamba-2 kernel: the fold takes that many key
    columns at a time, re-read from L2.

    OUTPUTS (SplitConfig.outputs_in_projection): the ring weights kernel (W)
    ran first; this program also finishes its V rows of the output and of
    u_t (as (B) does, from (W)'s weights, the tile's projections and the
    v-head's u ring slice, loaded with the tile before waiting for (W)),
    stores o_t, appends u_t, and its flush folds that u_t; no proj scratch.
    A padded row outputs zeros (as (B) and the stock kernel)."""
    if not OUTPUTS:
        let_dependents_launch(OVERLAP)  # SplitConfig.overlap: (B) may start now
    pid_r = tl.program_id(0)
    hv = tl.program_id(1)
    row = tl.program_id(2)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < V
    row64 = row.to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: its proj entries stay unwritten, its output is 0
        if OUTPUTS:
            tl.store(out_ptr + row64 * s_o_row + hv * s_o_head + offs_r,
                     tl.zeros([BLOCK_R], dtype=out_ptr.dtype.element_ty), mask=mask_r)
        return
    hk = hv // (HV // H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_S)
    mask_k = offs_k < K
    m_rk = mask_r[:, None] & mask_k[None, :]
    ck_off = slot * s_ck_slot + hv * s_ck_head + offs_r[:, None] * s_ck_row + offs_k[None, :]
    # the tile's address depends on the slot only: issued right after it
    h_in = tl.load(ckpt_ptr + ck_off, mask=m_rk, other=0.0)
    q_in = tl.load(qkv_ptr + row64 * s_qkv_row + hk * K + offs_k, mask=mask_k, other=0.0)
    k_in = tl.load(qkv_ptr + row64 * s_qkv_row + H * K + hk * K + offs_k, mask=mask_k,
                   other=0.0)
    fill = tl.load(fill_ptr + slot)
    if OUTPUTS:  # the v-head's u ring slice and this token's v leave with the tile
        origin = tl.load(origin_ptr + slot)
        # positions [0, fill) = history in the ring, fill = this token
        _, is_hist, is_win, win, ring, _ = ring_positions(offs_s, fill, origin, capacity, 1,
                                                           False)
        us_in = tl.load(ubuf_ptr + slot * s_ub_slot + hv * s_ub_head + ring[:, None] * s_ub_pos
                        + offs_r[None, :], mask=is_hist[:, None] & mask_r[None, :], other=0.0)
        v_in = tl.load(qkv_ptr + row64 * s_qkv_row + 2 * H * K + hv * V + offs_r, mask=mask_r,
                       other=0.0)
    h = h_in.to(tl.float32)
    k_t = k_in.to(tl.float32)
    proj_k = tl.sum(h * k_t[None, :], axis=1)
    proj_q = tl.sum(h * q_in.to(tl.float32)[None, :], axis=1)
    if OUTPUTS:
        wait_for_prior_launch(OVERLAP)  # (W)'s weights are complete from here on
        w_row = weights_ptr + row64 * s_w_row + hv * s_w_head
        wk = tl.load(w_row + offs_s)                 # w_s k_s . k_t, 0 outside the history
        wq = tl.load(w_row + BLOCK_S + offs_s)       # w_s k_s . q_t
        decay = tl.load(w_row + 2 * BLOCK_S)
        beta = tl.load(w_row + 2 * BLOCK_S + 1)
        n_k = tl.load(w_row + 2 * BLOCK_S + 2)
        n_q = tl.load(w_row + 2 * BLOCK_S + 3)
        kq_t = tl.load(w_row + 2 * BLOCK_S + 4)
        us = us_in.to(tl.float32)
        proj_k = proj_k / n_k
        u_t = beta * (v_in.to(tl.float32) - (decay * proj_k + tl.sum(us * wk[:, None], axis=0)))
        o_t = decay * (proj_q / n_q * scale) + tl.sum(us * wq[:, None], axis=0) + kq_t * u_t
        tl.store(out_ptr + row64 * s_o_row + hv * s_o_head + offs_r,
                 o_t.to(out_ptr.dtype.element_ty), mask=mask_r)
        ring_q = ring_index(origin, fill, capacity)
        # append, flush step included (its fold takes u_t from here)
        tl.store(ubuf_ptr + slot * s_ub_slot + hv * s_ub_head + ring_q * s_ub_pos + offs_r,
                 u_t.to(ubuf_ptr.dtype.element_ty), mask=mask_r)
    else:
        p_off = proj_ptr + row64 * s_pr_row + hv * s_pr_head + offs_r
        tl.store(p_off, proj_q, mask=mask_r)
        tl.store(p_off + s_pr_j, proj_k, mask=mask_r)
    if fill + 1 >= buffer_len:
        if OUTPUTS:
            g_t = tl.load(w_row + 2 * BLOCK_S + 5)
            g_h = tl.load(gbuf_ptr + slot * s_gb_slot + hv * s_gb_head + ring, mask=is_hist,
                          other=0.0)
            cum = tl.cumsum(tl.where(is_hist, g_h, tl.where(is_win, g_t, 0.0)), axis=0)
            total = tl.sum(tl.where(is_win, cum, 0.0), axis=0)   # cum at this token
        else:
            origin = tl.load(origin_ptr + slot)
            # positions [0, fill) = history in the ring, fill = this token
            _, is_hist, is_win, win, ring, _ = ring_positions(offs_s, fill, origin, capacity,
                                                               1, False)
            ks = tl.load(kbuf_ptr + slot * s_kb_slot + hk * s_kb_head + ring[:, None] * s_kb_pos
                         + offs_k[None, :], mask=is_hist[:, None] & mask_k[None, :], other=0.0)
            us = tl.load(ubuf_ptr + slot * s_ub_slot + hv * s_ub_head + ring[:, None] * s_ub_pos
                         + offs_r[None, :], mask=is_hist[:, None] & mask_r[None, :], other=0.0)
            g_h = tl.load(gbuf_ptr + slot * s_gb_slot + hv * s_gb_head + ring, mask=is_hist,
                          other=0.0)
            v_t = tl.load(qkv_ptr + row64 * s_qkv_row + 2 * H * K + hv * V + offs_r,
                          mask=mask_r, other=0.0).to(tl.float32)
            g_t, beta = _token_gates(tl.load(a_ptr + row64 * s_a_row + hv),
                                     tl.load(b_ptr + row64 * s_b_row + hv),
                                     tl.load(A_log_ptr + hv), tl.load(dt_bias_ptr + hv))
            # normalised as (B) and the fused kernel do (q_t is not needed here)
            _, k_t, _, n_k = _token_qk(q_in, k_in, scale, USE_QK_L2NORM)
            proj_k = proj_k / n_k
            ks = ks.to(tl.float32)
            us = us.to(tl.float32)
            cum = tl.cumsum(tl.where(is_hist, g_h, tl.where(is_win, g_t, 0.0)), axis=0)
            total = tl.sum(tl.where(is_win, cum, 0.0), axis=0)   # cum at this token
            w = tl.where(is_hist, tl.exp(tl.minimum(total - cum, 0.0)), 0.0)
            u_t = _corrected_value(v_t, beta, tl.exp(total), proj_k, us, w,
                                   tl.sum(ks * k_t[None, :], axis=1))
        us = tl.where(is_win[:, None], u_t[None, :], us)
        upto = offs_s <= fill
        # with BF16_TERMS (fold.weighted_dot: the key ring is bf16) the dot
        # takes the history only; this token's key is not exact in bf16
        w_in = tl.where(is_hist if BF16_TERMS > 0 else upto, 1.0, 0.0)
        tile = slot * s_ck_slot + hv * s_ck_head + offs_r[:, None] * s_ck_row
        k_ring = kbuf_ptr + slot * s_kb_slot + hk * s_kb_head + ring[:, None] * s_kb_pos
        k_tok = qkv_ptr + row64 * s_qkv_row + H * K + hk * K
        for c in tl.static_range(0, BLOCK_K, FOLD_COLS):
            offs_c = c + tl.arange(0, FOLD_COLS)
            mask_c = offs_c < K
            m_rc = mask_r[:, None] & mask_c[None, :]
            hc = tl.load(ckpt_ptr + tile + offs_c[None, :], mask=m_rc, other=0.0)
            kc = tl.load(k_ring + offs_c[None, :], mask=is_hist[:, None] & mask_c[None, :],
                         other=0.0)
            kq = tl.load(k_tok + offs_c, mask=mask_c, other=0.0).to(tl.float32) / n_k
            kc = tl.where(is_win[:, None], kq[None, :], kc.to(tl.float32))
            hc = fold_dot(hc.to(tl.float32), us, kc, w_in, cum, upto, total, DOT_PRECISION,
                          BF16_TERMS)
            if BF16_TERMS > 0:  # this token's key, fp32 after its norm: not in the dot
                hc += u_t[:, None] * kq[None, :]
            tl.store(ckpt_ptr + tile + offs_c[None, :], hc.to(ckpt_ptr.dtype.element_ty),
                     mask=m_rc)


@triton.jit
def _gdn_ring_weights_kernel(
    kbuf_ptr, gbuf_ptr, fill_ptr, origin_ptr, slot_ptr,
    qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, weights_ptr, scale,
    H, HV, K, capacity,
    s_kb_slot, s_kb_head, s_kb_pos,
    s_gb_slot, s_gb_head,
    s_qkv_row, s_a_row, s_b_row, s_w_row, s_w_head,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, OVERLAP: tl.constexpr,
):
    """(W) (SplitConfig.outputs_in_projection) One program per (row, k-head):
    the scalars with which (A) finishes its v-heads' outputs, as [heads, S]
    tiles for the k-head's HV / H v-heads. With cum as in (B) (the running
    sum of g up to and including this token) and w_s = exp(cum_t - cum_s):

        weights[row, hv, s]             = w_s (k_s . k_t)     (history s, else 0)
        weights[row, hv, BLOCK_S + s]   = w_s (k_s . q_t)
        weights[row, hv, 2 BLOCK_S + i] = exp(cum_t), beta_t, |k_t|, |q_t|,
                                          k_t . q_t, g_t      (i = 0 .. 5)

    (q_t, k_t normalised and q_t scaled as in (B); |x| = 1 without the L2
    norm.) Appends this token's normalised k (per k-head) and g (per v-head)
    at ``fill``; (A) appends u. The k ring is read once per k-head (by (B)
    once per v-head program) and no u ring is read. With OVERLAP, (A) may
    start as soon as every program of this launch has."""
    let_dependents_launch(OVERLAP)
    row = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    hpg = HV // H
    offs_h = tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_S)
    mask_h = offs_h < hpg
    mask_k = offs_k < K
    hv = hk * hpg + offs_h
    # row-indexed loads first, then the slot chain (as (B))
    q_in = tl.load(qkv_ptr + row * s_qkv_row + hk * K + offs_k, mask=mask_k, other=0.0)
    k_in = tl.load(qkv_ptr + row * s_qkv_row + H * K + hk * K + offs_k, mask=mask_k, other=0.0)
    a_t = tl.load(a_ptr + row * s_a_row + hv, mask=mask_h, other=0.0)
    b_t = tl.load(b_ptr + row * s_b_row + hv, mask=mask_h, other=0.0)
    A_log = tl.load(A_log_ptr + hv, mask=mask_h, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + hv, mask=mask_h, other=0.0)
    slot, live, is_hist, is_win, ring, ring_q = split_step_cursors(
        slot_ptr, fill_ptr, origin_ptr, row, offs_s, capacity)
    ks = tl.load(kbuf_ptr + slot * s_kb_slot + hk * s_kb_head + ring[:, None] * s_kb_pos
                 + offs_k[None, :], mask=is_hist[:, None] & mask_k[None, :], other=0.0)
    g_h = tl.load(gbuf_ptr + slot * s_gb_slot + hv[:, None] * s_gb_head + ring[None, :],
                  mask=mask_h[:, None] & is_hist[None, :], other=0.0)           # [H, S]
    q_t, k_t, n_q, n_k = _token_qk(q_in, k_in, scale, USE_QK_L2NORM)
    ksf = ks.to(tl.float32)
    kk = tl.sum(ksf * k_t[None, :], axis=1)                                   # [S]
    kq = tl.sum(ksf * q_t[None, :], axis=1)
    kq_t = tl.sum(k_t * q_t)
    g_t, beta = _token_gates(a_t, b_t, A_log, dt_bias)                       # [H]
    cum = tl.cumsum(tl.where(is_hist[None, :], g_h, tl.where(is_win[None, :], g_t[:, None], 0.0)),
                    axis=1)
    cum_q = tl.sum(tl.where(is_win[None, :], cum, 0.0), axis=1)   # includes g_t: decay first
    w = tl.where(is_hist[None, :], tl.exp(tl.minimum(cum_q[:, None] - cum, 0.0)), 0.0)
    w_rows = weights_ptr + row * s_w_row + hv * s_w_head                     # [H]
    m_h = mask_h & live
    tl.store(w_rows[:, None] + offs_s[None, :], w * kk[None, :], mask=m_h[:, None])
    tl.store(w_rows[:, None] + BLOCK_S + offs_s[None, :], w * kq[None, :], mask=m_h[:, None])
    coef = w_rows + 2 * BLOCK_S
    tl.store(coef, tl.exp(cum_q), mask=m_h)
    tl.store(coef + 1, beta, mask=m_h)
    tl.store(coef + 2, tl.zeros_like(beta) + n_k, mask=m_h)
    tl.store(coef + 3, tl.zeros_like(beta) + n_q, mask=m_h)
    tl.store(coef + 4, tl.zeros_like(beta) + kq_t, mask=m_h)
    tl.store(coef + 5, g_t, mask=m_h)
    # append, flush step included (the flush's fold takes them from here)
    tl.store(gbuf_ptr + slot * s_gb_slot + hv * s_gb_head + ring_q, g_t, mask=m_h)
    tl.store(kbuf_ptr + slot * s_kb_slot + hk * s_kb_head + ring_q * s_kb_pos + offs_k,
             k_t.to(kbuf_ptr.dtype.element_ty), mask=mask_k & live)


@triton.jit
def _gdn_split_outputs_kernel(
    proj_ptr, kbuf_ptr, ubuf_ptr, gbuf_ptr, vbuf_ptr, betabuf_ptr, fill_ptr, origin_ptr,
    slot_ptr, qkv_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, out_ptr, scale,
    H, HV, K, V, capacity,
    s_pr_row, s_pr_j, s_pr_head,
    s_kb_slot, s_kb_head, s_kb_pos,
    s_ub_slot, s_ub_head, s_ub_pos,
    s_gb_slot, s_gb_head,
    s_vb_slot, s_vb_head, s_vb_pos, s_bb_slot, s_bb_head,
    s_qkv_row, s_a_row, s_b_row, s_o_row, s_o_head,
    HEADS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, HAS_FOLD_COPY: tl.constexpr, OVERLAP: tl.constexpr,
):
    """(B) One program per (row, HEADS consecutive v-heads of one k-head): the
    decode output from the projection (A) and the ring, then the token's
    append. No checkpoint access. k_s . k_t and k_s . q_t are computed once
    for the program's v-heads.

    (A) projected the *raw* q_t, k_t (A is linear: h_c (x / |x|) = (h_c x) / |x|),
    so the norms are applied here, where q_t and k_t are loaded anyway; that
    saves a prep launch and its [b, H, K] round trip. With cum = the running
    sum of g up to and including this token (the decay comes first, as in
    gdn_step_ref) and proj_x = h_c x_t:

        S k_t = exp(cum_t) proj_k + sum_{s<t} exp(cum_t - cum_s) (k_s . k_t) u_s
        u_t   = beta_t (v_t - S k_t)
        o_t   = exp(cum_t) proj_q + sum_{s<t} exp(cum_t - cum_s) (k_s . q_t) u_s
                + (k_t . q_t) u_t

    With OVERLAP (SplitConfig.overlap) this runs while (A) finishes: the
    projections are read last, after waiting for (A).
    """
    row = tl.program_id(0).to(tl.int64)
    hv0 = tl.program_id(1) * HEADS
    hpg = HV // H
    hk = hv0 // hpg
    offs_v = tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_S)
    mask_v = offs_v < V
    mask_k = offs_k < K
    # Latency bound (a program moves a few KiB), as the Mamba-2 (B): every
    # load is issued as early as its address allows. Row-indexed first:
    # this token's q, k and the projections do not wait for the slot id.
    # (Loaded values are converted where used: a conversion stalls on its
    # load and would hold every later load behind it.)
    q_in = tl.load(qkv_ptr + row * s_qkv_row + hk * K + offs_k, mask=mask_k, other=0.0)
    k_in = tl.load(qkv_ptr + row * s_qkv_row + H * K + hk * K + offs_k, mask=mask_k, other=0.0)
    slot, live, is_hist, is_win, ring, ring_q = split_step_cursors(
        slot_ptr, fill_ptr, origin_ptr, row, offs_s, capacity)
    ks_in = tl.load(kbuf_ptr + slot * s_kb_slot + hk * s_kb_head + ring[:, None] * s_kb_pos
                    + offs_k[None, :], mask=is_hist[:, None] & mask_k[None, :], other=0.0)

    for j in tl.static_range(HEADS):
        hv = hv0 + j
        a_t = tl.load(a_ptr + row * s_a_row + hv)
        A_log = tl.load(A_log_ptr + hv)
        dt_bias = tl.load(dt_bias_ptr + hv)
        b_t = tl.load(b_ptr + row * s_b_row + hv)
        p_off = proj_ptr + row * s_pr_row + hv * s_pr_head + offs_v
        if not OVERLAP:
            proj_q = tl.load(p_off, mask=mask_v, other=0.0)                  # h_c q_t (raw)
            proj_k = tl.load(p_off + s_pr_j, mask=mask_v, other=0.0)         # h_c k_t (raw)
        v_in = tl.load(qkv_ptr + row * s_qkv_row + 2 * H * K + hv * V + offs_v,
                       mask=mask_v, other=0.0)
        g_h = tl.load(gbuf_ptr + slot * s_gb_slot + hv * s_gb_head + ring, mask=is_hist,
                      other=0.0)
        us_in = tl.load(ubuf_ptr + slot * s_ub_slot + hv * s_ub_head + ring[:, None] * s_ub_pos
                        + offs_v[None, :], mask=is_hist[:, None] & mask_v[None, :], other=0.0)
        if OVERLAP:
            wait_for_prior_launch(OVERLAP)
            proj_q = tl.load(p_off, mask=mask_v, other=0.0)
            proj_k = tl.load(p_off + s_pr_j, mask=mask_v, other=0.0)
        if j == 0:
            # this token's q, k normalised exactly as the fused kernel does (so
            # that the k ring holds the same values on both routes), and the
            # key products shared by the program's v-heads
            ks = ks_in.to(tl.float32)                                        # [S, K]
            q_t, k_t, n_q, n_k = _token_qk(q_in, k_in, scale, USE_QK_L2NORM)
            kk = tl.sum(ks * k_t[None, :], axis=1)                          # k_s . k_t
            kq = tl.sum(ks * q_t[None, :], axis=1)                          # k_s . q_t
            kq_t = tl.sum(k_t * q_t)
        v_t = v_in.to(tl.float32)
        us = us_in.to(tl.float32)                                            # [S, V]
        g_t, beta = _token_gates(a_t, b_t, A_log, dt_bias)
        cum = tl.cumsum(tl.where(is_hist, g_h, tl.where(is_win, g_t, 0.0)), axis=0)
        cum_q = tl.sum(tl.where(is_win, cum, 0.0), axis=0)   # includes g_t: decay first
        w = tl.where(is_hist, tl.exp(tl.minimum(cum_q - cum, 0.0)), 0.0)    # [S]
        decay = tl.exp(cum_q)
        u_t = _corrected_value(v_t, beta, decay, proj_k / n_k, us, w, kk)
        o_t = decay * (proj_q / n_q * scale) + tl.sum(us * (w * kq)[:, None], axis=0) \
            + kq_t * u_t
        # a padded row outputs zeros (as the stock kernel); its pool is untouched
        tl.store(out_ptr + row * s_o_row + hv * s_o_head + offs_v,
                 tl.where(live, o_t, 0.0).to(out_ptr.dtype.element_ty), mask=mask_v)
        # append, flush step included: (C) folds it from the ring
        tl.store(ubuf_ptr + slot * s_ub_slot + hv * s_ub_head + ring_q * s_ub_pos + offs_v,
                 u_t.to(ubuf_ptr.dtype.element_ty), mask=mask_v & live)
        tl.store(gbuf_ptr + slot * s_gb_slot + hv * s_gb_head + ring_q, g_t, mask=live)
        if HAS_FOLD_COPY:  # raw inputs: (C) recomputes u from the precise copy
            tl.store(vbuf_ptr + slot * s_vb_slot + hv * s_vb_head + ring_q * s_vb_pos + offs_v,
                     v_t.to(vbuf_ptr.dtype.element_ty), mask=mask_v & live)
            tl.store(betabuf_ptr + slot * s_bb_slot + hv * s_bb_head + ring_q, beta, mask=live)
    if hv0 % hpg == 0:  # the k-head's first program appends k (flush step included)
        tl.store(kbuf_ptr + slot * s_kb_slot + hk * s_kb_head + ring_q * s_kb_pos + offs_k,
                 k_t.to(kbuf_ptr.dtype.element_ty), mask=mask_k & live)


# --------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------

def default_config(head_v_dim: int, head_k_dim: int, state_dtype: torch.dtype,
                   batch: int = 256, route: str = "output_only",
                   mode: int = MODE_DECODE, fold_copy: bool = False) -> LaunchConfig:
    """The fused kernel: the Mamba-2 kernel's measured shape (a large tile, 2
    warps at serving batch) carried over for decode, which it serves below
    batch 8 only; verify and flush-only (``mode``) keep 32 rows at 4 warps at
    every batch (64 rows at 2 warps spill on sm_90, offline,
    scripts/kernel_regs.py: verify T=4 1.7-2.9 KB a thread, flush-only
    112-336 B; 32 / 4 does not up to T=8; not timed). For the split route a
    SplitConfig whose projection (A) tile follows the decode rule (its sweep
    on the H200 is flat) and whose (B)/(C) knobs were measured (below). With
    a fold copy (``fold_copy``) the split route folds in (C), which
    recomputes the corrected values from the precise copy: no fold in (A),
    and no overlap of (B) with it, since (C) follows (B)."""
    bv = min(64, max(16, triton.next_power_of_2(head_v_dim)))
    large = batch >= 32 and mode == MODE_DECODE
    cfg = LaunchConfig(block=bv if large else min(bv, 32), num_warps=2 if large else 4)
    if route in SPLIT_ROUTES:
        # H200, Qwen3-Next shape, b=256, L=16 (kernels_gdn_latency.md): (B)
        # at 1 warp 29.2 / 22.1 us (fp32 / bf16 state) vs 35.1 / 39.8 at 2
        # warps from batch 64 (at 8: 15.6 vs 14.9 us); (C)'s flush step at 3
        # programs per SM 310 vs 415 us (bf16), 652 vs 569 (fp32: 2 per SM).
        # overlap: b=256 172.7 vs 179.1 us (fp32), 104.9 vs 108.7 (bf16);
        # b=64 48.2 vs 52.6, 30.1 vs 33.0 (2026-12-06, benchmarks/NOTES.md).
        # outputs_in_projection stays off: H100, b=256, 242.4 vs 232.6 us
        # (fp32), 128.1 vs 126.5 (bf16); b=64 66.7 vs 62.9, 37.7 vs 34.7
        # (results/diag/2026-12-06-h100/v2_gdn.md): (A)'s plain steps are
        # ~10 us slower while it waits for (W), more than (B) cost
        if fold_copy:
            # (C) recomputing u from the fold copy, H100, b=256 / 64, L=16,
            # bf16 read copy (results/diag/2026-12-07-thirteenth): 16-row
            # items at 2 warps, 4 per SM, 64 key columns a pass: 206.6 / 60.5
            # us a step; 32 rows / 4 warps at 3 per SM (the plain fold's
            # default, more than fit at 255 registers) 286.7 / 83.2; at 2 per
            # SM 208.4 / 61.5; whole-K passes 210.5 / 65.4
            return SplitConfig(block=cfg.block, num_warps=cfg.num_warps,
                               out_warps=1 if batch >= 64 else 2, fold_block=16,
                               fold_warps=2, fold_per_sm=4, fold_cols=64)
        return SplitConfig(block=cfg.block, num_warps=cfg.num_warps,
                           out_warps=1 if batch >= 64 else 2,
                           fold_per_sm=2 if state_dtype == torch.float32 else 3,
                           project_fold=True, fold_cols=32, overlap=True)
    return cfg


def default_route(batch: int, state_dtype: torch.dtype, mode: int = MODE_DECODE) -> str:
    """The route "auto" means, from measurement on the H200 (GDN, Qwen3-Next shape, L=16,
    amortised over the buffer cycle, benchmarks/results/kernels_gdn_routes.md; fused
    output_only vs split, us: fp32 5.8 vs 10.6 at batch 1, 18.0 vs 17.3 at 8, 32.0 vs
    24.0 at 16, 99.4 vs 66.0 at 64, 320.9 vs 218.6 at 256; bf16 6.4 vs 10.8, 19.8 vs
    15.0, 36.3 vs 19.7, 88.9 vs 50.2, 308.1 vs 161.2; with a fold copy
    (kernels_gdn_fold.md) 7.8 vs 11.5, 25.9 vs 22.1, 137.3 vs 73.9, 491.9 vs 237.6).
    The split route's three launches cost ~5 us more than one fused launch at
    batch 1 and win from batch 8 on, once the checkpoint read dominates.
    Verify (H100, benchmarks/results/kernels_verify_h100.md, fp32, L=16, 2
    accepted; fused vs split vs SGLang's snapshotting verify, us per step and
    layer): chain of 4 at batch 256 1782.0 vs 1282.7 vs 1324.4, tree of 8
    4845.0 vs 3380.6 vs 2541.4; split from batch 256, the one batch timed so
    far (smaller batches keep the fused kernel until measured). Flush has
    only the fused kernel."""
    if mode == MODE_VERIFY:
        return "split" if batch >= VERIFY_SPLIT_MIN_BATCH else "output_only"
    if mode != MODE_DECODE or batch < SPLIT_MIN_BATCH:
        return "output_only"
    return "split"


def _check_fold_copy(checkpoint, checkpoint_fold, v_buffer, beta_buffer, cap):
    """The dual-precision fields come together: the precise copy (same shape
    and strides as the checkpoint) and the raw-input rings it is folded from."""
    given = [t is not None for t in (checkpoint_fold, v_buffer, beta_buffer)]
    check(all(given) or not any(given),
          "checkpoint_fold, v_buffer and beta_buffer go together (the fold copy is folded "
          "from the raw v and beta rings)")
    if not any(given):
        return
    num_slots, HV, V, K = checkpoint.shape
    check_fold_copy(checkpoint, checkpoint_fold, (torch.float32,))
    check(tuple(v_buffer.shape) == (num_slots, HV, cap, V) and v_buffer.stride(-1) == 1
          and v_buffer.dtype in ACT_DTYPES,
          f"v_buffer must be [num_slots={num_slots}, HV={HV}, capacity={cap}, V={V}] in an "
          f"activation dtype, contiguous in V; got {tuple(v_buffer.shape)} {v_buffer.dtype}")
    check(tuple(beta_buffer.shape) == (num_slots, HV, cap) and beta_buffer.stride(-1) == 1
          and beta_buffer.dtype == torch.float32,
          f"beta_buffer must be float32 [num_slots={num_slots}, HV={HV}, capacity={cap}], got "
          f"{tuple(beta_buffer.shape)} {beta_buffer.dtype}")


def _launch(mode, checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids, mixed_qkv,
            a, b, A_log, dt_bias, scale, out, buffer_len, num_k_heads, use_qk_l2norm, config,
            validate, route="auto", checkpoint_fold=None, v_buffer=None, beta_buffer=None,
            parents=None):
    num_slots, HV, V, K = checkpoint.shape
    H = num_k_heads
    cap = u_buffer.shape[2]
    batch = slot_ids.shape[0]
    T = 0 if mixed_qkv is None else mixed_qkv.shape[1]

    check_pool(checkpoint, {"k_buffer": k_buffer, "u_buffer": u_buffer, "g_buffer": g_buffer},
               num_slots, cap, fill, origin, slot_ids, buffer_len, T, mode == MODE_VERIFY)
    check(H >= 1 and HV % H == 0, f"num_v_heads ({HV}) must be a multiple of num_k_heads ({H})")
    check(tuple(k_buffer.shape) == (num_slots, H, cap, K),
          f"k_buffer must be [num_slots={num_slots}, H={H}, capacity, K={K}], got "
          f"{tuple(k_buffer.shape)}")
    check(tuple(u_buffer.shape) == (num_slots, HV, cap, V),
          f"u_buffer must be [num_slots={num_slots}, HV={HV}, capacity, V={V}], got "
          f"{tuple(u_buffer.shape)}")
    check(tuple(g_buffer.shape) == (num_slots, HV, cap),
          f"g_buffer must be [num_slots={num_slots}, HV={HV}, capacity={cap}], got "
          f"{tuple(g_buffer.shape)}")
    check(g_buffer.dtype == torch.float32, f"g_buffer must be float32, got {g_buffer.dtype}")
    check(k_buffer.dtype in ACT_DTYPES and u_buffer.dtype in ACT_DTYPES,
          f"k_buffer/u_buffer dtype must be one of {ACT_DTYPES}")
    _check_fold_copy(checkpoint, checkpoint_fold, v_buffer, beta_buffer, cap)
    has_fold = checkpoint_fold is not None
    if route == "auto":
        route = default_route(batch, checkpoint.dtype, mode)
    check(route in ROUTES, f"route must be one of {ROUTES} or 'auto', got {route!r}")
    check(route not in SPLIT_ROUTES or mode != MODE_FLUSH,
          f"route {route!r} is for decode and verify; flush takes 'output_only'")

    if mixed_qkv is not None:
        dim = 2 * H * K + HV * V
        check(mixed_qkv.dim() == 3 and mixed_qkv.shape[0] == batch and mixed_qkv.shape[2] == dim,
               f"mixed_qkv must be [batch={batch}, T, 2*H*K+HV*V={dim}], got "
               f"{tuple(mixed_qkv.shape)}")
        check(mixed_qkv.stride(-1) == 1, "mixed_qkv must be contiguous in its last dim")
        for name, t in (("a", a), ("b", b)):
            check(t.dim() == 3 and tuple(t.shape) == (batch, T, HV) and t.stride(-1) == 1,
                   f"`{name}` must be [batch, T, HV={HV}] contiguous in HV, got {tuple(t.shape)}")
        check(A_log.shape == (HV,) and dt_bias.shape == (HV,) and A_log.stride(0) == 1
               and dt_bias.stride(0) == 1, f"A_log/dt_bias must be contiguous [HV={HV}]")
        if out is None:
            out = mixed_qkv.new_empty(batch, T, HV, V)
        check(tuple(out.shape) == (batch, T, HV, V) and out.stride(-1) == 1,
               f"out must be [batch, T, HV, V], got {tuple(out.shape)}")
        if validate:
            check_finite(mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    if parents is not None:
        check_parents(parents, batch, T, validate)
    if validate:
        check_live_cursors(fill, slot_ids, num_slots, buffer_len)
    BLOCK_S = ring_block(buffer_len, T, cap)
    if route in SPLIT_ROUTES and mode == MODE_DECODE:
        # config first: a bad one is refused before any launch
        if config is None:
            config = default_config(V, K, checkpoint.dtype, batch, route=route,
                                    fold_copy=has_fold)
        cfg = split_config(config, HV // H)
        check(not has_fold or cfg.fold_dot,
              "SplitConfig.fold_dot=False (the FMA fold) cannot recompute the corrected values "
              "for a fold copy")
        check(not has_fold or not cfg.project_fold,
              "SplitConfig.project_fold=True folds the u_t computed from the read copy: with "
              "a fold copy (checkpoint_fold) use project_fold=False")
        if batch:
            _launch_split(checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
                          mixed_qkv[:, 0], a[:, 0], b[:, 0], A_log, dt_bias, scale, out[:, 0],
                          buffer_len, H, use_qk_l2norm, cfg, BLOCK_S, checkpoint_fold,
                          v_buffer, beta_buffer)
        return out
    if batch == 0:
        return out
    cfg = config or default_config(V, K, checkpoint.dtype, batch, mode=mode)
    args = (checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids)
    if route in SPLIT_ROUTES:
        # verify: (A) h_c q_j and h_c k_j of every draft (raw; (B) divides the
        # norms out), a plain streaming read of the checkpoint; (B) the fused
        # kernel without the checkpoint (outputs, corrected values, the
        # window's append); (C) the flush of the rows whose window fills the
        # buffer, after (A) has read their checkpoint (``config``: (B)'s)
        qk = mixed_qkv[:, :, :2 * H * K].unflatten(-1, (2, H, K))
        proj = project_state(checkpoint, slot_ids, qk, heads_per_group=HV // H)
        _fused(MODE_VERIFY, *args, mixed_qkv, a, b, A_log, dt_bias, scale, out, buffer_len, H,
               use_qk_l2norm, cfg, checkpoint_fold, v_buffer, beta_buffer, parents, proj=proj)
        _fused(MODE_FLUSH, *args, None, None, None, A_log, dt_bias, scale, None, buffer_len, H,
               use_qk_l2norm, cfg, checkpoint_fold, v_buffer, beta_buffer, None,
               flush_window=T)
        return out
    _fused(mode, *args, mixed_qkv, a, b, A_log, dt_bias, scale, out, buffer_len, H,
           use_qk_l2norm, cfg, checkpoint_fold, v_buffer, beta_buffer, parents)
    return out


def _fused(mode, checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids, mixed_qkv,
           a, b, A_log, dt_bias, scale, out, buffer_len, H, use_qk_l2norm, cfg,
           checkpoint_fold, v_buffer, beta_buffer, parents, proj=None, flush_window=None):
    """One launch of the fused kernel on checked tensors (``_launch``'s).
    ``proj`` [b, T, 2, HV, V] fp32: a verify's h_c q_raw and h_c k_raw per
    draft, projected beforehand (no checkpoint read, no flush: the caller
    flushes after it). ``flush_window``: a flush folds only the rows whose
    rule fill + flush_window >= buffer_len fires (default: every row with a
    buffered token)."""
    num_slots, HV, V, K = checkpoint.shape
    cap = u_buffer.shape[2]
    batch = slot_ids.shape[0]
    T = 0 if mixed_qkv is None else mixed_qkv.shape[1]
    has_fold = checkpoint_fold is not None
    BLOCK_S = ring_block(buffer_len, T, cap, cfg.storage_order)
    BLOCK_K = max(16, triton.next_power_of_2(K))
    qkv = mixed_qkv if mixed_qkv is not None else g_buffer.new_empty(batch, 1, 1)
    a_ = a if a is not None else qkv
    b_ = b if b is not None else qkv
    o = out if out is not None else g_buffer.new_empty(batch, 1, 1, 1)
    vb = v_buffer if has_fold else u_buffer  # placeholders: not read without a fold copy
    bb = beta_buffer if has_fold else g_buffer
    par = parents if parents is not None else slot_ids  # placeholder: read only by a tree
    pr = proj if proj is not None else o  # placeholder: read only when projected
    grid = (triton.cdiv(V, cfg.block), HV, batch)
    _gdn_replay_kernel[grid](
        checkpoint, checkpoint_fold if has_fold else checkpoint, k_buffer, u_buffer, g_buffer,
        vb, bb, fill, origin, slot_ids, par,
        qkv, a_, b_, A_log if A_log is not None else g_buffer,
        dt_bias if dt_bias is not None else g_buffer, o, pr, float(scale),
        H, HV, K, V, buffer_len, cap, buffer_len if flush_window is None else flush_window,
        checkpoint.stride(0), checkpoint.stride(1), checkpoint.stride(2),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        u_buffer.stride(0), u_buffer.stride(1), u_buffer.stride(2),
        g_buffer.stride(0), g_buffer.stride(1),
        vb.stride(0), vb.stride(1), vb.stride(2), bb.stride(0), bb.stride(1),
        qkv.stride(0), qkv.stride(1), a_.stride(0), a_.stride(1), b_.stride(0), b_.stride(1),
        o.stride(0), o.stride(1), o.stride(2), par.stride(0),
        pr.stride(0), pr.stride(1), pr.stride(2), pr.stride(3),
        T=T, MODE=mode, TREE=parents is not None, PROJECTED=proj is not None,
        BLOCK_S=BLOCK_S, BLOCK_V=cfg.block,
        BLOCK_K=BLOCK_K,
        USE_QK_L2NORM=use_qk_l2norm, HAS_FOLD_COPY=has_fold, STORAGE_ORDER=cfg.storage_order,
        DOT_PRECISION=dot_precision(), num_warps=cfg.num_warps,
    )
    return out


def _launch_split(checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
                  mixed_qkv, a, b, A_log, dt_bias, scale, out, buffer_len, H, use_qk_l2norm, cfg,
                  BLOCK_S, checkpoint_fold=None, v_buffer=None, beta_buffer=None):
    """The split decode step on checked tensors: mixed_qkv [b, 2*H*K + HV*V],
    a/b [b, HV], out [b, HV, V], cfg a checked SplitConfig. Three launches on
    the current stream, in this order: (A) reads the checkpoint before (C)
    writes it, and (B) appends the token to the ring before (C) folds it from
    there. The cursors are only read; ``cursors.commit`` follows, unchanged.
    With outputs_in_projection: (W), then (A) (which also computes the
    outputs and appends u; no (B))."""
    num_slots, HV, V, K = checkpoint.shape
    batch = slot_ids.shape[0]
    hpg = HV // H

    # (A) proj[row, 0, hv] = h_c q_raw, proj[row, 1, hv] = h_c k_raw (fp32
    # scratch [b, 2, HV, V]): the raw q | k halves of mixed_qkv viewed as
    # [b, 2, H, K] (no copy), norms and scale applied in (B). torch.empty is
    # fine under CUDA graphs: the graph's private pool gives the same buffer
    # on every replay, and (B) reads only entries (A) wrote in the same step.
    BLOCK_K = max(16, triton.next_power_of_2(K))
    overlap = overlap_launch(cfg, checkpoint.device)
    outputs = cfg.outputs_in_projection
    if outputs:
        # (W) the ring weights, [b, HV, 2 BLOCK_S + 6] fp32 scratch (a fixed
        # address under CUDA graphs, as proj below); (A) finishes the outputs
        weights = torch.empty((batch, HV, 2 * BLOCK_S + 6), dtype=torch.float32,
                              device=checkpoint.device)
        _gdn_ring_weights_kernel[(batch, H)](
            k_buffer, g_buffer, fill, origin, slot_ids,
            mixed_qkv, a, b, A_log, dt_bias, weights, float(scale),
            H, HV, K, u_buffer.shape[2],
            k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
            g_buffer.stride(0), g_buffer.stride(1),
            mixed_qkv.stride(0), a.stride(0), b.stride(0), weights.stride(0), weights.stride(1),
            BLOCK_S=BLOCK_S, BLOCK_H=triton.next_power_of_2(hpg), BLOCK_K=BLOCK_K,
            USE_QK_L2NORM=use_qk_l2norm, OVERLAP=overlap, num_warps=cfg.out_warps,
        )
    if cfg.project_fold:  # (A) folds the flushing rows too: no (C)
        if outputs:  # no proj scratch: the pointer stands in, unused
            proj = weights
        else:  # and without (W) the weights pointer
            proj = weights = torch.empty((batch, 2, HV, V), dtype=torch.float32,
                                         device=checkpoint.device)
        _gdn_split_projection_kernel[(triton.cdiv(V, cfg.block), HV, batch)](
            checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
            mixed_qkv, a, b, A_log, dt_bias, proj, weights, out, float(scale),
            H, HV, K, V, buffer_len, u_buffer.shape[2],
            checkpoint.stride(0), checkpoint.stride(1), checkpoint.stride(2),
            k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
            u_buffer.stride(0), u_buffer.stride(1), u_buffer.stride(2),
            g_buffer.stride(0), g_buffer.stride(1),
            mixed_qkv.stride(0), a.stride(0), b.stride(0),
            proj.stride(0), proj.stride(1), proj.stride(2),
            weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
            BLOCK_S=BLOCK_S, BLOCK_R=cfg.block, BLOCK_K=BLOCK_K,
            FOLD_COLS=min(cfg.fold_cols or BLOCK_K, BLOCK_K),
            BF16_TERMS=fold_bf16_terms(cfg.fold_bf16, checkpoint.dtype, k_buffer.dtype),
            USE_QK_L2NORM=use_qk_l2norm, DOT_PRECISION=dot_precision(), OVERLAP=overlap,
            OUTPUTS=outputs, num_warps=cfg.num_warps,
            **({"launch_pdl": True} if overlap and outputs else {}),
        )
        if outputs:
            return
    else:
        qk = mixed_qkv[:, :2 * H * K].unflatten(-1, (2, H, K))
        proj = project_state(checkpoint, slot_ids, qk, heads_per_group=hpg,
                             config=LaunchConfig(cfg.block, cfg.num_warps))

    # (B) outputs + append (every live row, flush step included)
    has_fold = checkpoint_fold is not None
    vb = v_buffer if has_fold else u_buffer  # placeholders: not written without a fold copy
    bb = beta_buffer if has_fold else g_buffer
    _gdn_split_outputs_kernel[(batch, HV // cfg.out_heads)](
        proj, k_buffer, u_buffer, g_buffer, vb, bb, fill, origin, slot_ids,
        mixed_qkv, a, b, A_log, dt_bias, out, float(scale),
        H, HV, K, V, u_buffer.shape[2],
        proj.stride(0), proj.stride(1), proj.stride(2),
        k_buffer.stride(0), k_buffer.stride(1), k_buffer.stride(2),
        u_buffer.stride(0), u_buffer.stride(1), u_buffer.stride(2),
        g_buffer.stride(0), g_buffer.stride(1),
        vb.stride(0), vb.stride(1), vb.stride(2), bb.stride(0), bb.stride(1),
        mixed_qkv.stride(0), a.stride(0), b.stride(0), out.stride(0), out.stride(1),
        HEADS=cfg.out_heads, BLOCK_S=BLOCK_S, BLOCK_V=max(16, triton.next_power_of_2(V)),
        BLOCK_K=max(16, triton.next_power_of_2(K)), USE_QK_L2NORM=use_qk_l2norm,
        HAS_FOLD_COPY=has_fold, OVERLAP=overlap, num_warps=cfg.out_warps,
        **({"launch_pdl": True} if overlap else {}),
    )

    if cfg.project_fold:
        return
    # (C) fold the rows whose decode flush rule fires (the others: a cursor
    # scan): u as the per-head rows, k as the per-group keys, g the log decay;
    # with a fold copy the raw v and beta, u recomputed from the precise copy
    launch_split_fold(checkpoint, checkpoint_fold, vb if has_fold else u_buffer, k_buffer,
                      g_buffer, fill, origin, slot_ids, None, buffer_len=buffer_len, cfg=cfg,
                      BLOCK_S=BLOCK_S, beta_buffer=beta_buffer if has_fold else None)


def gdn_replay_decode(checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
                      mixed_qkv, a, b, A_log, dt_bias, scale, *, buffer_len, num_k_heads,
                      out=None, use_qk_l2norm=True, route="auto", config=None,
                      checkpoint_fold=None, v_buffer=None, beta_buffer=None, validate=False):
    """One decode step of a GDN layer from checkpoint + input buffer.

    Shapes (b = batch rows, S = pool slots, cap = buffer capacity):
        checkpoint   [S, HV, V, K]   fp32/bf16/fp16, K contiguous (SGLang's layout);
                     read every step, written only on the row's flush step
        k_buffer     [S, H, cap, K]  activation dtype: L2-normalised keys
        u_buffer     [S, HV, cap, V] corrected values (fp32 keeps fp32 parity;
                     bf16 halves the ring's bytes)
        g_buffer     [S, HV, cap]    float32 log decays
        fill, origin [S] int32 device cursors (see ``cursors``), read only here
        slot_ids     [b] int32/int64, -1 = padded row (output zeros, pool untouched)
        mixed_qkv    [b, 2*H*K + HV*V] post-conv packed q|k|v (bf16/fp16/fp32)
        a, b         [b, HV]         A_log, dt_bias: [HV]
        out          [b, HV, V] or None (allocated in mixed_qkv's dtype)
    Dual precision (all three or none):
        checkpoint_fold [S, HV, V, K] float32, the checkpoint's strides: the
                     precise copy, read and written only by flushes
        v_buffer     [S, HV, cap, V] activation dtype: the raw values v
        beta_buffer  [S, HV, cap]    float32: the gates beta
    The outputs read ``checkpoint`` (the cheap copy) and the u ring computed
    from it; a flush recomputes the u of the buffered tokens from the fold
    copy and the raw rings (u depends on the state it was computed from, so
    folding the read copy's u would carry its rounding into the recurrence),
    folds into the fold copy and writes both copies.
    Any stride is taken from the tensors except the innermost dim, which must
    be contiguous.

    route: "output_only" (the fused kernel, one launch; ``config`` a
    LaunchConfig), "split" (three launches: (A) ``project_state`` of the
    checkpoint against the raw q_t, k_t into a [b, 2, HV, V] fp32 scratch,
    (B) outputs + ring append, (C) persistent fold of the flushing rows;
    ``config`` a SplitConfig, a plain LaunchConfig sets (A)'s tile only), or
    "auto" (:func:`default_route`). The split route appends every token to
    the ring, the flushing one included, and folds it from there (needs
    capacity >= buffer_len, which ``required_capacity(L, 1)`` gives); so a
    decode flush leaves its token in a ring entry past the (then empty)
    buffer, and with a bf16 ring the folded token's u and k are the ring's
    rounded values (the fused kernel folds them unrounded). Otherwise both
    routes leave the checkpoint and the ring equal up to fp32 rounding.
    Returns ``out`` [b, HV, V]. Afterwards ``cursors.commit(mode=MODE_DECODE)``.
    """
    if mixed_qkv.dim() != 2:
        raise ValueError(f"decode expects mixed_qkv [batch, dim], got {tuple(mixed_qkv.shape)}")
    o = _launch(MODE_DECODE, checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
                mixed_qkv.unsqueeze(1), a.unsqueeze(1), b.unsqueeze(1), A_log, dt_bias, scale,
                None if out is None else out.unsqueeze(1), buffer_len, num_k_heads,
                use_qk_l2norm, config, validate, route, checkpoint_fold, v_buffer, beta_buffer)
    return o.squeeze(1)


def gdn_replay_verify(checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
                      mixed_qkv, a, b, A_log, dt_bias, scale, *, buffer_len, num_k_heads,
                      out=None, use_qk_l2norm=True, route="auto", config=None,
                      checkpoint_fold=None, v_buffer=None, beta_buffer=None, parents=None,
                      validate=False):
    """Verification of T draft tokens per row, a chain or a tree, output-only.

    As :func:`gdn_replay_decode` with a window dim: mixed_qkv [b, T, dim],
    a/b [b, T, HV], out [b, T, HV, V]. Each draft's corrected value depends
    on the drafts before it on its path; they are computed in window order
    inside the kernel from one checkpoint read and appended to the ring
    after the committed history, draft j at window position j.
        parents      None: a chain (draft j follows draft j-1). Else [b, T]
                     int32 or int64: draft j's parent's window index (< j),
                     -1 for a draft that follows the committed history (a
                     tree, e.g. EAGLE's with topk > 1: draft j sees only its
                     ancestors). Entry 0 is not read (draft 0 follows the
                     history), so SGLang's ``retrieve_parent_token`` is taken
                     as it is.
    The checkpoint is written only when the flush rule fires, and then with
    the committed history alone. Afterwards, for a tree,
    ``cursors.accept_path`` moves the accepted drafts' entries to the first
    window positions (every ring of every layer); then, chain or tree,
    ``commit(mode=MODE_VERIFY, ...)``.
    route: "output_only" (one fused launch) or "split": (A)
    :func:`~sglang_replayssm.kernels.projection.project_state` of every
    draft's raw q and k (fp32 scratch [b, T, 2, HV, V]), (B) the fused kernel
    without the checkpoint, (C) a flush launch for the rows the window fills
    (``config``: (B)'s LaunchConfig); "auto": :func:`default_route` (split
    from batch 256).
    """
    if mixed_qkv.dim() != 3:
        raise ValueError(f"verify expects mixed_qkv [batch, T, dim], got {tuple(mixed_qkv.shape)}")
    return _launch(MODE_VERIFY, checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
                   mixed_qkv, a, b, A_log, dt_bias, scale, out, buffer_len, num_k_heads,
                   use_qk_l2norm, config, validate, route, checkpoint_fold, v_buffer,
                   beta_buffer, parents)


def gdn_replay_flush(checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids, *,
                     buffer_len, num_k_heads, route="auto", config=None, checkpoint_fold=None,
                     v_buffer=None, beta_buffer=None, validate=False):
    """Fold each row's buffered tokens into its checkpoint (empty rows skipped).
    Afterwards ``cursors.commit(mode=MODE_FLUSH)`` once for all layers.
    ``route="split"`` raises ValueError (the fused kernel flushes any pool).
    With a fold copy (see :func:`gdn_replay_decode`) both copies are written."""
    _launch(MODE_FLUSH, checkpoint, k_buffer, u_buffer, g_buffer, fill, origin, slot_ids,
            None, None, None, None, None, 1.0, None, buffer_len, num_k_heads, True, config,
            validate, route, checkpoint_fold, v_buffer, beta_buffer)
