"""The cursor protocol shared by every ReplaySSM kernel family.

Per request slot the pool keeps two int32 device cursors, common to all SSM
layers of the model (every layer advances in lockstep):

* ``fill[slot]``   -- number of buffered tokens since the checkpoint;
* ``origin[slot]`` -- ring index of the first of them in the input buffer.

Logical buffer entry ``s`` (0 <= s < fill) lives at ring index
``(origin + s) % capacity``. A step appends a window of ``T`` tokens at
logical positions ``fill .. fill+T-1``. A row flushes when the step would
fill the buffer, ``fill + T >= buffer_len``: a pure function evaluated
identically by the kernels and by :func:`commit`, so no flag has to travel
between them. What is folded depends on the mode:

* ``MODE_DECODE`` (T = 1, the token is always accepted): the fold happens at
  the end of the step and includes the current token; the buffer becomes
  empty (``fill = origin = 0``). One flush every ``buffer_len`` steps.
* ``MODE_VERIFY`` (T draft tokens, acceptance unknown): the fold covers only
  the committed history (the kernels fold it after computing the window's
  outputs from the checkpoint as read); the window stays in the ring right
  after it, so commit moves ``origin`` past the
  folded entries and sets ``fill = accepted``. Otherwise ``fill +=
  accepted``; rejected drafts are simply not counted (rollback = no move).
* ``MODE_FLUSH`` (T = 0): fold everything buffered, ``fill = origin = 0``.

Invariant after every commit: ``fill <= buffer_len - 1`` (needs
``T < buffer_len``). A step touches logical positions ``< fill + T <=
buffer_len - 1 + T``, so a ring of ``capacity >= buffer_len - 1 + T`` never
overflows, and the window of a verify flush never overwrites an entry the
fold still reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MODE_DECODE = 0
MODE_VERIFY = 1
MODE_FLUSH = 2

__all__ = ["MODE_DECODE", "MODE_VERIFY", "MODE_FLUSH", "max_positions", "required_capacity", "commit",
           "commit_ref", "flushes_ref"]


def max_positions(buffer_len: int, window: int) -> int:
    """Most logical positions one step touches: history + window."""
    return buffer_len - 1 + max(window, 1)


def required_capacity(buffer_len: int, window: int) -> int:
    """Ring entries a slot needs for ``buffer_len`` and the largest window
    (draft tokens per verify step; 1 for decode only). Decode never writes
    the token that fills the buffer (it is folded), hence the ``- 1``."""
    if buffer_len < 1:
        raise ValueError(f"buffer_len must be >= 1, got {buffer_len}")
    if window >= buffer_len and window > 1:
        raise ValueError(f"buffer_len ({buffer_len}) must exceed the speculative window "
                         f"({window} tokens per verify step)")
    return max_positions(buffer_len, window)


def flushes_ref(fill: torch.Tensor, window: int, buffer_len: int, mode: int) -> torch.Tensor:
    """Which rows flush this step (the rule the kernels apply)."""
    if mode == MODE_FLUSH:
        return fill > 0
    return fill + window >= buffer_len


def commit_ref(fill, origin, slots, accepted, window, buffer_len, capacity, mode):
    """PyTorch version of :func:`commit` (for tests; updates in place)."""
    if mode == MODE_DECODE:
        window = 1
    live = slots >= 0
    s = slots[live].long()
    f = fill[s].clone()
    o = origin[s].clone()
    flushed = flushes_ref(f, window, buffer_len, mode)
    if mode == MODE_DECODE:
        a = torch.ones_like(f)
    elif mode == MODE_VERIFY:
        a = accepted[live].to(f.dtype).clamp(0, window)
    else:
        a = torch.zeros_like(f)
    if mode == MODE_VERIFY:
        new_f = torch.where(flushed, a, f + a)
        new_o = torch.where(flushed, (o + f) % capacity, o)
    elif mode == MODE_DECODE:
        new_f = torch.where(flushed, torch.zeros_like(f), f + a)
        new_o = torch.where(flushed, torch.zeros_like(o), o)
    else:  # flush: every live row ends empty, rows that were already empty too
        new_f = torch.zeros_like(f)
        new_o = torch.zeros_like(o)
    fill[s] = new_f
    origin[s] = new_o


@triton.jit
def ring_index(origin, pos, capacity):
    """The ring entry of logical position ``pos`` (0 <= pos < capacity, scalar
    or vector): (origin + pos) % capacity, without the division."""
    ring = origin + pos
    return tl.where(ring >= capacity, ring - capacity, ring)


@triton.jit
def _commit_kernel(fill_ptr, origin_ptr, slot_ptr, accepted_ptr, batch, buffer_len, capacity,
                   WINDOW: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + rows, mask=rows < batch, other=-1).to(tl.int64)
    live = slot >= 0
    f = tl.load(fill_ptr + slot, mask=live, other=0)
    o = tl.load(origin_ptr + slot, mask=live, other=0)
    if MODE == 0:  # decode: one token, always accepted; a full buffer was folded
        flushed = f + 1 >= buffer_len
        new_f = tl.where(flushed, 0, f + 1)
        new_o = tl.where(flushed, 0, o)
    elif MODE == 1:  # verify: the window's accepted prefix stays in the ring
        a = tl.load(accepted_ptr + rows, mask=live, other=0).to(tl.int32)
        # memory safety: a count outside [0, T] would point past the window
        a = tl.minimum(tl.maximum(a, 0), WINDOW)
        flushed = f + WINDOW >= buffer_len
        o_next = ring_index(o, f, capacity)
        new_f = tl.where(flushed, a, f + a)
        new_o = tl.where(flushed, o_next, o)
    else:  # flush: everything folded
        new_f = tl.zeros_like(f)
        new_o = tl.zeros_like(o)
    tl.store(fill_ptr + slot, new_f, mask=live)
    tl.store(origin_ptr + slot, new_o, mask=live)


def commit(fill: torch.Tensor, origin: torch.Tensor, slots: torch.Tensor, *, mode: int,
           buffer_len: int, capacity: int, window: int = 1,
           accepted: torch.Tensor | None = None, validate: bool = False) -> None:
    """Advance the cursors of ``slots`` once, after every layer ran the step.

    fill, origin: [num_slots] int32 (pool-wide, indexed by slot)
    slots:        [batch] int32/int64, -1 = padded row (untouched)
    accepted:     [batch] int, MODE_VERIFY only: tokens accepted in the window
                  (1..T, the bonus token included)
    Must run exactly once per step per model (not per layer), after the step
    kernels of all layers and before the next step's kernels.
    """
    if fill.dtype != torch.int32 or origin.dtype != torch.int32:
        raise TypeError(f"cursors must be int32, got fill {fill.dtype}, origin {origin.dtype}")
    if mode == MODE_VERIFY:
        if accepted is None or accepted.shape != slots.shape:
            raise ValueError("commit(mode=VERIFY) needs `accepted` with the shape of `slots`")
        if validate:
            live = slots >= 0
            bad = live & ((accepted < 0) | (accepted > window))
            if bool(bad.any()):
                raise ValueError(f"accepted counts must lie in [0, window={window}]; got "
                                 f"{accepted[bad].tolist()[:8]}")
    batch = slots.shape[0]
    if batch == 0:
        return
    BLOCK = 256
    _commit_kernel[(triton.cdiv(batch, BLOCK),)](
        fill, origin, slots, accepted if accepted is not None else slots, batch, buffer_len,
        capacity, WINDOW=window, MODE=mode, BLOCK=BLOCK, num_warps=4)
