"""What the ReplaySSM kernel families share: dtypes, launch configs, the ring
position helper and the launchers' input checks."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# ring_index is re-exported: the kernels take their jit helpers from here
from .cursors import max_positions, required_capacity, ring_index  # noqa: F401

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LaunchConfig:
    """Rows of the per-program state tile (Mamba-2: headdim rows; GDN: V rows;
    each program spans all of dstate / K) and warps per program.
    ``storage_order`` (the fused kernels): read the ring in storage order
    (see :func:`ring_positions`), which takes one dependent memory round trip
    off a latency-bound step at the price of reading the whole ring."""

    block: int
    num_warps: int
    storage_order: bool = False


@dataclass
class SplitConfig(LaunchConfig):
    """Launch knobs of a split decode route's three kernels (Mamba-2 and GDN;
    "head" = Mamba-2 head / GDN v-head, "group" = Mamba-2 B/C group / GDN
    k-head, "rows" = Mamba-2 headdim P / GDN V). ``block``/``num_warps``
    (inherited) are the projection's (A): state rows per program and warps.

    out_heads     (B) heads per program, consecutive in one group (divides the
                  heads per group): 1 = grid (batch, heads); heads per group =
                  grid (batch, groups), the key products (Mamba-2 B_s . C, GDN
                  k_s . k_t and k_s . q_t) computed once per group. Unused
                  with outputs_in_projection ((W) takes a whole group)
    out_warps     (B) warps per program, or (W)'s with outputs_in_projection
    fold_block    (C) state rows per work item (power of 2); 0 = whole head
    fold_warps    (C) warps per program. Default 32 rows / 4 warps: on the
                  H200 (b=256, L=16, benchmarks/NOTES.md) its flush step took
                  930 us (Mamba-2 fp32) / 571 us (GDN fp32) vs 1487 / 726 for
                  whole-head (Mamba-2) or 64-row (GDN) items at 8 warps: the
                  fold is latency bound, and smaller items at 168 registers
                  (sm_90, scripts/kernel_regs.py) keep more of them in flight
    fold_programs (C) persistent grid size; 0 = fold_per_sm per SM (GPU) / 2
                  (interpreter)
    fold_per_sm   (C) programs per SM when fold_programs is 0: 168 registers
                  x 4 warps leave room for 3 resident per SM
    fold_rows     (C) batch rows scanned per chunk (power of 2); 0 = the whole
                  batch rounded up to a power of 2, at most 1024
    fold_dot      (C) True: tl.dot fold ([rows, S] x [S, K], tf32x3 on GPU,
                  ieee in the interpreter, as the fused kernels); False: FMA
                  outer products, one ring entry at a time
    project_fold  Mamba-2 only. True: (A) folds the flushing rows' tiles
                  itself (the tile it just read, this token from the inputs)
                  and there is no (C) launch, so the fold_* knobs above do not
                  apply; False: (A) is the plain projection and (C) folds
    fold_cols     project_fold: dstate / K columns folded at a time,
                  re-read from L2 (power of 2, >= 16), so that the fold does
                  not size (A)'s registers; 0 = all of them in one chunk.
                  Also (C)'s GDN fold with a fold copy (u recomputed): K
                  columns per chunk of its two passes over the tile
    fold_bf16     project_fold only: where the key ring (Mamba-2: B, also
                  this token's B; GDN: k) is bf16, (A)'s fold dot runs as
                  bf16 MMAs on the weighted values split into 3 (fp32 state)
                  or 2 (bf16 / fp16) bf16 parts (fold.weighted_dot), instead
                  of tf32x3: a third to a half of its tensor-core work, exact
                  to the state's precision; other key dtypes keep tf32x3
    overlap       project_fold only, SM90+ (ignored below it and by the
                  interpreter): (B)
                  is launched with programmatic dependent launch while (A)
                  runs (every (A) program lets it launch when it starts), so
                  (B)'s latency chain (slot -> cursors -> ring loads) overlaps
                  (A)'s tail; (B) waits for (A)'s completion (griddepcontrol
                  .wait) before it reads the projections. On in both
                  families' default configs (measured, see their docstrings).
                  With outputs_in_projection the order is reversed: (A)
                  starts while the ring weights (W) run and waits for them
                  only before it reads them.
    outputs_in_projection
                  project_fold only: no outputs kernel (B). A small ring
                  weights kernel (W), one program per (row, group), runs
                  first: from the cursors, the key ring and this token's
                  gates it computes every history entry's scalar weight per
                  head (Mamba-2: exp(cum_q - cum_s) dt_s B_s . C_q; GDN: the
                  same decays times k_s . k_t and k_s . q_t) and the token's
                  coefficients, fp32 scratch [b, heads, width], and appends
                  the per-group / per-head ring entries (Mamba-2 B and dt,
                  GDN k and g). (A) then finishes each output from its
                  tile's projection, those weights and its slice of the
                  value ring (Mamba-2 x, GDN u), and appends that slice.
                  (B)'s per-head programs were latency bound (a third of a
                  bf16 step); (W) has a program per group and no value ring.
    """

    out_heads: int = 1
    out_warps: int = 2
    fold_block: int = 32
    fold_warps: int = 4
    fold_programs: int = 0
    fold_per_sm: int = 2
    fold_rows: int = 0
    fold_dot: bool = True
    project_fold: bool = False
    fold_cols: int = 0
    fold_bf16: bool = True
    overlap: bool = False
    outputs_in_projection: bool = False


def split_config(cfg: LaunchConfig, heads_per_group: int) -> SplitConfig:
    """The split route's config, checked before any launch: a plain
    LaunchConfig sets the projection (A) only, the other knobs default."""
    if not isinstance(cfg, SplitConfig):
        cfg = SplitConfig(block=cfg.block, num_warps=cfg.num_warps)
    check(cfg.out_heads >= 1 and heads_per_group % cfg.out_heads == 0,
          f"SplitConfig.out_heads={cfg.out_heads} must divide the heads per group "
          f"({heads_per_group})")
    check(cfg.fold_block & (cfg.fold_block - 1) == 0 and cfg.fold_rows & (cfg.fold_rows - 1) == 0,
          "SplitConfig.fold_block / fold_rows must be powers of 2")
    check(cfg.fold_cols == 0 or (cfg.fold_cols >= 16 and cfg.fold_cols & (cfg.fold_cols - 1) == 0),
          f"SplitConfig.fold_cols must be 0 or a power of 2 >= 16, got {cfg.fold_cols}")
    check(not cfg.overlap or cfg.project_fold,
          "SplitConfig.overlap needs project_fold (a (C) launch would follow (B))")
    check(not cfg.outputs_in_projection or cfg.project_fold,
          "SplitConfig.outputs_in_projection needs project_fold (the outputs and the fold "
          "share (A)'s checkpoint tile)")
    return cfg


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision() -> str:
    # fp32 tl.dot at plain tf32 drifts ~1e-2 from the recurrence; tf32x3 keeps
    # fp32 parity. The interpreter computes dots in numpy: ask for ieee there.
    return "ieee" if interpreting() else "tf32x3"


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    # queried once per device, not on every launch (launches are graph-captured
    # in the server, but the eager benchmark and test paths call this each step)
    return torch.cuda.get_device_capability(device_index)[0]


def overlap_launch(cfg: SplitConfig, device: torch.device) -> bool:
    """Whether this split launch overlaps (B) with (A) (SplitConfig.overlap):
    on a GPU of compute capability 9.0 or later (programmatic dependent
    launch; on older GPUs the launches simply run in turn, as the default
    config asks for it everywhere); never in the interpreter, which runs
    launches one after the other and has no griddepcontrol."""
    if not cfg.overlap or interpreting():
        return False
    return _capability_major(device.index if device.index is not None
                             else torch.cuda.current_device()) >= 9


@triton.jit
def let_dependents_launch(OVERLAP: tl.constexpr):
    """(A): the next launch, (B), may start once every program got here."""
    if OVERLAP:
        gdc_launch_dependents()


@triton.jit
def wait_for_prior_launch(OVERLAP: tl.constexpr):
    """(B): from here on, everything (A) wrote is complete and visible."""
    if OVERLAP:
        gdc_wait()


@triton.jit
def softplus(x):
    # F.softplus with its default threshold of 20, as SGLang's kernels use
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


def ring_block(buffer_len: int, window: int, capacity: int, storage_order: bool = False) -> int:
    """BLOCK_S of a launch: the logical positions one step touches (history +
    window), or in storage order the whole ring (:func:`ring_positions`),
    which a pool built for longer windows makes larger."""
    n = max_positions(buffer_len, max(window, 1))
    if storage_order:
        n = max(n, capacity)
    return max(16, triton.next_power_of_2(n))


@triton.jit
def ring_positions(offs_s, fill, origin, capacity, T: tl.constexpr, STORAGE_ORDER: tl.constexpr):
    """The ring entries a step sees, ``offs_s`` = 0 .. BLOCK_S-1, in one of two orders.

    * logical (STORAGE_ORDER False): entry s is logical position s, stored at
      ring index (origin + s) % capacity; the ring loads wait for ``origin``.
    * storage (True): entry s is ring index s, at logical position
      (s - origin) % capacity (entries s >= capacity get a position past any
      window). The ring loads then depend on the slot only and go out with
      the checkpoint read, one dependent round trip to memory less, which is
      what a latency-bound (small batch) step pays for; the whole ring is read
      (BLOCK_S must cover the capacity) and ``ring_ok`` selects it.

    Returns (pos, is_hist, is_win, win, ring, ring_ok): logical position,
    history mask (pos < fill), window mask (pos in [fill, fill+T)), window
    index (0 outside it), ring index, and the entries to load from the ring
    (the history in logical order, the whole ring in storage order, whose
    loads the caller masks with is_hist after loading)."""
    if STORAGE_ORDER:
        ring = offs_s
        ring_ok = offs_s < capacity
        pos = offs_s - origin
        pos = tl.where(pos < 0, pos + capacity, pos)
        pos = tl.where(ring_ok, pos, 2 * capacity + T)
    else:
        pos = offs_s
        ring = ring_index(origin, offs_s, capacity)
    is_hist = pos < fill
    win = pos - fill
    is_win = (win >= 0) & (win < T)
    win = tl.where(is_win, win, 0)
    if not STORAGE_ORDER:
        ring_ok = is_hist
    return pos, is_hist, is_win, win, ring, ring_ok


@triton.jit
def split_step_cursors(slot_ptr, fill_ptr, origin_ptr, row, offs_s, capacity):
    """A split route's outputs kernel (B), both families: the row's slot and
    cursors for one decode token, and the ring entry it appends at. A padded
    row (slot < 0) is masked, not branched on (an early return would hold
    every later load behind the slot id): its loads read slot 0's cursors as
    zeros and the caller masks its stores with ``live``.

    Returns (slot, live, is_hist, is_win, ring, ring_q): the slot (0 for a
    padded row), whether the row is live, the history and this-token masks
    over ``offs_s`` in logical order, the history's ring indices, and where
    this token goes (always inside the ring: capacity >= buffer_len)."""
    slot = tl.load(slot_ptr + row).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    fill = tl.load(fill_ptr + slot, mask=live, other=0)
    origin = tl.load(origin_ptr + slot, mask=live, other=0)
    # positions [0, fill) = history in the ring, fill = this token
    _, is_hist, is_win, _, ring, _ = ring_positions(offs_s, fill, origin, capacity, 1, False)
    return slot, live, is_hist, is_win, ring, ring_index(origin, fill, capacity)


@triton.jit
def ring_cumsum(x, pos, STORAGE_ORDER: tl.constexpr):
    """Inclusive prefix sum of x [S] in logical order: x at positions
    ``pos`` (from :func:`ring_positions`) summed over positions <= pos. In
    storage order an [S, S] masked sum (S = BLOCK_S, the ring), else tl.cumsum."""
    if STORAGE_ORDER:
        return tl.sum(tl.where(pos[None, :] <= pos[:, None], x[None, :], 0.0), axis=1)
    else:
        return tl.cumsum(x, axis=0)


@triton.jit
def tree_paths(x, cum, pos, fill, parent_ptr, T: tl.constexpr):
    """Tree verify (both families): the window's T drafts form a tree,
    ``parent_ptr[j]`` = the window index of draft j's parent (< j), or -1
    for a draft that follows the committed history (entry 0 is not read:
    draft 0 can only follow the history). A chain's
    :func:`ring_cumsum` sums ``x`` (the per-token log decays) over every
    earlier draft; a tree draft's prefix holds only its ancestors. Returns
    (cum, path): ``cum`` with each window position's value replaced by the
    history's total plus ``x`` over the draft's ancestors and itself, and
    ``path`` [S] int64, at each window position the bitmask of window indices
    on its draft's path (itself included), 0 elsewhere. Parents come before
    children, so one pass in window order sees each parent done."""
    cum_hist = tl.sum(tl.where(pos == fill - 1, cum, 0.0), axis=0)  # 0 for an empty history
    path = tl.zeros_like(pos).to(tl.int64)
    for j in tl.static_range(T):
        if j == 0:  # its only valid parent; SGLang leaves the entry unset
            p = tl.full([], -1, tl.int32)
        else:
            p = tl.load(parent_ptr + j).to(tl.int32)
        at_parent = (pos == fill + p) & (p >= 0)
        base = tl.where(p >= 0, tl.sum(tl.where(at_parent, cum, 0.0), axis=0), cum_hist)
        ancestors = tl.sum(tl.where(at_parent, path, 0), axis=0)
        at = pos == fill + j
        cum = tl.where(at, base + tl.sum(tl.where(at, x, 0.0), axis=0), cum)
        path = tl.where(at, ancestors | (tl.full([], 1, tl.int64) << j), path)
    return cum, path


@triton.jit
def on_path(path, pos, q, is_hist, is_win, win):
    """The positions draft ``q`` (a logical position in the window) sees in a
    tree verify: the history and the drafts on its path (itself included);
    ``path`` from :func:`tree_paths`, the rest from :func:`ring_positions`."""
    bits = tl.sum(tl.where(pos == q, path, 0), axis=0)
    return is_hist | (is_win & (((bits >> win.to(tl.int64)) & 1) != 0))


def check_parents(parents, batch: int, T: int, validate: bool):
    """A tree verify's ``parents`` [batch, T]: int32 or int64 (SGLang's
    ``retrieve_parent_token`` as it is), contiguous in T; with ``validate``
    every entry j > 0 in [-1, j) (parents before children; entry 0 is not
    read: draft 0 can only follow the committed history)."""
    check(parents.dtype in (torch.int32, torch.int64) and tuple(parents.shape) == (batch, T)
          and parents.stride(-1) == 1,
          f"parents must be int32 or int64 [batch={batch}, T={T}] contiguous in T, got "
          f"{parents.dtype} {tuple(parents.shape)}")
    check(T <= 63, f"tree verify takes at most 63 draft tokens per row (a path is an int64 "
                   f"bitmask), got T={T}")
    if validate and batch:
        j = torch.arange(T, device=parents.device)
        bad = ((parents < -1) | (parents >= j))[:, 1:]
        check(not bool(bad.any()), "parents[:, j] must lie in [-1, j) for j > 0 (each "
                                   "draft's parent comes before it in the window; -1 = the "
                                   "committed history)")


def check(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


def check_pool(checkpoint, buffers: dict, num_slots: int, capacity: int, fill, origin,
               slot_ids, buffer_len: int, window: int, verify: bool):
    """Checks common to every launcher: checkpoint dtype/layout, ring buffers
    contiguous in their last dim, int32 cursors, slot ids, buffer length vs
    the window and the ring capacity."""
    check(checkpoint.dtype in STATE_DTYPES,
          f"checkpoint dtype {checkpoint.dtype} not supported (use one of {STATE_DTYPES})")
    check(checkpoint.stride(-1) == 1, "checkpoint must be contiguous in its last dim")
    for name, t in buffers.items():
        check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
        check(t.shape[0] == num_slots and t.shape[2] == capacity,
              f"{name} must be [num_slots={num_slots}, heads, capacity={capacity}, ...], got "
              f"{tuple(t.shape)}")
    check(fill.dtype == torch.int32 and origin.dtype == torch.int32,
          f"cursors fill/origin must be int32, got {fill.dtype}/{origin.dtype}")
    check(fill.shape == (num_slots,) and origin.shape == (num_slots,),
          f"cursors must be [num_slots={num_slots}]")
    check(slot_ids.dim() == 1 and slot_ids.dtype in (torch.int32, torch.int64),
          f"slot_ids must be a 1-D int32/int64 tensor, got {slot_ids.dtype} "
          f"{tuple(slot_ids.shape)}")
    check(buffer_len >= 1, f"buffer_len must be >= 1, got {buffer_len}")
    if verify:
        check(window < buffer_len, f"buffer_len ({buffer_len}) must exceed the speculative "
                                   f"window (T={window} draft tokens): raise "
                                   f"--replayssm-buffer-len")
    need = required_capacity(buffer_len, max(window, 1))
    check(capacity >= need, f"input buffer capacity {capacity} is too short for buffer_len "
                            f"{buffer_len} and a window of {max(window, 1)} (needs >= {need} "
                            f"entries)")


def check_fold_copy(checkpoint, checkpoint_fold, dtypes):
    """A fold copy (dual precision) is read and written with the checkpoint's
    slot and head offsets: same shape and strides, a precise dtype."""
    check(checkpoint_fold.shape == checkpoint.shape and
          checkpoint_fold.stride() == checkpoint.stride(),
          f"checkpoint_fold must have the checkpoint's shape {tuple(checkpoint.shape)} and "
          f"strides {checkpoint.stride()}, got {tuple(checkpoint_fold.shape)} "
          f"{checkpoint_fold.stride()}")
    check(checkpoint_fold.dtype in dtypes,
          f"checkpoint_fold dtype {checkpoint_fold.dtype} not supported (one of {dtypes})")


def check_finite(**tensors):
    for name, t in tensors.items():
        if t is not None and not bool(torch.isfinite(t).all()):
            raise ValueError(f"`{name}` contains NaN or inf")


def check_live_cursors(fill, slot_ids, num_slots: int, buffer_len: int):
    """Validation mode: slots in range and cursors inside [0, buffer_len)."""
    live = slot_ids >= 0
    check(bool((slot_ids[live] < num_slots).all()), "slot_ids out of range")
    f = fill[slot_ids[live].long()]
    check(bool(((f >= 0) & (f < buffer_len)).all()),
          f"cursor fill out of range [0, {buffer_len}): {f.tolist()[:8]}")
