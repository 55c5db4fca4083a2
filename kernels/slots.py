"""Masked copies of whole pool slots (the radix cache's track snapshots).

SGLang's ``extra_buffer`` radix strategy snapshots a request's SSM state
into a track slot every ``--mamba-track-interval`` tokens, inside the decode
CUDA graph, for the rows a mask selects (``track_mamba_states_all_layers``
copies conv and state). A ReplaySSM slot is more than its state: the
checkpoint, its fold copy, the input buffer rings and the cursors together
are the state, so a snapshot copies all of them. :func:`copy_slots` does it
for any list of pool tensors in one launch per tensor; rows whose mask is
off return at once, so the launch costs next to nothing on the steps
between snapshots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["copy_slots", "copy_slots_ref"]


def copy_slots_ref(tensors, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor) -> None:
    """PyTorch version of :func:`copy_slots` (for tests)."""
    rows = mask.bool().nonzero().flatten()
    s, d = src[rows].long(), dst[rows].long()
    for t in tensors:
        t[:, d] = t[:, s]


@triton.jit
def _copy_slots_kernel(t_ptr, src_ptr, dst_ptr, mask_ptr, batch, s_layer, s_slot,
                       NUMEL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    layer = (pid // batch).to(tl.int64)
    row = pid % batch
    if tl.load(mask_ptr + row) == 0:
        return
    src = tl.load(src_ptr + row).to(tl.int64)
    dst = tl.load(dst_ptr + row).to(tl.int64)
    base = t_ptr + layer * s_layer
    for start in tl.range(0, NUMEL, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < NUMEL
        tl.store(base + dst * s_slot + offs, tl.load(base + src * s_slot + offs, mask=m), mask=m)


def copy_slots(tensors, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor) -> None:
    """For each row r with ``mask[r]``: slot ``dst[r]`` of every tensor
    becomes a copy of slot ``src[r]``. No host sync (CUDA-graph safe).

    tensors: pool tensors [layers, S, ...] (a per-slot tensor without a
             layer dim as [1, S, ...]), any dtype, each slot's entries
             contiguous (stride 1 in the last dim, the slot dim's stride
             covering the rest)
    src, dst: [batch] int32/int64 slot ids, read only where the mask is on
    mask:    [batch] bool (or int), the rows to copy
    A row's src and dst must differ, and no dst may be another row's src."""
    batch = mask.shape[0]
    if src.shape != (batch,) or dst.shape != (batch,):
        raise ValueError(f"src and dst must be [batch={batch}], got {tuple(src.shape)} and "
                         f"{tuple(dst.shape)}")
    if batch == 0:
        return
    for t in tensors:
        numel = t[0, 0].numel()
        if t.dim() < 2 or not t[0, 0].is_contiguous() or t.stride(1) < numel:
            raise ValueError(f"copy_slots: a tensor must be [layers, S, ...] with each slot's "
                             f"entries contiguous, got {tuple(t.shape)} strides {t.stride()}")
        block = min(4096, max(16, triton.next_power_of_2(numel)))
        _copy_slots_kernel[(t.shape[0] * batch,)](
            t, src, dst, mask, batch, t.stride(0), t.stride(1), NUMEL=numel, BLOCK=block,
            num_warps=4)
