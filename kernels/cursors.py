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

A tree verify (drafts with parents, e.g. EAGLE with topk > 1) appends draft
j at window position j like a chain; the accepted drafts form a path
through the tree, not a prefix of the window. :func:`accept_path` first
moves the path's entries to window positions 0 .. accepted-1 (every ring,
every layer); then the commit above counts them as for a chain.

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
           "commit_ref", "flushes_ref", "accept_path", "accept_path_ref", "tree_path", "tree_path_ref"]


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


def tree_path_ref(parents: torch.Tensor, last: torch.Tensor):
    """PyTorch version of :func:`tree_path` (for tests)."""
    batch, T = parents.shape
    node = last.to(torch.int64).clamp(0, T - 1)
    ancestors = torch.empty((batch, T), dtype=torch.int64, device=parents.device)
    for i in range(T):  # the node, its parent, ... ; -1 once past the path's first draft
        ancestors[:, i] = node
        up = parents.gather(1, node.clamp(min=0)[:, None])[:, 0].to(torch.int64)
        up = torch.where(node == 0, -1, up)  # draft 0's entry is not read
        node = torch.where(node >= 0, up, node)
    accepted = (ancestors >= 0).sum(1)
    k = torch.arange(T, device=parents.device)
    path = ancestors.gather(1, (accepted[:, None] - 1 - k).clamp(min=0))
    path = torch.where(k[None, :] < accepted[:, None], path, torch.zeros_like(path))
    return path.to(torch.int32).contiguous(), accepted.to(torch.int32)


@triton.jit
def _tree_path_kernel(parents_ptr, last_ptr, path_ptr, accepted_ptr, s_parents, s_path,
                      T: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_T)
    # entry 0 (unset in SGLang's buffer) is never followed: the walk ends there
    parents = tl.load(parents_ptr + row * s_parents + offs, mask=offs < T, other=-1).to(tl.int32)
    node = tl.load(last_ptr + row).to(tl.int32)
    node = tl.minimum(tl.maximum(node, 0), T - 1)
    # from the last accepted draft up: parents come before their children,
    # so one pass over the window in decreasing order meets every ancestor
    on_path = tl.zeros([BLOCK_T], dtype=tl.int32)
    for i in tl.static_range(T):
        t = T - 1 - i
        hit = node == t
        on_path = tl.where((offs == t) & hit, 1, on_path)
        node = tl.where(hit, tl.sum(tl.where(offs == t, parents, 0), axis=0), node)
    # draft t's place on the path: the path's drafts before it
    before = tl.sum(tl.where(offs[None, :] < offs[:, None], on_path[None, :], 0), axis=1)
    take = (on_path[None, :] != 0) & (before[None, :] == offs[:, None])
    path = tl.sum(tl.where(take, offs[None, :], 0), axis=1)
    tl.store(path_ptr + row * s_path + offs, path, mask=offs < T)
    tl.store(accepted_ptr + row, tl.sum(on_path, axis=0))


def tree_path(parents: torch.Tensor, last: torch.Tensor):
    """The accepted path of a tree verify from its last accepted draft.

    parents: [batch, T] int32 or int64, contiguous in T: the verify's
             ``parents`` (-1 = follows the committed history; entry 0 is
             not read)
    last:    [batch] int, window index of each row's last accepted draft
             (SGLang's ``last_correct_step_indices``; clamped into [0, T))
    Returns ``(path, accepted)`` as :func:`accept_path` takes them: path
    [batch, T] int32 lists the window indices from the path's first draft
    down to ``last`` (entries past ``accepted`` are 0), accepted [batch]
    int32 is the path's length. One launch, no host sync (the commit after
    a verify runs it every step)."""
    if parents.dtype not in (torch.int32, torch.int64) or parents.dim() != 2 \
            or parents.stride(-1) != 1:
        raise ValueError(f"parents must be int32 or int64 [batch, T] contiguous in T, got "
                         f"{parents.dtype} {tuple(parents.shape)}")
    batch, T = parents.shape
    if last.shape != (batch,):
        raise ValueError(f"last must be [batch={batch}], got {tuple(last.shape)}")
    path = torch.empty((batch, T), dtype=torch.int32, device=parents.device)
    accepted = torch.empty((batch,), dtype=torch.int32, device=parents.device)
    if batch:
        _tree_path_kernel[(batch,)](parents, last, path, accepted, parents.stride(0),
                                    path.stride(0), T=T,
                                    BLOCK_T=triton.next_power_of_2(max(T, 2)), num_warps=1)
    return path, accepted


def accept_path_ref(ring, fill, origin, slots, path, accepted, capacity):
    """PyTorch version of :func:`accept_path` for one ring [S, heads, cap, ...]
    (for tests; updates in place)."""
    for r, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        f, o = int(fill[s]), int(origin[s])
        for k in range(int(accepted[r])):
            src = (o + f + int(path[r, k])) % capacity
            dst = (o + f + k) % capacity
            ring[s, :, dst] = ring[s, :, src]


