"""Mamba-2 ReplaySSM kernels: decode, chain verify and flush in one Triton kernel.

Per request slot and layer the pool holds a checkpoint ``h_c`` [H, P, N] and
an input buffer (a ring of ``capacity`` entries) of the SSM inputs seen since
the checkpoint: ``x`` [H, cap, P], ``B`` [G, cap, N] (activation dtype) and
the effective step ``dt`` [H, cap] (float32, after bias and softplus). The
cursors (``fill``, ``origin``) and the flush rule are defined in
:mod:`sglang_replayssm.kernels.cursors`.

For token ``q`` at logical position ``q`` after the checkpoint, with
``cum_s = sum_{r<=s} A dt_r``, the kernel computes (fp32 accumulation)

    y_q = exp(cum_q) h_c C_q + sum_{s<=q} exp(cum_q - cum_s) dt_s (B_s . C_q) x_s + D x_q

reading the checkpoint once per step and writing it only on a flush, where

    h_c <- exp(cum_n) h_c + sum_{s<n} exp(cum_n - cum_s) dt_s x_s B_s^T     (tl.dot)

Two routes compute ``y_q`` (``tl.constexpr RECONSTRUCT``):

* ``output_only``: inner products only, ``exp(cum_q) (h_c . C_q) + sum_s w_s x_s``;
* ``reconstruct``: rebuild the state with ``tl.dot`` and read it with ``C_q``.

The window's own inputs are read from the call's tensors, never back from the
buffer, so no program reads an entry another program of the same launch
writes. One program handles (row, head, BLOCK_P slice of headdim); all P
slices of a head and all heads of a group share their B/C reads through L2.

Decode also has the ``split`` route (benchmarks/NOTES.md, design A/B/C):
two or three launches per step, so that the checkpoint read does not wait
on the cursor -> ring chain and the outputs' programs carry no state tile:

* (A) ``_mamba2_split_projection_kernel`` (``SplitConfig.project_fold``,
  the default): proj = h_c C_q (fp32 scratch [b, H, P]), slot -> state tile
  -> reduce, and on a row's flush step the fold of that tile (history from
  the ring, this token from the inputs), written back: one checkpoint read
  per step, flush step included. Without project_fold, (A) is the plain
  :func:`~sglang_replayssm.kernels.projection.project_state` and (C) folds;
* (B) ``_mamba2_split_outputs_kernel``: y from proj, the cursors and the
  ring, then appends the token (x, B, dt) at position ``fill`` -- always, the
  flushing token too (decode capacity is buffer_len, so the entry exists);
* (C) (project_fold=False only)
  :func:`~sglang_replayssm.kernels.fold.split_fold_kernel` (shared with
  GDN): persistent; folds the fill + 1 ring entries of the rows whose flush
  rule fires, all others cost a cursor scan.

With ``SplitConfig.outputs_in_projection`` (the default) there is no (B):
``_mamba2_ring_weights_kernel`` (W) runs first, one program per (row,
group), and writes each head's history weights exp(cum_q - cum_s) dt_s
(B_s . C_q), exp(cum_q) and dt_q (B_q . C_q) (fp32 scratch [b, H, S + 2])
and appends B and dt; (A) then finishes y for its headdim slice from its
projection, those weights and the head's x ring slice, and appends x.

The checkpoint and the ring end each step exactly as with the fused kernel
(up to fp32 rounding), except that a decode flush leaves its token in a ring
entry past the (then empty) buffer; ``cursors.commit`` is unchanged.

Verify has a split route too (``route="split"``, not the default: untimed):
(A) :func:`~sglang_replayssm.kernels.projection.project_state` of every
draft's C, a plain streaming read of the checkpoint; (B) the fused
kernel with ``PROJECTED``, which reads those projections instead of a state
tile and flushes nothing; (C) the fused kernel's flush mode for the rows the
window fills (rule fill + T >= buffer_len), after (A) has read them.

The float64 oracles are in :mod:`sglang_replayssm.reference`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (ACT_DTYPES, STATE_DTYPES, LaunchConfig, SplitConfig, check, check_finite,
                     check_fold_copy, check_live_cursors, check_parents, check_pool,
                     dot_precision, let_dependents_launch, on_path, overlap_launch, ring_block,
                     ring_cumsum, ring_index, ring_positions, softplus, split_config,
                     split_step_cursors, tree_paths, wait_for_prior_launch)
from .cursors import MODE_DECODE, MODE_FLUSH, MODE_VERIFY
from .fold import fold_bf16_terms
from .fold import fold_dot as _fold
from .fold import launch_split_fold
from .fold import split_fold_kernel as _mamba2_split_fold_kernel  # noqa: F401 (tests, regs)
from .projection import project_state

__all__ = ["mamba2_replay_decode", "mamba2_replay_verify", "mamba2_replay_flush",
           "ROUTES", "SPLIT_ROUTES", "SplitConfig", "default_config", "default_route"]

ROUTES = ("output_only", "reconstruct", "split")
# routes of three launches (projection, outputs, fold): decode and verify
SPLIT_ROUTES = ("split",)
# "auto" takes the split route from this decode batch on (see default_route)
SPLIT_MIN_BATCH = 2
# the fused kernel reads the ring in storage order below this batch (see
# default_config)
STORAGE_ORDER_BELOW = 8


@triton.jit
def _skip_gate(y, x_q, d, zq, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """y + D x (skip), times silu(z) (gate), from loaded D and z."""
    if HAS_D:
        y += d.to(tl.float32) * x_q
    if HAS_Z:
        zq = zq.to(tl.float32)
        y = y * zq * tl.sigmoid(zq)
    return y


@triton.jit
def _skip_gate_inputs(D_ptr, head, s_D, z_ptrs, mask_p, HAS_D: tl.constexpr,
                      HAS_Z: tl.constexpr):
    """_skip_gate's D (scalar) and z (as loaded), 0 where absent."""
    d = 0.0
    zq = 0.0
    if HAS_D:
        d = tl.load(D_ptr + head * s_D)
    if HAS_Z:
        zq = tl.load(z_ptrs, mask=mask_p, other=0.0)
    return d, zq


@triton.jit
def _finish_output(y, x_q, D_ptr, head, s_D, z_ptrs, out_ptrs, mask_p,
                   HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """The fused routes' epilogue: load D and z, _skip_gate, store."""
    d, zq = _skip_gate_inputs(D_ptr, head, s_D, z_ptrs, mask_p, HAS_D, HAS_Z)
    y = _skip_gate(y, x_q, d, zq, HAS_D, HAS_Z)
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask_p)


