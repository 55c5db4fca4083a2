"""The split decode route's fold (C), shared by the Mamba-2 and GDN families.

Both families fold the same shape of update into a checkpoint tile h
[rows, K] (Mamba-2: [P, N] of head ``head``; GDN: [V, K] of v-head ``hv``):

    h <- exp(total) h + sum_s exp(total - cum_s) w_s v_s k_s^T,
    cum_s = sum_{r<=s} a_r,  total = cum at the last entry,

from three rings of the input buffer, indexed like the checkpoint's heads:

    ===========  ==========================  ===========================
    ring         Mamba-2                     GDN
    ===========  ==========================  ===========================
    vbuf [S, heads, cap, rows]   x            u (corrected values)
    kbuf [S, groups, cap, K]     B            k (L2-normalised keys)
    gbuf [S, heads, cap] fp32    dt           g (log decay)
    log decay a_s                A dt_s       g_s
    weight w_s                   dt_s         1
    ===========  ==========================  ===========================

so one kernel serves both; ``DT_GATED`` (tl.constexpr) picks the column.
Head ``head`` reads group ``head // heads_per_group`` (Mamba-2 ngroups, GDN
GVA).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import dot_precision, interpreting, ring_index

__all__ = ["fold_dot", "weighted_dot", "fold_bf16_terms", "gdn_recompute_values",
           "gdn_values_from_products", "split_fold_kernel", "launch_split_fold"]


@triton.jit
def fold_dot(h, vs, ks, w_in, cum, upto, total, DOT_PRECISION: tl.constexpr,
             BF16_TERMS: tl.constexpr):
    """State after the positions selected by ``upto``: exp(total) h + sum_s
    exp(total - cum_s) w_in_s v_s k_s^T, where total = cum at the last one.
    vs: [S, R]; ks: [S, K]; w_in, cum: [S]; h: [R, K]. The sum is
    :func:`weighted_dot` of the weighted values and the keys."""
    w = tl.where(upto, tl.exp(tl.minimum(total - cum, 0.0)) * w_in, 0.0)
    return h * tl.exp(total) + weighted_dot(vs * w[:, None], ks, DOT_PRECISION, BF16_TERMS)


@triton.jit
def weighted_dot(a, ks, DOT_PRECISION: tl.constexpr, BF16_TERMS: tl.constexpr):
    """a^T ks in fp32: a [S, R] fp32 (ring values times their fold weights),
    ks [S, K] (ring keys).

    BF16_TERMS = 0: one tl.dot at DOT_PRECISION (on the GPU tf32x3, three tf32
    MMAs: a and ks both split into a tf32 head and tail).
    BF16_TERMS = n > 0, only where every key is exact in bf16 (a bf16 key
    ring): only a needs splitting. It is cut into n bf16 parts, a = a_1 + ...
    + a_n + rest with |rest| <= 2^(-8n) |a| (each part is the bf16 rounding of
    what is left), and each part meets the keys in a bf16 MMA accumulating in
    fp32. n = 3 keeps a's 24 bits (an fp32 state), n = 2 keeps 16 (enough for
    a bf16 / fp16 state, whose own rounding is 2^-9 / 2^-12). A bf16 MMA does
    a tf32 one's work in half the time, so the fold's tensor-core work drops
    to 1/2 (n = 3) or 1/3 (n = 2) of tf32x3's: the flush step of the split
    route's projection is bound by it at serving batch sizes."""
    if BF16_TERMS == 0:
        return tl.dot(tl.trans(a), ks, input_precision=DOT_PRECISION)
    # DOT_PRECISION "ieee" (the interpreter, common.dot_precision): the parts
    # meet the keys as fp32 holding bf16 values, the same exact products (the
    # interpreter's dot takes bf16 operands' bits for numbers)
    mma = tl.float32 if DOT_PRECISION == "ieee" else tl.bfloat16
    k16 = ks.to(tl.bfloat16).to(mma)
    part = a.to(tl.bfloat16)
    acc = tl.dot(tl.trans(part.to(mma)), k16, out_dtype=tl.float32)
    rest = a - part.to(tl.float32)
    for _ in tl.static_range(BF16_TERMS - 1):
        part = rest.to(tl.bfloat16)
        acc = tl.dot(tl.trans(part.to(mma)), k16, acc, out_dtype=tl.float32)
        rest = rest - part.to(tl.float32)
    return acc


