"""Checkpoint projection: stream a pool of per-head state matrices and reduce
each against a vector of its (row, group).

    out[row, j, head, r] = sum_k state[slot[row], head, r, k] * vec[row, j, head // hpg, k]

(fp32 accumulation, any state dtype). This is the first launch of the split
decode route (benchmarks/NOTES.md, "Design this points to", A): it reads
nothing but the slot id, the state tile and the vectors, so no load waits for
the cursors or the ring and each program is a plain streaming read
(slot -> state tile -> reduce -> store), which the H200 probe ran at copy
bandwidth. The kernel knows nothing about the SSM family:

* Mamba-2: state = checkpoint [S, H, P, N], vec = C [b, G, N] -> h_c C;
* GDN (later): state = checkpoint [S, HV, V, K], vec = q (and k) per k-head.

``NUM_T`` x ``NUM_VEC`` vectors per (row, group) (e.g. the T tokens of a
verify window, each with GDN's q and k) are reduced against one read of the
tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import STATE_DTYPES, ACT_DTYPES, LaunchConfig, check

__all__ = ["project_state", "default_projection_config"]


@triton.jit
def _projection_kernel(
    state_ptr, slot_ptr, vec_ptr, out_ptr,
    heads_per_group, rows, dim,
    s_st_slot, s_st_head, s_st_row,
    s_v_row, s_v_t, s_v_j, s_v_group,
    s_o_row, s_o_j, s_o_head,
    NUM_T: tl.constexpr, NUM_VEC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_r = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: its out entries stay unwritten
        return
    group = head // heads_per_group
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_r = offs_r < rows
    mask_k = offs_k < dim
    # the tile's address depends on the slot only: issued right after it
    h = tl.load(state_ptr + slot * s_st_slot + head * s_st_head + offs_r[:, None] * s_st_row
                + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
    h = h.to(tl.float32)
    row64 = row.to(tl.int64)
    for t in tl.static_range(NUM_T):
        for j in tl.static_range(NUM_VEC):
            v = tl.load(vec_ptr + row64 * s_v_row + t * s_v_t + j * s_v_j + group * s_v_group
                        + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            y = tl.sum(h * v[None, :], axis=1)
            # out [b, (T,) V, H, R] with contiguous (T, V): entry t * NUM_VEC + j
            tl.store(out_ptr + row64 * s_o_row + (t * NUM_VEC + j) * s_o_j + head * s_o_head
                     + offs_r, y, mask=mask_r)


def default_projection_config(rows: int, dim: int, state_dtype: torch.dtype,
                              batch: int = 256) -> LaunchConfig:
    """The roofline probe (benchmarks/NOTES.md) streamed at copy bandwidth with
    64 rows and 1-4 warps at b=256; small batches get smaller tiles so that
    the grid still fills the GPU. Untuned: sweep on the GPU."""
    if batch >= 32:
        return LaunchConfig(block=min(64, max(16, triton.next_power_of_2(rows))), num_warps=2)
    return LaunchConfig(block=32 if rows > 16 else 16, num_warps=4)


def project_state(state, slot_ids, vec, *, heads_per_group=None, out=None, config=None):
    """Reduce each (row, head) state matrix against its group's vector(s).

    Shapes (b = batch rows, S = pool slots):
        state     [S, H, R, K]  fp32/bf16/fp16, innermost dim contiguous, any
                  other strides (slot stride included); read only
        slot_ids  [b] int32/int64; a negative id = padded row (nothing read,
                  its ``out`` entries left as they were)
        vec       [b, G, K], [b, V, G, K] or [b, T, V, G, K]  fp32/bf16/fp16,
                  K contiguous, any other strides; head h reads group
                  h // (H // G) (Mamba-2 ngroups, GDN GVA)
        out       [b, H, R], [b, V, H, R] or [b, T, V, H, R] (as vec) float32,
                  contiguous except in b, or None (allocated with torch.empty:
                  a fixed address under CUDA graph capture, since the graph's
                  pool replays the same allocation)
    heads_per_group: default H // G.
    config: LaunchConfig (block = state rows per program, num_warps).
    Returns ``out``: out[row, (t, j,) head, r] = sum_k state[slot, head, r, k]
    * vec[row, (t, j,) g, k].
    """
    check(state.dim() == 4 and state.dtype in STATE_DTYPES and state.stride(-1) == 1,
          f"state must be a [S, H, R, K] {STATE_DTYPES} tensor contiguous in K, got "
          f"{state.dtype} {tuple(state.shape)} strides {state.stride()}")
    S, H, R, K = state.shape
    check(vec.dim() in (3, 4, 5), f"vec must be [b, (T, V,) G, K], got {tuple(vec.shape)}")
    v5 = vec
    while v5.dim() < 5:
        v5 = v5.unsqueeze(1)
    check(v5.shape[-1] == K and v5.stride(-1) == 1 and v5.dtype in ACT_DTYPES,
          f"vec must be [b, (T, V,) G, K={K}] contiguous in K, got {tuple(vec.shape)}")
    b, NT, NV, G, _ = v5.shape
    check(slot_ids.dim() == 1 and slot_ids.shape[0] == b
          and slot_ids.dtype in (torch.int32, torch.int64),
          f"slot_ids must be a [b={b}] int32/int64 tensor, got {slot_ids.dtype} "
          f"{tuple(slot_ids.shape)}")
    hpg = heads_per_group if heads_per_group is not None else H // max(G, 1)
    check(G >= 1 and hpg * G == H, f"H={H} heads must split into G={G} groups")
    out_shape = tuple(vec.shape[:-2]) + (H, R)
    if out is None:
        out = torch.empty(out_shape, dtype=torch.float32, device=state.device)
    check(tuple(out.shape) == out_shape and out.dtype == torch.float32
          and (b == 0 or out[0].is_contiguous()),
          f"out must be a float32 {list(out_shape)} tensor contiguous except in b, got "
          f"{out.dtype} {tuple(out.shape)}")
    if b == 0:
        return out
    cfg = config or default_projection_config(R, K, state.dtype, b)
    grid = (triton.cdiv(R, cfg.block), H, b)
    _projection_kernel[grid](
        state, slot_ids, v5, out, hpg, R, K,
        state.stride(0), state.stride(1), state.stride(2),
        v5.stride(0), v5.stride(1), v5.stride(2), v5.stride(3),
        out.stride(0), H * R, R,
        NUM_T=NT, NUM_VEC=NV, BLOCK_R=cfg.block, BLOCK_K=max(16, triton.next_power_of_2(K)),
        num_warps=cfg.num_warps,
    )
    return out