@triton.jit
def _flush(h_c, ckpt_ptr, fold_ptr, ck_off, m_pn, xs, Bs, dt, cum, upto, total,
           HAS_FOLD_COPY: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the ring entries at ``upto`` (``total`` = cum at the last one)
    into the checkpoint tile ``h_c`` as read and store it; with a fold copy
    the fold starts from that copy instead (the precise one; ``h_c`` is then
    unused) and both are written. Returns the folded state (fp32)."""
    if HAS_FOLD_COPY:
        h_c = tl.load(fold_ptr + ck_off, mask=m_pn, other=0.0)
    h = _fold(h_c.to(tl.float32), xs, Bs, dt, cum, upto, total, DOT_PRECISION, 0)
    tl.store(ckpt_ptr + ck_off, h.to(ckpt_ptr.dtype.element_ty), mask=m_pn)
    if HAS_FOLD_COPY:
        tl.store(fold_ptr + ck_off, h.to(fold_ptr.dtype.element_ty), mask=m_pn)
    return h


@triton.jit
def _mamba2_replay_kernel(
    ckpt_ptr, fold_ptr, xbuf_ptr, bbuf_ptr, dtbuf_ptr,
    fill_ptr, origin_ptr, slot_ptr, parent_ptr,
    x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, A_ptr, D_ptr, dt_bias_ptr, out_ptr, proj_ptr,
    heads_per_group, headdim, dstate, buffer_len, capacity, flush_window,
    s_ck_slot, s_ck_head, s_ck_p,
    s_xb_slot, s_xb_head, s_xb_pos,
    s_bb_slot, s_bb_group, s_bb_pos,
    s_db_slot, s_db_head,
    s_x_row, s_x_t, s_x_head,
    s_dt_row, s_dt_t, s_dt_head,
    s_B_row, s_B_t, s_B_group,
    s_C_row, s_C_t, s_C_group,
    s_z_row, s_z_t, s_z_head,
    s_o_row, s_o_t, s_o_head,
    s_A, s_D, s_dtb, s_par_row, s_pr_row, s_pr_t, s_pr_head,
    T: tl.constexpr, MODE: tl.constexpr, TREE: tl.constexpr, PROJECTED: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    RECONSTRUCT: tl.constexpr, HAS_FOLD_COPY: tl.constexpr, HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    STORAGE_ORDER: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: nothing read, nothing written
        return
    fill = tl.load(fill_ptr + slot)
    origin = tl.load(origin_ptr + slot)
    if MODE == 2:  # the rows whose buffer is not empty and whose flush rule fires
        if (fill == 0) | (fill + flush_window < buffer_len):
            return
    group = head // heads_per_group

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    mask_p = offs_p < headdim
    mask_n = offs_n < dstate
    A = tl.load(A_ptr + head * s_A).to(tl.float32)

    ck_off = slot * s_ck_slot + head * s_ck_head + offs_p[:, None] * s_ck_p + offs_n[None, :]
    m_pn = mask_p[:, None] & mask_n[None, :]
    # the checkpoint tile's address depends on the slot only: issued first.
    # A fold copy, if any, is read instead by the rows that fold. A
    # PROJECTED verify reads none: its h_c C_q come from proj_ptr.
    if not PROJECTED:
        h_c = tl.load(ckpt_ptr + ck_off, mask=m_pn, other=0.0)

    # logical positions: [0, fill) = history in the ring, [fill, fill+T) = window;
    # entries not in the history are zeroed after the load (storage order
    # reads the whole ring, stale entries included)
    pos, is_hist, is_win, win, ring, ring_ok = ring_positions(offs_s, fill, origin, capacity,
                                                              T, STORAGE_ORDER)
    dt = tl.load(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring, mask=ring_ok, other=0.0)
    xs = tl.load(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring[:, None] * s_xb_pos
                 + offs_p[None, :], mask=ring_ok[:, None] & mask_p[None, :],
                 other=0.0).to(tl.float32)                                  # [S, P]
    Bs = tl.load(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring[:, None] * s_bb_pos
                 + offs_n[None, :], mask=ring_ok[:, None] & mask_n[None, :],
                 other=0.0).to(tl.float32)                                  # [S, N]
    dt = tl.where(is_hist, dt, 0.0)
    xs = tl.where(is_hist[:, None], xs, 0.0)
    Bs = tl.where(is_hist[:, None], Bs, 0.0)
    # the window's tokens (addresses independent of the cursors) at their positions
    for j in tl.static_range(T):
        at = pos == fill + j
        dt_j = tl.load(dt_ptr + row * s_dt_row + j * s_dt_t + head * s_dt_head).to(tl.float32)
        if HAS_DT_BIAS:
            dt_j += tl.load(dt_bias_ptr + head * s_dtb).to(tl.float32)
        if DT_SOFTPLUS:
            dt_j = softplus(dt_j)
        x_j = tl.load(x_ptr + row * s_x_row + j * s_x_t + head * s_x_head + offs_p,
                      mask=mask_p, other=0.0).to(tl.float32)
        B_j = tl.load(B_ptr + row * s_B_row + j * s_B_t + group * s_B_group + offs_n,
                      mask=mask_n, other=0.0).to(tl.float32)
        dt = tl.where(at, dt_j, dt)
        xs = tl.where(at[:, None], x_j[None, :], xs)
        Bs = tl.where(at[:, None], B_j[None, :], Bs)
    cum = ring_cumsum(dt * A, pos, STORAGE_ORDER)
    if TREE:  # verify of a draft tree: each draft decays along its own path
        cum, path = tree_paths(dt * A, cum, pos, fill, parent_ptr + row * s_par_row, T)

    if MODE == 0:
        # ---- decode: one token at position `fill`, always accepted ----
        flush = fill + 1 >= buffer_len
        C_q = tl.load(C_ptr + row * s_C_row + group * s_C_group + offs_n,
                      mask=mask_n, other=0.0).to(tl.float32)
        if flush:
            # fold history + this token
            upto = pos <= fill
            total = tl.sum(tl.where(upto, dt * A, 0.0), axis=0)
            h = _flush(h_c, ckpt_ptr, fold_ptr, ck_off, m_pn, xs, Bs, dt, cum, upto, total,
                       HAS_FOLD_COPY, DOT_PRECISION)
            y = tl.sum(h * C_q[None, :], axis=1)
        else:
            h = h_c.to(tl.float32)
            cum_q = tl.sum(tl.where(pos == fill, cum, 0.0), axis=0)
            live = pos <= fill
            w = tl.where(live, tl.exp(tl.minimum(cum_q - cum, 0.0)) * dt, 0.0)
            if RECONSTRUCT:
                h_q = h * tl.exp(cum_q) + tl.dot(tl.trans(xs * w[:, None]), Bs,
                                                 input_precision=DOT_PRECISION)
                y = tl.sum(h_q * C_q[None, :], axis=1)
            else:
                cb = tl.sum(Bs * C_q[None, :], axis=1)
                y = tl.exp(cum_q) * tl.sum(h * C_q[None, :], axis=1) + \
                    tl.sum(xs * (w * cb)[:, None], axis=0)
        x_q = tl.load(x_ptr + row * s_x_row + head * s_x_head + offs_p,
                      mask=mask_p, other=0.0).to(tl.float32)
        _finish_output(y, x_q, D_ptr, head, s_D,
                       z_ptr + row * s_z_row + head * s_z_head + offs_p,
                       out_ptr + row * s_o_row + head * s_o_head + offs_p, mask_p,
                       HAS_D, HAS_Z)
        # a flushing row folded its token: it does not enter the buffer
        write = is_win & (fill + 1 < buffer_len)
    else:
        total = tl.sum(tl.where(is_hist, dt * A, 0.0), axis=0)
        if MODE == 1:
            # ---- verify: T drafts, output-only, the window is never folded ----
            # Outputs from the checkpoint as read over history + window; the
            # flush of the history (when the window would fill the buffer)
            # comes after them: folding first made Triton move the tile to
            # the dot's layout on every verify step (scripts/kernel_regs.py)
            if not PROJECTED:
                h = h_c.to(tl.float32)
            for j in tl.static_range(T):
                q = fill + j
                C_q = tl.load(C_ptr + row * s_C_row + j * s_C_t + group * s_C_group + offs_n,
                              mask=mask_n, other=0.0).to(tl.float32)
                cum_q = tl.sum(tl.where(pos == q, cum, 0.0), axis=0)
                if TREE:  # the history, the draft's ancestors and itself
                    live = on_path(path, pos, q, is_hist, is_win, win)
                else:  # the history, every earlier draft and itself
                    live = pos <= q
                w = tl.where(live, tl.exp(tl.minimum(cum_q - cum, 0.0)) * dt, 0.0)
                decay = tl.exp(cum_q)
                if RECONSTRUCT:
                    h_q = h * decay + tl.dot(tl.trans(xs * w[:, None]), Bs,
                                             input_precision=DOT_PRECISION)
                    y = tl.sum(h_q * C_q[None, :], axis=1)
                else:
                    cb = tl.sum(Bs * C_q[None, :], axis=1)
                    if PROJECTED:
                        hc = tl.load(proj_ptr + row * s_pr_row + j * s_pr_t + head * s_pr_head
                                     + offs_p, mask=mask_p, other=0.0)
                    else:
                        hc = tl.sum(h * C_q[None, :], axis=1)
                    y = decay * hc + tl.sum(xs * (w * cb)[:, None], axis=0)
                x_q = tl.load(x_ptr + row * s_x_row + j * s_x_t + head * s_x_head + offs_p,
                              mask=mask_p, other=0.0).to(tl.float32)
                _finish_output(y, x_q, D_ptr, head, s_D,
                               z_ptr + row * s_z_row + j * s_z_t + head * s_z_head + offs_p,
                               out_ptr + row * s_o_row + j * s_o_t + head * s_o_head + offs_p,
                               mask_p, HAS_D, HAS_Z)
            # a PROJECTED verify is flushed by a MODE 2 launch after it
            if not PROJECTED:
                if fill + T >= buffer_len:
                    # the tile folded is read again (L2-hot), not taken from h_c,
                    # for the same reason
                    _flush(tl.load(ckpt_ptr + ck_off, mask=m_pn, other=0.0), ckpt_ptr, fold_ptr,
                           ck_off, m_pn, xs, Bs, dt, cum, is_hist, total, HAS_FOLD_COPY,
                           DOT_PRECISION)
            write = is_win
        else:
            # ---- flush only: fold the whole buffer ----
            _flush(h_c, ckpt_ptr, fold_ptr, ck_off, m_pn, xs, Bs, dt, cum, is_hist, total,
                   HAS_FOLD_COPY, DOT_PRECISION)

    # append the window to the ring: x by every P slice, dt by the first P
    # slice of each head, B by the first P slice of the group's first head
    if T > 0:
        tl.store(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring[:, None] * s_xb_pos
                 + offs_p[None, :], xs.to(xbuf_ptr.dtype.element_ty),
                 mask=write[:, None] & mask_p[None, :])
        if pid_p == 0:
            tl.store(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring, dt, mask=write)
            if head % heads_per_group == 0:
                tl.store(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring[:, None] * s_bb_pos
                         + offs_n[None, :], Bs.to(bbuf_ptr.dtype.element_ty),
                         mask=write[:, None] & mask_n[None, :])


# --------------------------------------------------------------------------
# split decode route: (A) projection, (B) outputs + append, (C) fold
# --------------------------------------------------------------------------
#
# (A) is projection.project_state(checkpoint, slot_ids, C): proj = h_c C_q in
# fp32, no cursor or ring access. (B) below never touches the state; (C)
# works only for flushing rows, so the fold's registers (state tile, ring
# tiles, dot accumulator) no longer size every decode program.


@triton.jit
def _mamba2_split_projection_kernel(
    ckpt_ptr, fold_ptr, xbuf_ptr, bbuf_ptr, dtbuf_ptr, fill_ptr, origin_ptr, slot_ptr,
    x_ptr, dt_ptr, B_ptr, C_ptr, A_ptr, dt_bias_ptr, proj_ptr,
    weights_ptr, z_ptr, D_ptr, out_ptr,
    heads_per_group, headdim, dstate, buffer_len, capacity,
    s_ck_slot, s_ck_head, s_ck_p,
    s_xb_slot, s_xb_head, s_xb_pos,
    s_bb_slot, s_bb_group, s_bb_pos,
    s_db_slot, s_db_head,
    s_x_row, s_x_head, s_dt_row, s_dt_head,
    s_B_row, s_B_group, s_C_row, s_C_group,
    s_pr_row, s_pr_head, s_A, s_dtb,
    s_w_row, s_w_head, s_z_row, s_z_head, s_o_row, s_o_head, s_D,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    FOLD_COLS: tl.constexpr, BF16_TERMS: tl.constexpr, HAS_FOLD_COPY: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    OVERLAP: tl.constexpr, OUTPUTS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
):
    """(A) with the fold: one program per (row, head, BLOCK_P rows of headdim)
    computes proj = h_c C_q from its checkpoint tile and, on the row's flush
    step (fill + 1 >= buffer_len), folds the history and this token into the
    same tile and writes it back. A flush step thus reads the checkpoint
    once, not twice (projection, then the persistent fold (C)), and the folds
    of a step spread over the projection's whole grid. This token's (x, B,
    dt) come from the call's inputs: (B), launched after, appends them.

    The fold takes FOLD_COLS dstate columns at a time, re-read from L2 (the
    projection's tile is dead by then, so the fold does not raise the
    kernel's register count above the projection's). Folding the tile the
    projection holds instead (an option until 2026-12-04) made Triton convert
    a bf16 tile to the dot's layout at its load, on every step
    (scripts/kernel_regs.py). BF16_TERMS (fold.weighted_dot): the fold's
    dot in bf16 MMAs, where the B ring and this token's B are bf16.

    OUTPUTS (SplitConfig.outputs_in_projection): the ring weights kernel (W)
    ran first; this program also finishes the output of its headdim slice,
    y = exp(cum_q) proj + sum_s w_s x_s + dt_q (B_q . C_q) x_q (+ D x_q, z
    gate), from (W)'s weights and the head's x ring slice (loaded with the
    tile, before waiting for (W)), and appends x_q to the ring; no proj
    scratch. A padded row's out is left as it was (as (B) leaves it)."""
    if not OUTPUTS:
        let_dependents_launch(OVERLAP)  # SplitConfig.overlap: (B) may start now
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: its proj / out entries stay unwritten
        return
    group = head // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    mask_p = offs_p < headdim
    mask_n = offs_n < dstate
    m_pn = mask_p[:, None] & mask_n[None, :]
    tile = slot * s_ck_slot + head * s_ck_head + offs_p[:, None] * s_ck_p  # [BLOCK_P, 1]
    # the tile's address depends on the slot only: issued right after it
    h_in = tl.load(ckpt_ptr + tile + offs_n[None, :], mask=m_pn, other=0.0)
    row64 = row.to(tl.int64)
    C_q = tl.load(C_ptr + row64 * s_C_row + group * s_C_group + offs_n, mask=mask_n,
                  other=0.0).to(tl.float32)
    fill = tl.load(fill_ptr + slot)
    if OUTPUTS:  # the head's x ring slice and this token's x leave with the tile
        origin = tl.load(origin_ptr + slot)
        # positions [0, fill) = history in the ring, fill = this token
        _, is_hist, is_win, win, ring, _ = ring_positions(offs_s, fill, origin, capacity, 1,
                                                           False)
        xs_in = tl.load(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring[:, None] * s_xb_pos
                        + offs_p[None, :], mask=is_hist[:, None] & mask_p[None, :], other=0.0)
        x_in = tl.load(x_ptr + row64 * s_x_row + head * s_x_head + offs_p, mask=mask_p,
                       other=0.0)
        d, zq = _skip_gate_inputs(D_ptr, head, s_D,
                                  z_ptr + row64 * s_z_row + head * s_z_head + offs_p, mask_p,
                                  HAS_D, HAS_Z)
    proj = tl.sum(h_in.to(tl.float32) * C_q[None, :], axis=1)
    if OUTPUTS:
        wait_for_prior_launch(OVERLAP)  # (W)'s weights are complete from here on
        w_row = weights_ptr + row64 * s_w_row + head * s_w_head
        w = tl.load(w_row + offs_s)         # 0 outside the history
        e_q = tl.load(w_row + BLOCK_S)      # exp(cum_q)
        c_q = tl.load(w_row + BLOCK_S + 1)  # dt_q B_q . C_q
        x_f = x_in.to(tl.float32)
        y = e_q * proj + tl.sum(xs_in.to(tl.float32) * w[:, None], axis=0) + c_q * x_f
        y = _skip_gate(y, x_f, d, zq, HAS_D, HAS_Z)
        tl.store(out_ptr + row64 * s_o_row + head * s_o_head + offs_p,
                 y.to(out_ptr.dtype.element_ty), mask=mask_p)
        ring_q = ring_index(origin, fill, capacity)
        # append, flush step included (its fold takes x_q from the inputs)
        tl.store(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring_q * s_xb_pos + offs_p,
                 x_in.to(xbuf_ptr.dtype.element_ty), mask=mask_p)
    else:
        tl.store(proj_ptr + row64 * s_pr_row + head * s_pr_head + offs_p, proj, mask=mask_p)
    if fill + 1 >= buffer_len:
        if OUTPUTS:
            xs = xs_in
            x_q = x_in
        else:
            origin = tl.load(origin_ptr + slot)
            _, is_hist, is_win, win, ring, _ = ring_positions(offs_s, fill, origin, capacity,
                                                               1, False)
            xs = tl.load(xbuf_ptr + slot * s_xb_slot + head * s_xb_head
                         + ring[:, None] * s_xb_pos + offs_p[None, :],
                         mask=is_hist[:, None] & mask_p[None, :], other=0.0)
            x_q = tl.load(x_ptr + row64 * s_x_row + head * s_x_head + offs_p, mask=mask_p,
                          other=0.0)
        b_ring = bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring[:, None] * s_bb_pos
        b_tok = B_ptr + row64 * s_B_row + group * s_B_group
        dt_h = tl.load(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring,
                       mask=is_hist, other=0.0)
        dt_q = tl.load(dt_ptr + row64 * s_dt_row + head * s_dt_head).to(tl.float32)
        A = tl.load(A_ptr + head * s_A).to(tl.float32)
        if HAS_DT_BIAS:
            dt_q += tl.load(dt_bias_ptr + head * s_dtb).to(tl.float32)
        if DT_SOFTPLUS:
            dt_q = softplus(dt_q)
        dt = tl.where(is_hist, dt_h, tl.where(is_win, dt_q, 0.0))
        xs = tl.where(is_win[:, None], x_q.to(tl.float32)[None, :], xs.to(tl.float32))
        cum = tl.cumsum(dt * A, axis=0)
        upto = offs_s <= fill
        total = tl.sum(tl.where(upto, dt * A, 0.0), axis=0)
        for c in tl.static_range(0, BLOCK_N, FOLD_COLS):
            offs_c = c + tl.arange(0, FOLD_COLS)
            mask_c = offs_c < dstate
            m_pc = mask_p[:, None] & mask_c[None, :]
            if HAS_FOLD_COPY:  # the fold copy is the precise one
                h = tl.load(fold_ptr + tile + offs_c[None, :], mask=m_pc, other=0.0)
            else:
                h = tl.load(ckpt_ptr + tile + offs_c[None, :], mask=m_pc, other=0.0)
            Bs = tl.load(b_ring + offs_c[None, :], mask=is_hist[:, None] & mask_c[None, :],
                         other=0.0)
            B_q = tl.load(b_tok + offs_c, mask=mask_c, other=0.0)
            Bs = tl.where(is_win[:, None], B_q.to(tl.float32)[None, :], Bs.to(tl.float32))
            h = _fold(h.to(tl.float32), xs, Bs, dt, cum, upto, total, DOT_PRECISION,
                      BF16_TERMS)
            tl.store(ckpt_ptr + tile + offs_c[None, :], h.to(ckpt_ptr.dtype.element_ty),
                     mask=m_pc)
            if HAS_FOLD_COPY:
                tl.store(fold_ptr + tile + offs_c[None, :], h.to(fold_ptr.dtype.element_ty),
                         mask=m_pc)


@triton.jit
def _mamba2_ring_weights_kernel(
    bbuf_ptr, dtbuf_ptr, fill_ptr, origin_ptr, slot_ptr,
    dt_ptr, B_ptr, C_ptr, A_ptr, dt_bias_ptr, weights_ptr,
    heads_per_group, dstate, capacity,
    s_bb_slot, s_bb_group, s_bb_pos,
    s_db_slot, s_db_head,
    s_dt_row, s_dt_head, s_B_row, s_B_group, s_C_row, s_C_group,
    s_A, s_dtb, s_w_row, s_w_head,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, OVERLAP: tl.constexpr,
):
    """(W) (SplitConfig.outputs_in_projection) One program per (row, group):
    the scalar weights with which (A) finishes each head's output,

        weights[row, head, s]           = exp(cum_q - cum_s) dt_s (B_s . C_q)   (history s)
        weights[row, head, BLOCK_S]     = exp(cum_q)
        weights[row, head, BLOCK_S + 1] = dt_q (B_q . C_q)

    (cum includes dt_q A: the decay comes first), 0 at positions past the
    history, for the group's heads as one [heads, S] tile: B_s . C_q once per
    group, the dt ring of all its heads in one load. Then appends this
    token's B (per group) and dt (per head) at ``fill``; (A) appends x. Latency
    bound like (B), with an eighth of its programs (Nemotron-H: 8 groups of 16
    heads, so b x 8 programs) and no x ring. With OVERLAP, (A) may start
    as soon as every program of this launch has."""
    let_dependents_launch(OVERLAP)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    mask_h = offs_h < heads_per_group
    mask_n = offs_n < dstate
    head = group * heads_per_group + offs_h
    # row-indexed loads first, then the slot chain (as (B))
    C_in = tl.load(C_ptr + row * s_C_row + group * s_C_group + offs_n, mask=mask_n, other=0.0)
    B_w = tl.load(B_ptr + row * s_B_row + group * s_B_group + offs_n, mask=mask_n, other=0.0)
    dt_in = tl.load(dt_ptr + row * s_dt_row + head * s_dt_head, mask=mask_h, other=0.0)
    A = tl.load(A_ptr + head * s_A, mask=mask_h, other=0.0)
    dtb = 0.0
    if HAS_DT_BIAS:
        dtb = tl.load(dt_bias_ptr + head * s_dtb, mask=mask_h, other=0.0)
    slot, live, is_hist, is_win, ring, ring_q = split_step_cursors(
        slot_ptr, fill_ptr, origin_ptr, row, offs_s, capacity)
    Bs = tl.load(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring[:, None] * s_bb_pos
                 + offs_n[None, :], mask=is_hist[:, None] & mask_n[None, :], other=0.0)
    dt_h = tl.load(dtbuf_ptr + slot * s_db_slot + head[:, None] * s_db_head + ring[None, :],
                   mask=mask_h[:, None] & is_hist[None, :], other=0.0)          # [H, S]
    C_q = C_in.to(tl.float32)
    cb = tl.sum(Bs.to(tl.float32) * C_q[None, :], axis=1)                     # [S]
    cb_q = tl.sum(B_w.to(tl.float32) * C_q, axis=0)
    dt_q = dt_in.to(tl.float32)
    if HAS_DT_BIAS:
        dt_q += dtb.to(tl.float32)
    if DT_SOFTPLUS:
        dt_q = softplus(dt_q)
    dt = tl.where(is_hist[None, :], dt_h, tl.where(is_win[None, :], dt_q[:, None], 0.0))
    cum = tl.cumsum(dt * A.to(tl.float32)[:, None], axis=1)
    cum_q = tl.sum(tl.where(is_win[None, :], cum, 0.0), axis=1)                 # [H]
    w = tl.where(is_hist[None, :], tl.exp(tl.minimum(cum_q[:, None] - cum, 0.0)) * dt_h,
                 0.0) * cb[None, :]
    w_rows = weights_ptr + row * s_w_row + head * s_w_head                      # [H]
    m_h = mask_h & live
    tl.store(w_rows[:, None] + offs_s[None, :], w, mask=m_h[:, None])
    tl.store(w_rows + BLOCK_S, tl.exp(cum_q), mask=m_h)
    tl.store(w_rows + BLOCK_S + 1, dt_q * cb_q, mask=m_h)
    # append, flush step included (the flush's fold takes them from the inputs)
    tl.store(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring_q, dt_q, mask=m_h)
    tl.store(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring_q * s_bb_pos + offs_n,
             B_w.to(bbuf_ptr.dtype.element_ty), mask=mask_n & live)


@triton.jit
def _mamba2_split_outputs_kernel(
    proj_ptr, xbuf_ptr, bbuf_ptr, dtbuf_ptr, fill_ptr, origin_ptr, slot_ptr,
    x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, A_ptr, D_ptr, dt_bias_ptr, out_ptr,
    heads_per_group, headdim, dstate, capacity,
    s_pr_row, s_pr_head,
    s_xb_slot, s_xb_head, s_xb_pos,
    s_bb_slot, s_bb_group, s_bb_pos,
    s_db_slot, s_db_head,
    s_x_row, s_x_head, s_dt_row, s_dt_head,
    s_B_row, s_B_group, s_C_row, s_C_group,
    s_z_row, s_z_head, s_o_row, s_o_head,
    s_A, s_D, s_dtb,
    HEADS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, OVERLAP: tl.constexpr,
):
    """(B) One program per (row, HEADS consecutive heads of one group): the
    decode output from the projection and the ring, then the token's append.
    No checkpoint access. B_s . C is computed once for the program's heads.

    Latency, not bytes, bounds this kernel (a program moves a few KiB; H200,
    b=256: 56 us for 32768 programs whose loads waited on each other, vs
    ~9 us for its bytes at copy rate), so every load is issued as early as
    its address allows: this token's inputs and the projection (row-indexed)
    before the slot id; the cursors right after it; all ring entries right
    after the cursors, before any reduction. The chain is slot -> cursors ->
    ring -> arithmetic -> stores. A padded row (slot < 0) loads nothing
    slot-indexed and stores nothing (masks, not an early return, which would
    hold every later load behind the slot id). With OVERLAP (SplitConfig.
    overlap) this runs while (A) finishes: the projection is read last, after
    waiting for (A)."""
    row = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * HEADS
    group = head0 // heads_per_group
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    mask_p = offs_p < headdim
    mask_n = offs_n < dstate
    # row-indexed: independent of the slot
    # (loaded values are converted where used: a conversion stalls on its
    # load and would hold every later load behind it)
    C_in = tl.load(C_ptr + row * s_C_row + group * s_C_group + offs_n, mask=mask_n, other=0.0)
    B_w = tl.load(B_ptr + row * s_B_row + group * s_B_group + offs_n, mask=mask_n, other=0.0)
    slot, live, is_hist, is_win, ring, ring_q = split_step_cursors(
        slot_ptr, fill_ptr, origin_ptr, row, offs_s, capacity)
    Bs = tl.load(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring[:, None] * s_bb_pos
                 + offs_n[None, :], mask=is_hist[:, None] & mask_n[None, :], other=0.0)

    for j in tl.static_range(HEADS):
        head = head0 + j
        # loads first (see the docstring), arithmetic after
        A = tl.load(A_ptr + head * s_A)
        dt_in = tl.load(dt_ptr + row * s_dt_row + head * s_dt_head)
        dtb = 0.0
        if HAS_DT_BIAS:
            dtb = tl.load(dt_bias_ptr + head * s_dtb)
        x_w = tl.load(x_ptr + row * s_x_row + head * s_x_head + offs_p, mask=mask_p, other=0.0)
        if not OVERLAP:
            proj = tl.load(proj_ptr + row * s_pr_row + head * s_pr_head + offs_p,
                           mask=mask_p, other=0.0)
        d, zq = _skip_gate_inputs(D_ptr, head, s_D, z_ptr + row * s_z_row + head * s_z_head
                                  + offs_p, mask_p, HAS_D, HAS_Z)
        dt_h = tl.load(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring,
                       mask=is_hist, other=0.0)
        xs = tl.load(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring[:, None] * s_xb_pos
                     + offs_p[None, :], mask=is_hist[:, None] & mask_p[None, :], other=0.0)
        if OVERLAP:
            wait_for_prior_launch(OVERLAP)
            proj = tl.load(proj_ptr + row * s_pr_row + head * s_pr_head + offs_p,
                           mask=mask_p, other=0.0)
        if j == 0:  # B_s . C_q for the history and for this token, shared by the heads
            C_q = C_in.to(tl.float32)
            cb = tl.sum(Bs.to(tl.float32) * C_q[None, :], axis=1)
            cb_q = tl.sum(B_w.to(tl.float32) * C_q, axis=0)
        A = A.to(tl.float32)
        dt_q = dt_in.to(tl.float32)
        if HAS_DT_BIAS:
            dt_q += dtb.to(tl.float32)
        if DT_SOFTPLUS:
            dt_q = softplus(dt_q)
        dt = tl.where(is_hist, dt_h, tl.where(is_win, dt_q, 0.0))
        cum = tl.cumsum(dt * A, axis=0)
        cum_q = tl.sum(tl.where(is_win, cum, 0.0), axis=0)
        # history weights; this token's own weight is dt_q (exp(0) = 1)
        w = tl.where(is_hist, tl.exp(tl.minimum(cum_q - cum, 0.0)) * dt_h, 0.0) * cb
        x_q = x_w.to(tl.float32)
        y = tl.exp(cum_q) * proj + tl.sum(xs.to(tl.float32) * w[:, None], axis=0) \
            + (dt_q * cb_q) * x_q
        y = _skip_gate(y, x_q, d, zq, HAS_D, HAS_Z)
        tl.store(out_ptr + row * s_o_row + head * s_o_head + offs_p,
                 y.to(out_ptr.dtype.element_ty), mask=mask_p & live)
        # append, flush step included: (C) folds it from the ring
        tl.store(xbuf_ptr + slot * s_xb_slot + head * s_xb_head + ring_q * s_xb_pos + offs_p,
                 x_w.to(xbuf_ptr.dtype.element_ty), mask=mask_p & live)
        tl.store(dtbuf_ptr + slot * s_db_slot + head * s_db_head + ring_q, dt_q, mask=live)
    if head0 % heads_per_group == 0:  # one program per group appends B
        tl.store(bbuf_ptr + slot * s_bb_slot + group * s_bb_group + ring_q * s_bb_pos + offs_n,
                 B_w.to(bbuf_ptr.dtype.element_ty), mask=mask_n & live)


# --------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------

def default_config(headdim: int, dstate: int, state_dtype: torch.dtype,
                   batch: int = 256, route: str = "output_only",
                   heads_per_group: int = 1, mode: int = MODE_DECODE) -> LaunchConfig:
    """Launch configuration, from the H200 sweeps in benchmarks/results/
    (kernels_mamba2*.json): at serving batch sizes a whole head per program
    with 2 warps (more programs resident per SM); small batches need more,
    smaller programs to fill the GPU. For the split route a SplitConfig whose
    projection tile follows the same rule (its sweep is flat), with (B) at one
    warp from batch 16 and (C) at 3 programs per SM: H200, Nemotron-H-8B
    shape, b=256, L=16 (benchmarks/results/kernels_mamba2_latency.md), (B)
    39.7 us at 1 warp vs 62.8 at 2 (its 32768 programs are latency bound:
    more of them resident wins); (C)'s flush step 761 us at 3 per SM vs 928
    at 2 (fp32; bf16 563 vs 731); from batch 64 two heads per (B) program
    where the group splits evenly (b=256: 329.9 vs 339.5 us whole route, fp32;
    198.1 vs 207.2 bf16; diag_mamba2_heads in benchmarks/NOTES.md). (B)
    overlaps (A) (SplitConfig.overlap; 2026-12-06, b=256: 306.3 vs 309.8 us
    fp32, 178.5 vs 181.4 bf16; b=64 81.7 vs 84.4, 49.9 vs 52.7). The
    outputs are finished in (A) after the ring weights (W) instead of in (B)
    (SplitConfig.outputs_in_projection; H100, 2026-12-06, results/diag/
    2026-12-06-h100/v2_m2.md, b=256: 408.7 vs 417.1 us fp32, 221.0 vs 230.5
    bf16; b=64 107.7 vs 108.8, 61.3 vs 62.2; b=1-32 within 2% either way
    for fp32, bf16 up to 14% faster at b=2).
    Below batch 8 (STORAGE_ORDER_BELOW: the fused kernel of decode at batch 1
    and of verify, one latency-bound launch) the ring is read in storage
    order, so its loads leave with the checkpoint read instead of waiting for
    the origin cursor: batch 1, block 32, 4 warps,
    5.6 / 5.0 us per step (fp32 / bf16 state) vs 6.4 / 5.6 in the record before
    (kernels_mamba2_small.json; in its sweep 7.5 vs 8.1 and 7.0 vs 7.3 us
    with the commit launch). Batches 2-7 follow batch 1 unmeasured; from 8
    the logical order stays.
    Verify and flush-only (``mode``) keep 32 rows at 4 warps at every batch:
    the decode shape of serving batches (a whole head, 2 warps) spills there
    on sm_90 (offline, scripts/kernel_regs.py: verify T=4 ~2 KB a thread,
    flush-only 132-336 B), 32 / 4 does not up to T=8 (not timed)."""
    if batch >= 32 and mode == MODE_DECODE:
        cfg = LaunchConfig(block=min(64, max(16, triton.next_power_of_2(headdim))), num_warps=2)
    else:
        cfg = LaunchConfig(block=32 if headdim > 16 else 16, num_warps=4,
                           storage_order=batch < STORAGE_ORDER_BELOW)
    if route in SPLIT_ROUTES:
        two = batch >= 64 and heads_per_group % 2 == 0
        return SplitConfig(block=cfg.block, num_warps=cfg.num_warps,
                           out_heads=2 if two else 1, out_warps=1 if batch >= 16 else 2,
                           fold_per_sm=3, project_fold=True, fold_cols=32, overlap=True,
                           outputs_in_projection=True)
    return cfg


def default_route(batch: int, state_dtype: torch.dtype, mode: int = MODE_DECODE) -> str:
    """The route "auto" means, from measurement on the H200 (Mamba-2,
    Nemotron-H-8B shape, L=16, amortised over the buffer cycle,
    benchmarks/results/kernels_mamba2_latency.md; fused output_only vs split
    at its defaults of then): fp32 6.3 vs 8.8 us at batch 1, 25.5 vs 19.0 at
    8, 45.9 vs 30.7 at 16, 431.1 vs 372.9 at 256; bf16 5.7 vs 8.2, 22.7 vs
    14.9, 40.9 vs 22.6, 307.0 vs 241.2. The split route's three launches cost
    a few microseconds more than one fused launch at batch 1 and win from
    batch 8. Batches 2-7, measured since on the H100 with (B) overlapping (A)
    (2026-12-06, benchmarks/results/kernels_mamba2_h100.md, same order): fp32
    10.0 vs 7.2 at 2, 15.6 vs 11.9 at 4; bf16 8.8 vs 6.7, 12.7 vs 8.8; batch
    1 there 6.0 vs 5.7 (fp32), 5.0 vs 5.0 (bf16), not moved without an H200
    run. Verify keeps the fused kernel: its split route is not timed yet
    (benchmarks/NOTES.md, 2026-12-07 eighteenth); flush has only the fused kernel."""
    if mode != MODE_DECODE or batch < SPLIT_MIN_BATCH:
        return "output_only"
    return "split"


def _per_head(t: torch.Tensor | None, name: str, nheads: int, batch_dims: int = 0):
    """Accept a per-head parameter either as [.., H] or in SGLang's layout
    expanded over headdim (and dstate) with stride 0; return the [.., H] view."""
    if t is None:
        return None
    while t.dim() > batch_dims + 1:
        if t.stride(-1) != 0 and t.shape[-1] != 1:
            raise ValueError(
                f"ReplaySSM Mamba-2 needs `{name}` tied across headdim/dstate (one value per "
                f"head, as Mamba-2 models pass it: expanded with stride 0); got shape "
                f"{tuple(t.shape)} with strides {t.stride()}")
        t = t[..., 0]
    if t.shape[-1] != nheads:
        raise ValueError(f"`{name}` must have {nheads} heads in its last per-head dim, "
                         f"got shape {tuple(t.shape)}")
    return t


def _launch(mode, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
            x, dt, A, B, C, D, z, dt_bias, dt_softplus, out, buffer_len, checkpoint_fold,
            route, config, validate, parents=None):
    num_slots, H, P, N = checkpoint.shape
    G = B_buffer.shape[1]
    cap = x_buffer.shape[2]
    batch = slot_ids.shape[0]
    T = 0 if x is None else x.shape[1]

    check_pool(checkpoint, {"x_buffer": x_buffer, "B_buffer": B_buffer, "dt_buffer": dt_buffer},
               num_slots, cap, fill, origin, slot_ids, buffer_len, T, mode == MODE_VERIFY)
    if checkpoint_fold is not None:
        check_fold_copy(checkpoint, checkpoint_fold, STATE_DTYPES)
    check(tuple(x_buffer.shape) == (num_slots, H, cap, P),
          f"x_buffer must be [num_slots={num_slots}, H={H}, capacity, P={P}], got "
          f"{tuple(x_buffer.shape)}")
    check(tuple(B_buffer.shape) == (num_slots, G, cap, N) and H % G == 0,
          f"B_buffer must be [num_slots={num_slots}, G, capacity={cap}, N={N}] with H % G == 0, "
          f"got {tuple(B_buffer.shape)}")
    check(tuple(dt_buffer.shape) == (num_slots, H, cap),
          f"dt_buffer must be [num_slots={num_slots}, H={H}, capacity={cap}], got "
          f"{tuple(dt_buffer.shape)}")
    check(dt_buffer.dtype == torch.float32, f"dt_buffer must be float32, got {dt_buffer.dtype}")
    check(x_buffer.dtype in ACT_DTYPES and B_buffer.dtype in ACT_DTYPES,
          f"x_buffer/B_buffer dtype must be one of {ACT_DTYPES}")
    if route == "auto":
        route = default_route(batch, checkpoint.dtype, mode)
    check(route in ROUTES, f"route must be one of {ROUTES} or 'auto', got {route!r}")
    check(route not in SPLIT_ROUTES or mode != MODE_FLUSH,
          f"route {route!r} is for decode and verify; flush takes 'output_only'")

    if x is not None:
        check(x.dim() == 4 and x.shape[0] == batch and x.shape[2:] == (H, P),
               f"x must be [batch={batch}, T, H={H}, P={P}], got {tuple(x.shape)}")
        check(x.dtype in ACT_DTYPES, f"x dtype {x.dtype} not supported")
        check(x.stride(-1) == 1, "x must be contiguous in headdim")
        for name, t in (("B", B), ("C", C)):
            check(t.dim() == 4 and tuple(t.shape) == (batch, T, G, N),
                   f"{name} must be [batch={batch}, T={T}, G={G}, N={N}], got {tuple(t.shape)}")
            check(t.stride(-1) == 1, f"{name} must be contiguous in dstate")
        check(dt.dim() == 3 and tuple(dt.shape) == (batch, T, H),
               f"dt must be [batch, T, H] (per-head), got {tuple(dt.shape)}")
        if z is not None:
            check(z.shape == x.shape and z.stride(-1) == 1,
                  "z must have the shape of x, contiguous")
        if out is None:
            out = torch.empty_like(x)
        check(out.shape == x.shape and out.stride(-1) == 1, "out must have the shape of x")
        if validate:
            check_finite(x=x, dt=dt, B=B, C=C, z=z)
    if parents is not None:
        check_parents(parents, batch, T, validate)
    A = _per_head(A, "A", H)
    D = _per_head(D, "D", H)
    dt_bias = _per_head(dt_bias, "dt_bias", H)
    if validate:
        check_finite(A=A, D=D, dt_bias=dt_bias)
        check_live_cursors(fill, slot_ids, num_slots, buffer_len)
    if batch == 0:
        return out

    if route in SPLIT_ROUTES and mode == MODE_DECODE:
        BLOCK_S = ring_block(buffer_len, T, cap)
        _launch_split(checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
                      x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, None if z is None else z[:, 0],
                      dt_bias, dt_softplus, out[:, 0], buffer_len, checkpoint_fold, config,
                      BLOCK_S)
        return out
    cfg = config or default_config(P, N, checkpoint.dtype, batch, mode=mode)
    if route in SPLIT_ROUTES:
        # verify: (A) h_c C_q for every draft, a plain streaming read of the
        # checkpoint; (B) the fused kernel without the checkpoint (outputs and
        # the window's append); (C) the flush of the rows whose window fills
        # the buffer, after (A) has read their checkpoint (``config``: (B)'s)
        proj = project_state(checkpoint, slot_ids, C, heads_per_group=H // G)
        _fused(MODE_VERIFY, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
               x, dt, A, B, C, D, z, dt_bias, dt_softplus, out, buffer_len, None, "output_only",
               cfg, parents, proj=proj)
        _fused(MODE_FLUSH, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
               None, None, A, None, None, None, None, None, True, None, buffer_len,
               checkpoint_fold, "output_only", cfg, None, flush_window=T)
        return out
    _fused(mode, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids, x, dt, A,
           B, C, D, z, dt_bias, dt_softplus, out, buffer_len, checkpoint_fold, route, cfg,
           parents)
    return out


def _fused(mode, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids, x, dt, A,
           B, C, D, z, dt_bias, dt_softplus, out, buffer_len, checkpoint_fold, route, cfg,
           parents, proj=None, flush_window=None):
    """One launch of the fused kernel on checked tensors (``_launch``'s shapes,
    A/D/dt_bias [H]). ``proj`` [b, T, H, P] fp32: a verify's h_c C_q,
    projected beforehand (no checkpoint read, no flush: the caller flushes
    after it). ``flush_window``: a flush folds only the rows whose rule
    fill + flush_window >= buffer_len fires (default: every row with a
    buffered token)."""
    num_slots, H, P, N = checkpoint.shape
    G = B_buffer.shape[1]
    cap = x_buffer.shape[2]
    batch = slot_ids.shape[0]
    T = 0 if x is None else x.shape[1]
    BLOCK_S = ring_block(buffer_len, T, cap, cfg.storage_order)
    BLOCK_N = max(16, triton.next_power_of_2(N))
    dummy = dt_buffer
    xs = x if x is not None else x_buffer.new_empty(batch, 1, H, P)
    dts = dt if dt is not None else dt_buffer.new_empty(batch, 1, H)
    Bw = B if B is not None else B_buffer.new_empty(batch, 1, G, N)
    Cw = C if C is not None else Bw
    zs = z if z is not None else xs
    outs = out if out is not None else xs
    par = parents if parents is not None else slot_ids  # placeholder: read only by a tree
    pr = proj if proj is not None else dummy  # placeholder: read only when projected
    grid = (triton.cdiv(P, cfg.block), H, batch)
    _mamba2_replay_kernel[grid](
        checkpoint, checkpoint_fold if checkpoint_fold is not None else checkpoint,
        x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids, par,
        xs, dts, Bw, Cw, zs, A, D if D is not None else dummy,
        dt_bias if dt_bias is not None else dummy, outs, pr,
        H // G, P, N, buffer_len, cap, buffer_len if flush_window is None else flush_window,
        checkpoint.stride(0), checkpoint.stride(1), checkpoint.stride(2),
        x_buffer.stride(0), x_buffer.stride(1), x_buffer.stride(2),
        B_buffer.stride(0), B_buffer.stride(1), B_buffer.stride(2),
        dt_buffer.stride(0), dt_buffer.stride(1),
        xs.stride(0), xs.stride(1), xs.stride(2),
        dts.stride(0), dts.stride(1), dts.stride(2),
        Bw.stride(0), Bw.stride(1), Bw.stride(2),
        Cw.stride(0), Cw.stride(1), Cw.stride(2),
        zs.stride(0), zs.stride(1), zs.stride(2),
        outs.stride(0), outs.stride(1), outs.stride(2),
        A.stride(0), D.stride(0) if D is not None else 0,
        dt_bias.stride(0) if dt_bias is not None else 0, par.stride(0),
        pr.stride(0), pr.stride(1), pr.stride(2),
        T=T, MODE=mode, TREE=parents is not None, PROJECTED=proj is not None,
        BLOCK_S=BLOCK_S, BLOCK_P=cfg.block,
        BLOCK_N=BLOCK_N,
        RECONSTRUCT=(route == "reconstruct"), HAS_FOLD_COPY=checkpoint_fold is not None,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, STORAGE_ORDER=cfg.storage_order,
        DOT_PRECISION=dot_precision(), num_warps=cfg.num_warps,
    )
    return out


def _launch_split(checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
                  x, dt, A, B, C, D, z, dt_bias, dt_softplus, out, buffer_len, checkpoint_fold,
                  config, BLOCK_S):
    """The split decode step on checked tensors: x/z/out [b, H, P], dt [b, H],
    B/C [b, G, N], A/D/dt_bias [H] (or None). Launches on the current stream,
    in this order: (A) (with project_fold: projects and folds each tile it
    reads; (B) reads only the projection and the ring history, which (A)
    does not write), (B), and without project_fold (C): (A) reads the
    checkpoint before (C) writes it, and (B) appends the token to the ring
    before (C) folds it from there. With outputs_in_projection: (W), then (A)
    (which also computes the outputs and appends x; no (B))."""
    num_slots, H, P, N = checkpoint.shape
    G = B_buffer.shape[1]
    cap = x_buffer.shape[2]
    batch = slot_ids.shape[0]
    hpg = H // G
    cfg = split_config(config or default_config(P, N, checkpoint.dtype, batch, route="split",
                                                  heads_per_group=hpg),
                       hpg)
    BLOCK_P = max(16, triton.next_power_of_2(P))
    BLOCK_N = max(16, triton.next_power_of_2(N))
    dummy = dt_buffer
    overlap = overlap_launch(cfg, x.device)

    zs = z if z is not None else x
    outputs = cfg.outputs_in_projection
    if outputs:
        # (W) the ring weights, [b, H, BLOCK_S + 2] fp32 scratch (a fixed
        # address under CUDA graphs, as proj below); (A) finishes the outputs
        weights = torch.empty((batch, H, BLOCK_S + 2), dtype=torch.float32, device=x.device)
        _mamba2_ring_weights_kernel[(batch, G)](
            B_buffer, dt_buffer, fill, origin, slot_ids,
            dt, B, C, A, dt_bias if dt_bias is not None else dummy, weights,
            hpg, N, cap,
            B_buffer.stride(0), B_buffer.stride(1), B_buffer.stride(2),
            dt_buffer.stride(0), dt_buffer.stride(1),
            dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            A.stride(0), dt_bias.stride(0) if dt_bias is not None else 0,
            weights.stride(0), weights.stride(1),
            BLOCK_S=BLOCK_S, BLOCK_H=triton.next_power_of_2(hpg), BLOCK_N=BLOCK_N,
            HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, OVERLAP=overlap,
            num_warps=cfg.out_warps,
        )

    # (A) proj[row, head, :] = h_c C_q, fp32 scratch. torch.empty is fine
    # under CUDA graphs: the graph's private pool gives the same buffer on
    # every replay, and (B) reads only entries (A) wrote in the same step.
    if cfg.project_fold:  # (A) folds the flushing rows too: no (C)
        if outputs:  # no proj scratch: the pointer stands in, unused
            proj = weights
        else:  # and without (W) the weights pointer
            proj = weights = torch.empty((batch, H, P), dtype=torch.float32, device=x.device)
        _mamba2_split_projection_kernel[(triton.cdiv(P, cfg.block), H, batch)](
            checkpoint, checkpoint_fold if checkpoint_fold is not None else checkpoint,
            x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
            x, dt, B, C, A, dt_bias if dt_bias is not None else dummy, proj,
            weights, zs, D if D is not None else dummy, out,
            hpg, P, N, buffer_len, cap,
            checkpoint.stride(0), checkpoint.stride(1), checkpoint.stride(2),
            x_buffer.stride(0), x_buffer.stride(1), x_buffer.stride(2),
            B_buffer.stride(0), B_buffer.stride(1), B_buffer.stride(2),
            dt_buffer.stride(0), dt_buffer.stride(1),
            x.stride(0), x.stride(1), dt.stride(0), dt.stride(1),
            B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            proj.stride(0), proj.stride(1), A.stride(0),
            dt_bias.stride(0) if dt_bias is not None else 0,
            weights.stride(0), weights.stride(1), zs.stride(0), zs.stride(1),
            out.stride(0), out.stride(1), D.stride(0) if D is not None else 0,
            BLOCK_S=BLOCK_S, BLOCK_P=cfg.block, BLOCK_N=BLOCK_N,
            FOLD_COLS=min(cfg.fold_cols or BLOCK_N, BLOCK_N),
            BF16_TERMS=fold_bf16_terms(cfg.fold_bf16, (checkpoint if checkpoint_fold is None
                                                       else checkpoint_fold).dtype,
                                       B_buffer.dtype, B.dtype),
            HAS_FOLD_COPY=checkpoint_fold is not None, HAS_DT_BIAS=dt_bias is not None,
            DT_SOFTPLUS=dt_softplus, DOT_PRECISION=dot_precision(), OVERLAP=overlap,
            OUTPUTS=outputs, HAS_D=D is not None, HAS_Z=z is not None,
            num_warps=cfg.num_warps, **({"launch_pdl": True} if overlap and outputs else {}),
        )
        if outputs:
            return
    else:
        proj = project_state(checkpoint, slot_ids, C, heads_per_group=hpg,
                             config=LaunchConfig(cfg.block, cfg.num_warps))

    # (B) outputs + append (every live row, flush step included)
    _mamba2_split_outputs_kernel[(batch, H // cfg.out_heads)](
        proj, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
        x, dt, B, C, zs, A, D if D is not None else dummy,
        dt_bias if dt_bias is not None else dummy, out,
        hpg, P, N, cap,
        proj.stride(0), proj.stride(1),
        x_buffer.stride(0), x_buffer.stride(1), x_buffer.stride(2),
        B_buffer.stride(0), B_buffer.stride(1), B_buffer.stride(2),
        dt_buffer.stride(0), dt_buffer.stride(1),
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        zs.stride(0), zs.stride(1), out.stride(0), out.stride(1),
        A.stride(0), D.stride(0) if D is not None else 0,
        dt_bias.stride(0) if dt_bias is not None else 0,
        HEADS=cfg.out_heads, BLOCK_S=BLOCK_S, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=dt_softplus, OVERLAP=overlap, num_warps=cfg.out_warps,
        **({"launch_pdl": True} if overlap else {}),
    )

    if cfg.project_fold:
        return
    # (C) fold the rows whose decode flush rule fires (the others: a cursor scan)
    launch_split_fold(checkpoint, checkpoint_fold, x_buffer, B_buffer, dt_buffer, fill, origin,
                      slot_ids, A, buffer_len=buffer_len, cfg=cfg, BLOCK_S=BLOCK_S)


def mamba2_replay_decode(checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
                         x, dt, A, B, C, *, buffer_len, D=None, z=None, dt_bias=None,
                         dt_softplus=True, out=None, checkpoint_fold=None, route="auto",
                         config=None, validate=False):
    """One decode step of a Mamba-2 layer from checkpoint + input buffer.

    Shapes (b = batch rows, S = pool slots, cap = buffer capacity):
        checkpoint       [S, H, P, N]   fp32/bf16/fp16, dstate contiguous; read
                         every step, written only on the row's flush step
        checkpoint_fold  [S, H, P, N] or None: the precise copy the flush reads
                         and writes (dual precision; same strides as checkpoint)
        x_buffer         [S, H, cap, P] activation dtype (bf16/fp16/fp32)
        B_buffer         [S, G, cap, N] activation dtype
        dt_buffer        [S, H, cap]    float32 (effective dt, after bias+softplus)
        fill, origin     [S] int32 device cursors (see ``cursors``); read only
                         here, advanced afterwards by ``cursors.commit``
        slot_ids         [b] int32/int64, -1 = padded row (untouched)
        x                [b, H, P]      dt [b, H] or [b, H, P] with stride 0 over P
        A                [H] fp32 or [H, P, N] with stride 0 (SGLang's layout)
        B, C             [b, G, N]      D, dt_bias: [H] or [H, P] stride 0, or None
        z                [b, H, P] or None (gate y * silu(z))
        out              [b, H, P] or None (allocated like x)
    Any stride is taken from the tensors (slot stride included) except the
    innermost dim, which must be contiguous.

    route: "output_only" / "reconstruct" (one fused launch, ``config`` a
    LaunchConfig), "split" (three launches, ``config`` a SplitConfig; a plain
    LaunchConfig sets the projection's tile only; allocates a [b, H, P] fp32
    scratch), or "auto" (:func:`default_route`). The split route appends every
    token to the ring, the flushing one included, and folds it from there
    (needs capacity >= buffer_len, which ``required_capacity(L, 1)`` gives).
    Returns ``out``.
    """
    if x.dim() != 3:
        raise ValueError(f"decode expects x [batch, H, P], got {tuple(x.shape)}")
    H = x.shape[1]
    dt = _per_head(dt, "dt", H, batch_dims=1)
    o = _launch(MODE_DECODE, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
                x.unsqueeze(1), dt.unsqueeze(1), A, B.unsqueeze(1), C.unsqueeze(1), D,
                None if z is None else z.unsqueeze(1), dt_bias, dt_softplus,
                None if out is None else out.unsqueeze(1), buffer_len, checkpoint_fold,
                route, config, validate)
    return o.squeeze(1)


def mamba2_replay_verify(checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
                         x, dt, A, B, C, *, buffer_len, D=None, z=None, dt_bias=None,
                         dt_softplus=True, out=None, checkpoint_fold=None, route="auto",
                         config=None, parents=None, validate=False):
    """Verification of T draft tokens per row, a chain or a tree, output-only.

    Same tensors as :func:`mamba2_replay_decode` with a window dim:
    x [b, T, H, P], dt [b, T, H] (or [b, T, H, P] stride 0), B/C [b, T, G, N],
    z/out [b, T, H, P]. The T tokens are appended to the ring after the row's
    committed history (draft j at window position j) and all T outputs come
    from one checkpoint read; the checkpoint is written only when the row's
    flush rule fires, and then only with the committed history (drafts are
    never folded before acceptance).
        parents  None: a chain (draft j follows draft j-1). Else [b, T] int32
                 or int64: draft j's parent's window index (< j), -1 for a
                 draft that follows the committed history (a tree: draft j's
                 output sees only its ancestors). Entry 0 is not read (draft
                 0 follows the history), so SGLang's ``retrieve_parent_token``
                 is taken as it is.
    Afterwards, for a tree, ``cursors.accept_path`` (every ring, every
    layer); then ``cursors.commit(mode=MODE_VERIFY, accepted=...)``.
    Needs ``T < buffer_len`` and ``capacity >= buffer_len - 1 + T``.
    route: "output_only" / "reconstruct" (one fused launch) or "split": (A)
    :func:`~sglang_replayssm.kernels.projection.project_state` of every
    draft's C (fp32 scratch [b, T, H, P]), (B) the fused kernel without the
    checkpoint, (C) a flush launch for the rows the window fills (``config``:
    (B)'s LaunchConfig); "auto" is "output_only".
    """
    if x.dim() != 4:
        raise ValueError(f"verify expects x [batch, T, H, P], got {tuple(x.shape)}")
    dt = _per_head(dt, "dt", x.shape[2], batch_dims=2)
    return _launch(MODE_VERIFY, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
                   x, dt, A, B, C, D, z, dt_bias, dt_softplus, out, buffer_len, checkpoint_fold,
                   route, config, validate, parents)


def mamba2_replay_flush(checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids, A, *,
                        buffer_len, checkpoint_fold=None, config=None, validate=False):
    """Fold each row's buffered tokens into its checkpoint (rows with an empty
    buffer are skipped). Same pool tensors as :func:`mamba2_replay_decode`.
    Afterwards call ``cursors.commit(mode=MODE_FLUSH)`` once for all layers."""
    _launch(MODE_FLUSH, checkpoint, x_buffer, B_buffer, dt_buffer, fill, origin, slot_ids,
            None, None, A, None, None, None, None, None, True, None, buffer_len,
            checkpoint_fold, "output_only", config, validate)