def fold_bf16_terms(enabled: bool, state_dtype: torch.dtype, *key_dtypes: torch.dtype) -> int:
    """BF16_TERMS for :func:`weighted_dot` (SplitConfig.fold_bf16): 0 unless
    enabled and every key the fold reads is stored in bf16; then 3 for an fp32
    state (or fold copy), 2 for a bf16 / fp16 one."""
    if not enabled or any(d != torch.bfloat16 for d in key_dtypes):
        return 0
    return 3 if state_dtype == torch.float32 else 2


@triton.jit
def gdn_recompute_values(h, vs, betas, ks, cum, pos, upto, BLOCK_S: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """GDN's corrected values of the selected positions, recomputed from the
    checkpoint tile h [R, K] (the precise copy) and the raw inputs:

        u_s = beta_s (v_s - exp(cum_s) h k_s - sum_{r<s} exp(cum_s - cum_r) (k_r . k_s) u_r)

    vs: [S, R] raw values; betas, cum: [S]; ks: [S, K]; pos: [S] logical
    positions (any order: "r < s" is pos_r < pos_s); upto: [S] bool.
    Returns U [S, R], zero outside ``upto``. :func:`gdn_values_from_products`
    is the same from the products h k_s and k_r . k_s, for a caller that
    accumulates them over column chunks."""
    hk = tl.dot(ks, tl.trans(h), input_precision=DOT_PRECISION)          # [S, R]: h k_s
    kk = tl.dot(ks, tl.trans(ks), input_precision=DOT_PRECISION)         # [S, S]: k_s . k_r
    return gdn_values_from_products(hk, kk, vs, betas, cum, pos, upto, BLOCK_S, DOT_PRECISION)


@triton.jit
def gdn_values_from_products(hk, kk, vs, betas, cum, pos, upto, BLOCK_S: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):
    """:func:`gdn_recompute_values` given hk [S, R] (h k_s) and kk [S, S]
    (k_s . k_r): solves (I + M) U = B with M[s, r] = beta_s exp(cum_s - cum_r)
    (k_r . k_s) strictly lower triangular and B[s] = beta_s (v_s - exp(cum_s)
    h k_s). M is nilpotent (M^S = 0), so (I + M)^-1 = (I - M)(I + M^2)(I + M^4)...
    with log2(S) factors: a handful of [S, S] tl.dots instead of S sequential
    substitution steps (which, unrolled, spill registers)."""
    offs_s = tl.arange(0, BLOCK_S)
    rhs = betas[:, None] * (vs - tl.exp(cum)[:, None] * hk)
    rhs = tl.where(upto[:, None], rhs, 0.0)
    lower = (pos[None, :] < pos[:, None]) & upto[:, None] & upto[None, :]
    neg = tl.where(lower, -betas[:, None] * tl.exp(tl.minimum(cum[:, None] - cum[None, :], 0.0))
                   * kk, 0.0)                                            # -M
    inv = tl.where(offs_s[:, None] == offs_s[None, :], 1.0, 0.0) + neg  # I - M
    power = tl.dot(neg, neg, input_precision=DOT_PRECISION)             # M^2
    for _ in tl.static_range(BLOCK_S.bit_length() - 2):                  # log2(S) - 1 more
        inv += tl.dot(inv, power, input_precision=DOT_PRECISION)
        power = tl.dot(power, power, input_precision=DOT_PRECISION)
    return tl.dot(inv, rhs, input_precision=DOT_PRECISION)


@triton.jit
def split_fold_kernel(
    ckpt_ptr, fold_ptr, vbuf_ptr, kbuf_ptr, gbuf_ptr, betabuf_ptr, fill_ptr, origin_ptr,
    slot_ptr, A_ptr,
    batch, nheads, heads_per_group, rows, dim, buffer_len, capacity,
    s_ck_slot, s_ck_head, s_ck_row,
    s_vb_slot, s_vb_head, s_vb_pos,
    s_kb_slot, s_kb_group, s_kb_pos,
    s_gb_slot, s_gb_head, s_bb_slot, s_bb_head, s_A,
    ROWS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_FOLD_COPY: tl.constexpr, FOLD_DOT: tl.constexpr, DT_GATED: tl.constexpr,
    RECOMPUTE: tl.constexpr, FOLD_COLS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """(C) Persistent: every program scans the batch's cursors (ROWS rows at a
    time, as a vector), enumerates the work items (flushing row, head, row
    block) of the decode flush rule fill + 1 >= buffer_len, and folds items
    pid, pid + nprog, ... of that list. A step without a flushing row costs
    the cursor scan only. Each row folds its fill + 1 ring entries (the
    history and the token the outputs kernel (B) just appended)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_rblk = tl.cdiv(rows, BLOCK_R)
    per_row = nheads * n_rblk
    offs_b = tl.arange(0, ROWS)
    offs_r0 = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_s = tl.arange(0, BLOCK_S)
    mask_k = offs_k < dim
    # while loops, not range(): Triton 3.6's interpreter cannot take a runtime
    # range bound under NumPy 2.4 (int() of a 1-element array)
    done = pid * 0  # items enumerated in earlier chunks (item g goes to program g % nprog)
    start = pid * 0
    while start < batch:
        brows = start + offs_b
        slots = tl.load(slot_ptr + brows, mask=brows < batch, other=-1).to(tl.int64)
        live = slots >= 0
        fills = tl.load(fill_ptr + slots, mask=live, other=0)
        flush = live & (fills + 1 >= buffer_len)
        rank = tl.cumsum(flush.to(tl.int32), axis=0) - 1
        n_items = tl.sum(flush.to(tl.int32), axis=0) * per_row
        i = (pid - done % nprog + nprog) % nprog
        while i < n_items:
            k = i // per_row
            rem = i - k * per_row
            head = rem // n_rblk
            rblk = rem - head * n_rblk
            sel = flush & (rank == k)
            slot = tl.sum(tl.where(sel, slots, 0), axis=0)
            fill = tl.sum(tl.where(sel, fills, 0), axis=0)
            origin = tl.load(origin_ptr + slot)
            group = head // heads_per_group
            offs_r = rblk * BLOCK_R + offs_r0
            mask_r = offs_r < rows
            m_rk = mask_r[:, None] & mask_k[None, :]
            ck_row = slot * s_ck_slot + head * s_ck_head + offs_r[:, None] * s_ck_row
            ck_off = ck_row + offs_k[None, :]
            if DT_GATED:  # Mamba-2: log decay A dt, input weight dt
                A = tl.load(A_ptr + head * s_A).to(tl.float32)
            else:         # GDN: the ring holds the log decay g itself, weight 1
                A = 1.0
            upto = offs_s <= fill
            ring = ring_index(origin, offs_s, capacity)
            gs = tl.load(gbuf_ptr + slot * s_gb_slot + head * s_gb_head + ring,
                         mask=upto, other=0.0)
            total = tl.sum(gs * A, axis=0)
            if RECOMPUTE:
                # GDN with a fold copy (dot fold only): vbuf holds the raw v, u
                # is recomputed from the precise copy. The tile and the keys
                # pass in chunks of FOLD_COLS columns, twice (the products h k_s
                # and k_r . k_s, then the fold; the second pass re-reads them
                # from L2), so that neither lives whole in registers across the
                # solve: whole, this item needed 255 registers and spilled
                # (sm_90, scripts/kernel_regs.py)
                vs = tl.load(vbuf_ptr + slot * s_vb_slot + head * s_vb_head
                             + ring[:, None] * s_vb_pos + offs_r[None, :],
                             mask=upto[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
                bs = tl.load(betabuf_ptr + slot * s_bb_slot + head * s_bb_head + ring,
                             mask=upto, other=0.0)
                k_row = kbuf_ptr + slot * s_kb_slot + group * s_kb_group + ring[:, None] * s_kb_pos
                hk = tl.zeros([BLOCK_S, BLOCK_R], dtype=tl.float32)
                kk = tl.zeros([BLOCK_S, BLOCK_S], dtype=tl.float32)
                for c in tl.static_range(0, BLOCK_K, FOLD_COLS):
                    offs_c = c + tl.arange(0, FOLD_COLS)
                    mask_c = offs_c < dim
                    h_c = tl.load(fold_ptr + ck_row + offs_c[None, :],
                                  mask=mask_r[:, None] & mask_c[None, :], other=0.0)
                    k_c = tl.load(k_row + offs_c[None, :], mask=upto[:, None] & mask_c[None, :],
                                  other=0.0).to(tl.float32)
                    hk += tl.dot(k_c, tl.trans(h_c), input_precision=DOT_PRECISION)
                    kk += tl.dot(k_c, tl.trans(k_c), input_precision=DOT_PRECISION)
                cum = tl.cumsum(gs, axis=0)
                us = gdn_values_from_products(hk, kk, vs, bs, cum, offs_s, upto, BLOCK_S,
                                              DOT_PRECISION)
                # fold_dot per chunk: exp(total) h + sum_s exp(total - cum_s) u_s k_s^T
                a_w = us * tl.where(upto, tl.exp(tl.minimum(total - cum, 0.0)), 0.0)[:, None]
                decay = tl.exp(total)
                for c in tl.static_range(0, BLOCK_K, FOLD_COLS):
                    offs_c = c + tl.arange(0, FOLD_COLS)
                    mask_c = offs_c < dim
                    m_c = mask_r[:, None] & mask_c[None, :]
                    h_c = tl.load(fold_ptr + ck_row + offs_c[None, :], mask=m_c, other=0.0)
                    k_c = tl.load(k_row + offs_c[None, :], mask=upto[:, None] & mask_c[None, :],
                                  other=0.0).to(tl.float32)
                    h_c = h_c * decay + weighted_dot(a_w, k_c, DOT_PRECISION, 0)
                    tl.store(ckpt_ptr + ck_row + offs_c[None, :],
                             h_c.to(ckpt_ptr.dtype.element_ty), mask=m_c)
                    tl.store(fold_ptr + ck_row + offs_c[None, :],
                             h_c.to(fold_ptr.dtype.element_ty), mask=m_c)
            else:
                # converted to fp32 only where used: a conversion here would
                # hold the ring loads below behind this tile's arrival
                if HAS_FOLD_COPY:  # the fold copy is the precise one
                    h_in = tl.load(fold_ptr + ck_off, mask=m_rk, other=0.0)
                else:
                    h_in = tl.load(ckpt_ptr + ck_off, mask=m_rk, other=0.0)
                if FOLD_DOT:
                    # every ring load issued before the first reduction: the
                    # item's chain is slot -> origin -> ring -> fold -> store
                    vs = tl.load(vbuf_ptr + slot * s_vb_slot + head * s_vb_head
                                 + ring[:, None] * s_vb_pos + offs_r[None, :],
                                 mask=upto[:, None] & mask_r[None, :], other=0.0)
                    ks = tl.load(kbuf_ptr + slot * s_kb_slot + group * s_kb_group
                                 + ring[:, None] * s_kb_pos + offs_k[None, :],
                                 mask=upto[:, None] & mask_k[None, :], other=0.0)
                    cum = tl.cumsum(gs * A, axis=0)
                    if DT_GATED:
                        w_in = gs
                    else:
                        w_in = tl.where(upto, 1.0, 0.0)
                    h = fold_dot(h_in.to(tl.float32), vs.to(tl.float32), ks.to(tl.float32),
                                 w_in, cum, upto, total, DOT_PRECISION, 0)
                else:
                    # FMA outer products, one ring entry at a time (no [S, rows] /
                    # [S, K] tiles, no dot accumulator layout)
                    h = h_in.to(tl.float32) * tl.exp(total)
                    run = total * 0.0
                    s = fill * 0
                    while s <= fill:
                        r = ring_index(origin, s, capacity)
                        d = tl.load(gbuf_ptr + slot * s_gb_slot + head * s_gb_head + r)
                        run += d * A
                        ws = tl.exp(tl.minimum(total - run, 0.0))
                        if DT_GATED:
                            ws = ws * d
                        vv = tl.load(vbuf_ptr + slot * s_vb_slot + head * s_vb_head
                                     + r * s_vb_pos + offs_r, mask=mask_r, other=0.0).to(tl.float32)
                        kv = tl.load(kbuf_ptr + slot * s_kb_slot + group * s_kb_group
                                     + r * s_kb_pos + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                        h += (vv * ws)[:, None] * kv[None, :]
                        s += 1
                tl.store(ckpt_ptr + ck_off, h.to(ckpt_ptr.dtype.element_ty), mask=m_rk)
                if HAS_FOLD_COPY:
                    tl.store(fold_ptr + ck_off, h.to(fold_ptr.dtype.element_ty), mask=m_rk)
            i += nprog
        done += n_items
        start += ROWS


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fold_programs(device, per_sm: int = 2) -> int:
    """(C)'s default persistent grid: ``per_sm`` programs per SM (interpreter: 2)."""
    if interpreting() or device.type != "cuda":
        return 2
    return per_sm * _sm_count(device.index if device.index is not None else
                              torch.cuda.current_device())


def launch_split_fold(checkpoint, checkpoint_fold, vbuf, kbuf, gbuf, fill, origin, slot_ids,
                      A, *, buffer_len, cfg, BLOCK_S, beta_buffer=None):
    """Launch (C) on checked tensors (see the module docstring for the rings):
    checkpoint (and checkpoint_fold, same strides, or None) [S, heads, rows, K];
    vbuf [S, heads, cap, rows]; kbuf [S, groups, cap, K]; gbuf [S, heads, cap]
    fp32; fill/origin [S] int32 (this step's, before commit); slot_ids [b];
    A [heads] fp32 (Mamba-2) or None (GDN: the ring holds the log decay).
    cfg: SplitConfig (fold_block, fold_warps, fold_programs, fold_rows, fold_dot),
    already checked by ``common.split_config``. GDN with a fold copy:
    ``beta_buffer`` [S, heads, cap] fp32 and vbuf the *raw* v ring; the fold
    recomputes u from the fold copy (``gdn_values_from_products``, dot fold
    only), cfg.fold_cols key columns at a time (0: all)."""
    recompute = beta_buffer is not None
    assert not recompute or (A is None and checkpoint_fold is not None and cfg.fold_dot)
    _, H, R, K = checkpoint.shape
    G = kbuf.shape[1]
    batch = slot_ids.shape[0]
    BLOCK_R = max(16, triton.next_power_of_2(R))
    fold_block = cfg.fold_block or BLOCK_R
    fold_rows = cfg.fold_rows or min(1024, triton.next_power_of_2(batch))
    BLOCK_K = max(16, triton.next_power_of_2(K))
    nprog = cfg.fold_programs or fold_programs(checkpoint.device, cfg.fold_per_sm)
    split_fold_kernel[(nprog,)](
        checkpoint, checkpoint_fold if checkpoint_fold is not None else checkpoint,
        vbuf, kbuf, gbuf, beta_buffer if recompute else gbuf, fill, origin, slot_ids,
        A if A is not None else gbuf,
        batch, H, H // G, R, K, buffer_len, vbuf.shape[2],
        checkpoint.stride(0), checkpoint.stride(1), checkpoint.stride(2),
        vbuf.stride(0), vbuf.stride(1), vbuf.stride(2),
        kbuf.stride(0), kbuf.stride(1), kbuf.stride(2),
        gbuf.stride(0), gbuf.stride(1),
        beta_buffer.stride(0) if recompute else 0, beta_buffer.stride(1) if recompute else 0,
        A.stride(0) if A is not None else 0,
        ROWS=fold_rows, BLOCK_S=BLOCK_S, BLOCK_R=fold_block,
        BLOCK_K=BLOCK_K,
        HAS_FOLD_COPY=checkpoint_fold is not None, FOLD_DOT=bool(cfg.fold_dot),
        DT_GATED=A is not None, RECOMPUTE=recompute,
        FOLD_COLS=min(cfg.fold_cols or BLOCK_K, BLOCK_K), DOT_PRECISION=dot_precision(),
        num_warps=cfg.fold_warps,
    )