@triton.jit
def _accept_path_kernel(ring_ptr, fill_ptr, origin_ptr, slot_ptr, path_ptr, accepted_ptr,
                        capacity, D, s_layer, s_slot, s_head, s_pos, s_path_row,
                        T: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: untouched
        return
    fill = tl.load(fill_ptr + slot)
    origin = tl.load(origin_ptr + slot)
    acc = tl.load(accepted_ptr + row)
    base = ring_ptr + layer * s_layer + slot * s_slot + head * s_head
    offs = tl.arange(0, BLOCK_D)
    # in path order: path[k] >= k, so an entry moves down onto a position
    # whose own entry has already moved (or is not on the path)
    for k in tl.static_range(T):
        # memory safety: an index outside the window is clamped into it
        p = tl.minimum(tl.maximum(tl.load(path_ptr + row * s_path_row + k), 0), T - 1)
        move = (k < acc) & (p != k)
        src = ring_index(origin, fill + p, capacity).to(tl.int64)
        dst = ring_index(origin, fill + k, capacity).to(tl.int64)
        m = (offs < D) & move
        v = tl.load(base + src * s_pos + offs, mask=m)
        tl.store(base + dst * s_pos + offs, v, mask=m)
        tl.debug_barrier()


def accept_path(rings, fill: torch.Tensor, origin: torch.Tensor, slots: torch.Tensor,
                path: torch.Tensor, accepted: torch.Tensor, *, capacity: int,
                stacked: bool = False, parents: torch.Tensor | None = None,
                validate: bool = False) -> None:
    """After a tree verify, before :func:`commit`: move the accepted drafts'
    ring entries to the first window positions, so the buffer holds the
    accepted path in order. Reads the cursors as the verify step saw them.

    rings:     ring tensors [S, heads, cap, ...] (one layer) or, with
               ``stacked``, [layers, S, heads, cap, ...] (a pool's, every
               layer at once); any dtype, the innermost dim contiguous
    fill, origin: [S] int32 cursors, not modified (``commit`` follows)
    slots:     [batch] int32/int64, -1 = padded row (untouched)
    path:      [batch, T] int32: path[r, k] = the window index of row r's
               k-th accepted draft (strictly increasing along the path);
               entries k >= accepted[r] are ignored
    accepted:  [batch] int32: drafts accepted on the path (the bonus token
               included), as ``commit`` takes them
    parents:   optional [batch, T] int32 of the verify; with ``validate``
               the path is checked to follow it from a draft whose parent is
               -1 (host sync)
    A chain needs no call (its path is 0, 1, ...).
    """
    if path.dtype != torch.int32 or path.dim() != 2 or path.shape[0] != slots.shape[0] \
            or path.stride(-1) != 1:
        raise ValueError(f"path must be int32 [batch={slots.shape[0]}, T] contiguous in T, got "
                         f"{path.dtype} {tuple(path.shape)}")
    if accepted.dtype != torch.int32 or accepted.shape != slots.shape:
        raise ValueError(f"accepted must be int32 [batch={slots.shape[0]}], got "
                         f"{accepted.dtype} {tuple(accepted.shape)}")
    batch, T = path.shape
    if validate and batch:
        live = slots >= 0
        k = torch.arange(T, device=path.device)
        taken = live[:, None] & (k[None, :] < accepted[:, None].long())
        ok = bool(((accepted >= 0) & (accepted <= T))[live].all())
        ok &= bool(((path >= 0) & (path < T))[taken].all())
        ok &= bool((path[:, 1:] > path[:, :-1])[taken[:, 1:]].all())
        if parents is not None:
            p = parents.long().gather(1, path.long().clamp(0, T - 1))  # parent of each path entry
            p[path == 0] = -1  # draft 0's entry is not read: it follows the history
            prev = torch.cat([torch.full_like(path[:, :1], -1), path[:, :-1]], 1).long()
            ok &= bool((p == prev)[taken].all())
        if not ok:
            raise ValueError("path must list, for k < accepted, strictly increasing window "
                             "indices in [0, T) that follow the verify's parents from a draft "
                             "whose parent is -1")
    if batch == 0:
        return
    for ring in rings:
        if ring.stride(-1) != 1:
            raise ValueError("rings must be contiguous in their last dim")
        r = ring if stacked else ring.unsqueeze(0)
        if r.dim() == 4:  # a scalar per entry (log decays, gates)
            r = r.unsqueeze(-1)
        if r.dim() != 5 or r.shape[3] != capacity:
            raise ValueError(f"ring must be [{'layers, ' if stacked else ''}S, heads, "
                             f"capacity={capacity}, ...], got {tuple(ring.shape)}")
        layers, _, heads, _, D = r.shape
        if D > 4096:
            raise ValueError(f"ring entries of {D} elements a head: at most 4096")
        _accept_path_kernel[(batch, heads, layers)](
            r, fill, origin, slots, path, accepted, capacity, D,
            r.stride(0), r.stride(1), r.stride(2), r.stride(3), path.stride(0),
            T=T, BLOCK_D=triton.next_power_of_2(max(D, 16)), num_warps=1)
