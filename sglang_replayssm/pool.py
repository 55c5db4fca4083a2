"""ReplayMambaPool: SGLang's MambaPool plus the ReplaySSM input buffers and cursors.

To be installed (later, by the plugin) as ``HybridReqToTokenPool.mamba_pool_cls``
(sglang 0.5.17 ``srt/mem_cache/memory_pool.py:1139``); ``_init_mamba_pool``
instantiates it with exactly the keyword arguments of ``MambaPool.__init__``,
so the ReplaySSM knobs come from :meth:`ReplayConfig.from_env` (the launcher
exports them; scheduler processes are spawned and inherit the environment).

Tests and hooks that want a fixed configuration use :meth:`ReplayMambaPool.with_config`,
which returns a *subclass* with the config (and optionally the family) bound
as class attributes -- a class, because SGLang instantiates ``mamba_pool_cls``
itself with its fixed kwargs::

    HybridReqToTokenPool.mamba_pool_cls = ReplayMambaPool.with_config(cfg, family="gdn")

Layout (``L_m`` mamba layers on this rank, ``S`` slots, ``+1`` = SGLang's
padding slot 0, ``cap = required_capacity(buffer_len, window)``; window = 1,
or the draft tokens per verify step when speculative decoding is on):

* ``State.temporal`` [L_m, S+1, *temporal] is the checkpoint the kernels read;
  its dtype is ``checkpoint_dtype`` ('auto' = what MambaPool would use, i.e.
  ``cache_params.dtype.temporal`` = --mamba-ssm-dtype / config / fp32).
* Mamba-2 (temporal = (H, P, N)):
  ``x_buffer`` [L_m, S+1, H, cap, P] and ``B_buffer`` [L_m, S+1, G, cap, N]
  in the activation dtype (bf16), ``dt_buffer`` [L_m, S+1, H, cap] fp32, and,
  with ``fold_dtype``, ``checkpoint_fold`` [L_m, S+1, H, P, N] (the precise
  copy the flush folds into; same strides as ``temporal``).
* GDN (temporal = (HV, V, K), SGLang's transposed state):
  ``k_buffer`` [L_m, S+1, Hk, cap, K], ``u_buffer`` [L_m, S+1, HV, cap, V] --
  fp32 when the checkpoint is fp32 (keeps fp32 parity), bf16 otherwise, k the
  same as u (as ``scripts/bench_kernels.py`` GDN ``replay_pool``) -- and
  ``g_buffer`` [L_m, S+1, HV, cap] fp32. With ``fold_dtype``: ``checkpoint_fold``
  as for Mamba-2 plus the raw-input rings the fold recomputes u from,
  ``v_buffer`` [L_m, S+1, HV, cap, V] bf16 and ``beta_buffer`` [L_m, S+1, HV,
  cap] fp32; k is then fp32 (the fold needs the normalised keys unrounded),
  u stays bf16 (only the outputs read it).
* Pool-wide cursors ``fill`` and ``origin`` [S+1] int32 (attributes of the pool,
  shared by every layer; see ``kernels/cursors.py``).
* With speculative decoding (``speculative_num_draft_tokens`` = D): a
  ``SpeculativeState`` whose ``intermediate_conv_window`` holds the conv
  windows after each draft, per batch row ([L_m, R+1, D, *conv], R =
  ``spec_state_size``; the conv's rollback reads them), and whose
  ``intermediate_ssm`` is None: the verify kernels write no per-draft state.

The extra fields live on a ``State`` dataclass subclass, so ``at_layer_idx``
(``mamba2_layer_cache(layer)``) slices them per layer like ``conv``/``temporal``,
and ``mem_usage_bytes`` counts them; they are listed in
``_NON_TRANSFER_STATE_FIELDS`` so PD transfer (``_iter_transfer_state_tensors``)
leaves them out.

Family detection (verified in sglang 0.5.17 ``srt/configs``): both families
build ``cache_params.shape`` with ``Mamba2StateShape.create`` (NemotronH
``nemotron_h.py:427``, FalconH1, Granite; Qwen3-Next/Qwen3.5 ``qwen3_next.py:300``,
JetNemotron ``jet_nemotron.py:68``), and ``num_k_heads_per_tp`` is a field of
*every* ``Mamba2StateShape`` (default 1, set from ``n_groups`` by ``create``,
``mamba_utils.py:188-236``) -- so its presence does NOT tell GDN from Mamba-2.
The two layouts are structurally identical (conv_dim = intermediate + 2 *
groups * state_size, temporal = (heads, head_dim, state_size)). The only
marker in cache_params is ``conv_shard_groups`` ([key_dim, key_dim, value_dim]),
which Qwen3-Next/Qwen3.5 pass and Mamba-2 configs do not -- but JetNemotron
(GDN) does not pass it either. Hence: ``family`` given explicitly (``with_config``
or env ``SGLANG_REPLAYSSM_FAMILY`` = mamba2|gdn) wins; otherwise
``conv_shard_groups is not None`` -> GDN, else Mamba-2. The plugin, which knows
the architecture (``hybrid_gdn_config`` vs ``mamba2_config``), should pass it.
Per TP rank the group / key-head count is ``(conv[0][0] - heads * head_dim) /
(2 * state_size)`` (conv[0][0] = conv_dim / tp); for GDN this equals
``num_k_heads_per_tp`` when Hk divides by tp. KDA (``KimiLinearStateShape``) is
not supported.

Not supported (raise): SGLang's own ReplaySSM flags (keep them off),
``fold_dtype`` with the envelope layout.
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from sglang.srt.configs.mamba_utils import Mamba2StateDType, Mamba2StateShape
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import (MambaPool, conv_window_dedup_enabled,
                                              get_tensor_size_bytes)
from sglang.srt.platforms import current_platform

from sglang_replayssm.config import FAMILY_ENV, ReplayConfig
from sglang_replayssm.kernels.cursors import required_capacity

__all__ = ["ReplayMambaPool", "FAMILIES", "detect_family", "replay_dims"]

FAMILIES = ("mamba2", "gdn")
GB = 1024**3

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Activation dtype of the Mamba-2 x/B buffers (the dtype the mixer produces them in).
ACT_DTYPE = torch.bfloat16

MAMBA2_FIELDS = ("x_buffer", "B_buffer", "dt_buffer", "checkpoint_fold")
GDN_FIELDS = ("k_buffer", "u_buffer", "g_buffer", "v_buffer", "beta_buffer")
REPLAY_FIELDS = MAMBA2_FIELDS + GDN_FIELDS


def detect_family(cache_params, family: Optional[str] = None) -> str:
    """'mamba2' or 'gdn' (see the module docstring for why this is heuristic)."""
    family = family or os.environ.get(FAMILY_ENV) or None
    shape = cache_params.shape
    if not isinstance(shape, Mamba2StateShape):
        raise NotImplementedError(
            f"ReplayMambaPool supports Mamba2StateShape (Mamba-2, GDN), got {type(shape).__name__}")
    if family is None:
        family = "gdn" if getattr(shape, "conv_shard_groups", None) is not None else "mamba2"
    if family not in FAMILIES:
        raise ValueError(f"ReplaySSM family must be one of {FAMILIES}, got {family!r}")
    return family


def replay_dims(cache_params) -> Tuple[int, int, int, int]:
    """(heads, head_dim, state_size, groups) per TP rank: Mamba-2 (H, P, N, G),
    GDN (HV, V, K, Hk)."""
    shape = cache_params.shape
    heads, head_dim, state_size = shape.temporal
    conv_dim_tp = shape.conv[0][0]
    rest = conv_dim_tp - heads * head_dim
    if rest <= 0 or rest % (2 * state_size) != 0:
        raise ValueError(
            f"cannot derive the group count: conv dim {conv_dim_tp} - heads*head_dim "
            f"{heads * head_dim} is not a positive multiple of 2*state_size={2 * state_size}")
    groups = rest // (2 * state_size)
    if heads % groups != 0:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups})")
    return heads, head_dim, state_size, groups


def _buffer_specs(family: str, cache_params, config: ReplayConfig, cap: int,
                  checkpoint_dtype: torch.dtype) -> Dict[str, Tuple[tuple, torch.dtype]]:
    """Per-slot, per-layer shape and dtype of every replay field."""
    heads, head_dim, state_size, groups = replay_dims(cache_params)
    if config.fold_dtype is not None and checkpoint_dtype == torch.float32:
        raise ValueError(
            "--replayssm-fold-dtype float32 needs a lower-precision --replayssm-checkpoint-dtype "
            f"(the checkpoint resolves to float32 from {config.checkpoint_dtype!r}: the two "
            "copies would be identical)")
    if family == "mamba2":
        specs = {
            "x_buffer": ((heads, cap, head_dim), ACT_DTYPE),
            "B_buffer": ((groups, cap, state_size), ACT_DTYPE),
            "dt_buffer": ((heads, cap), torch.float32),
        }
        if config.fold_dtype is not None:
            specs["checkpoint_fold"] = ((heads, head_dim, state_size), _DTYPES[config.fold_dtype])
        return specs
    ku = torch.float32 if checkpoint_dtype == torch.float32 else torch.bfloat16
    fold = config.fold_dtype is not None
    specs = {
        "k_buffer": ((groups, cap, state_size), torch.float32 if fold else ku),
        "u_buffer": ((heads, cap, head_dim), ku),
        "g_buffer": ((heads, cap), torch.float32),
    }
    if fold:
        specs["checkpoint_fold"] = ((heads, head_dim, state_size), _DTYPES[config.fold_dtype])
        specs["v_buffer"] = ((heads, cap, head_dim), ACT_DTYPE)
        specs["beta_buffer"] = ((heads, cap), torch.float32)
    return specs


def _checkpoint_dtype(config: ReplayConfig, cache_params) -> torch.dtype:
    if config.checkpoint_dtype == "auto":
        return cache_params.dtype.temporal
    return _DTYPES[config.checkpoint_dtype]


class ReplayMambaPool(MambaPool):
    """MambaPool with ReplaySSM input buffers, fold copy and cursors (see module doc)."""

    # Bound by with_config(); None = ReplayConfig.from_env() / detect_family().
    replay_config: Optional[ReplayConfig] = None
    replay_family: Optional[str] = None
    _scan_on_fold_copy = False  # see fold_copy_as_state

    @dataclass(frozen=True, kw_only=True)
    class State(MambaPool.State):
        x_buffer: Optional[torch.Tensor] = None
        B_buffer: Optional[torch.Tensor] = None
        dt_buffer: Optional[torch.Tensor] = None
        checkpoint_fold: Optional[torch.Tensor] = None
        k_buffer: Optional[torch.Tensor] = None
        u_buffer: Optional[torch.Tensor] = None
        g_buffer: Optional[torch.Tensor] = None
        v_buffer: Optional[torch.Tensor] = None
        beta_buffer: Optional[torch.Tensor] = None

    # isinstance(..., MambaPool.SpeculativeState) stays true (stock code checks it).
    @dataclass(frozen=True, kw_only=True)
    class SpeculativeState(State, MambaPool.SpeculativeState):
        pass

    _NON_TRANSFER_STATE_FIELDS = MambaPool._NON_TRANSFER_STATE_FIELDS | frozenset(REPLAY_FIELDS)

    @classmethod
    def with_config(cls, config: Optional[ReplayConfig] = None, *,
                    family: Optional[str] = None) -> type:
        """A subclass with ``config`` / ``family`` bound (for mamba_pool_cls)."""
        if family is not None and family not in FAMILIES:
            raise ValueError(f"ReplaySSM family must be one of {FAMILIES}, got {family!r}")
        return type(cls.__name__, (cls,), {
            "replay_config": config.validate() if config is not None else None,
            "replay_family": family, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})

    @classmethod
    def _resolve_config(cls) -> ReplayConfig:
        cfg = cls.replay_config if cls.replay_config is not None else ReplayConfig.from_env()
        return cfg.validate()

    @staticmethod
    def _window(speculative_num_draft_tokens: Optional[int]) -> int:
        return max(1, speculative_num_draft_tokens or 1)

    @classmethod
    def extra_bytes_per_slot(cls, cache_params, config: Optional[ReplayConfig] = None, *,
                             num_layers: Optional[int] = None, family: Optional[str] = None,
                             speculative_num_draft_tokens: Optional[int] = None) -> int:
        """Bytes the replay fields add per slot over all mamba layers (buffers,
        fold copy, the two int32 cursors), plus the checkpoint bytes the
        ``checkpoint_dtype`` override adds (negative if it shrinks it) relative to
        ``cache_params.mamba_cache_per_req``; with speculative decoding the
        rings sized for the verify window and the conv windows per draft token
        (allocated per running request, charged per slot: a bound, as the
        solver sizes no separate spec scratch for this pool). ``num_layers``
        defaults to ``len(cache_params.layers)``. For the capacity solver hook."""
        config = (config or cls.replay_config or ReplayConfig.from_env()).validate()
        family = detect_family(cache_params, family or cls.replay_family)
        layers = len(cache_params.layers) if num_layers is None else num_layers
        ckpt = _checkpoint_dtype(config, cache_params)
        cap = required_capacity(config.buffer_len, cls._window(speculative_num_draft_tokens))
        per_layer = sum(
            torch.Size(shape).numel() * dtype.itemsize
            for shape, dtype in _buffer_specs(family, cache_params, config, cap, ckpt).values())
        numel_t = torch.Size(cache_params.shape.temporal).numel()
        per_layer += numel_t * (ckpt.itemsize - cache_params.dtype.temporal.itemsize)
        if speculative_num_draft_tokens:
            conv_numel = sum(torch.Size(shape).numel() for shape in cache_params.shape.conv)
            per_layer += (speculative_num_draft_tokens * conv_numel
                          * cache_params.dtype.conv.itemsize)
        return per_layer * layers + 2 * 4

    def __init__(self, *, size: int, spec_state_size: int, cache_params, mamba_layer_ids,
                 device: str, enable_memory_saver: bool = False,
                 speculative_num_draft_tokens: Optional[int] = None,
                 speculative_eagle_topk: Optional[int] = None,
                 enable_linear_replayssm: bool = False, linear_replayssm_cache_len: int = 16,
                 envelope_layout: bool = False, enable_linear_replayssm_spec: bool = False):
        if enable_linear_replayssm or enable_linear_replayssm_spec:
            raise ValueError("ReplayMambaPool replaces SGLang's built-in ReplaySSM: keep "
                             "--enable-linear-replayssm / --enable-linear-replayssm-spec off")
        config = self._resolve_config()
        family = detect_family(cache_params, self.replay_family)
        ckpt_dtype = _checkpoint_dtype(config, cache_params)
        if config.fold_dtype is not None and envelope_layout:
            raise ValueError("--replayssm-fold-dtype is not supported with the envelope layout")
        if ckpt_dtype != cache_params.dtype.temporal:
            cache_params = dataclasses.replace(
                cache_params,
                dtype=Mamba2StateDType(conv=cache_params.dtype.conv, temporal=ckpt_dtype))
        self.replay_config_used = config
        self.family = family
        self.buffer_len = config.buffer_len
        self.decode_route = config.decode_route  # passed to the decode kernels
        self.window = self._window(speculative_num_draft_tokens)
        self.capacity = required_capacity(config.buffer_len, self.window)
        specs = _buffer_specs(family, cache_params, config, self.capacity, ckpt_dtype)

        # The stock pool is built without speculative decoding: its spec state
        # adds intermediate_ssm, a copy of every layer's state per draft token
        # and running request, which ReplaySSM never needs (the verify kernels
        # write no per-draft state; rollback is a cursor move). The conv
        # windows per draft token, which conv rollback still reads, are
        # added below.
        super().__init__(
            size=size, spec_state_size=spec_state_size, cache_params=cache_params,
            mamba_layer_ids=mamba_layer_ids, device=device,
            enable_memory_saver=enable_memory_saver,
            speculative_num_draft_tokens=None, speculative_eagle_topk=speculative_eagle_topk,
            enable_linear_replayssm=False, linear_replayssm_cache_len=linear_replayssm_cache_len,
            envelope_layout=envelope_layout, enable_linear_replayssm_spec=False)

        num_layers = len(mamba_layer_ids)
        with (
            self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE),
            (torch.cuda.use_mem_pool(self.custom_mem_pool)
             if self.enable_custom_mem_pool else nullcontext()),
        ):
            extra = {}
            for name, (shape, dtype) in specs.items():
                if name == "checkpoint_fold":
                    t = self.mamba_cache.temporal
                    extra[name] = torch.zeros_like(t, dtype=dtype)
                    assert extra[name].stride() == t.stride()
                else:
                    extra[name] = torch.zeros((num_layers, size + 1) + shape, dtype=dtype,
                                              device=device)
            self.fill = torch.zeros((size + 1,), dtype=torch.int32, device=device)
            self.origin = torch.zeros((size + 1,), dtype=torch.int32, device=device)
            if speculative_num_draft_tokens is not None:
                windows = self._conv_windows(cache_params, spec_state_size,
                                             speculative_num_draft_tokens,
                                             speculative_eagle_topk, num_layers, device)
        if speculative_num_draft_tokens is None:
            self.mamba_cache = dataclasses.replace(self.mamba_cache, **extra)
        else:
            fields = {f.name: getattr(self.mamba_cache, f.name)
                      for f in dataclasses.fields(self.mamba_cache)}
            self.mamba_cache = self.SpeculativeState(
                **{**fields, **extra}, intermediate_ssm=None, intermediate_conv_window=windows)
        self.replay_fields = tuple(extra)
        self.mem_usage = self._mem_usage_bytes() / GB

    def _conv_windows(self, cache_params, spec_state_size: int, draft_tokens: int,
                      topk: Optional[int], num_layers: int, device) -> list:
        """The conv state's window after each draft token, per batch row
        ([L_m, spec_state_size+1, draft_tokens, *conv_shape] views): the causal
        conv of a verify writes them, the commit copies the last accepted
        one into the conv state. As MambaPool lays them out: SGLang's
        deduplicated sliding windows on CUDA for a chain, dense otherwise."""
        shapes = cache_params.shape.conv
        dtype = cache_params.dtype.conv
        on_cuda = torch.device(device).type == "cuda"
        if on_cuda and not cache_params.shape.disable_conv_window_dedup and \
                conv_window_dedup_enabled(False, False, topk, cache_params.is_kda):
            self.conv_window_axis = self._detect_conv_window_axis(
                shapes, cache_params.shape.conv_kernel - 1)
            phys, views = [], []
            for shape in shapes:  # allocates on the current CUDA device
                p, v = self._allocate_deduplicated_conv_window(
                    conv_shape=shape, num_mamba_layers=num_layers,
                    spec_state_size=spec_state_size,
                    speculative_num_draft_tokens=draft_tokens, conv_dtype=dtype)
                phys.append(p)
                views.append(v)
        else:
            phys = views = [torch.zeros((num_layers, spec_state_size + 1, draft_tokens) + shape,
                                        dtype=dtype, device=device) for shape in shapes]
        self._intermediate_conv_window_phys = phys
        return views

    def rings(self) -> Tuple[torch.Tensor, ...]:
        """The input-buffer rings ([L_m, S+1, heads, cap, ...]), the tensors
        whose entries a tree verify's accepted path moves."""
        return tuple(t for name, t in self.replay_tensors().items() if name != "checkpoint_fold")

    def slot_tensors(self) -> Tuple[torch.Tensor, ...]:
        """Every tensor that holds a slot's state, as [layers, S+1, ...]: the
        conv states, the checkpoint, the fold copy, the rings and the cursors
        (as [1, S+1]). What a copy of a whole slot copies (copy_from, a radix
        track snapshot)."""
        c = self.mamba_cache
        return (*c.conv, c.temporal, *self.replay_tensors().values(),
                self.fill[None], self.origin[None])

    def mamba2_layer_cache(self, layer_id: int):
        cache = super().mamba2_layer_cache(layer_id)
        if self._scan_on_fold_copy:
            cache = dataclasses.replace(cache, temporal=cache.checkpoint_fold)
        return cache

    @contextmanager
    def fold_copy_as_state(self):
        """While active, ``mamba2_layer_cache`` hands out the fold copy as the
        layer's ``temporal``: a stock prefill scan (which fetches the cache
        itself) then starts from and writes the precise copy. No-op without a
        fold copy. The caller copies the result into the read copy."""
        if self.mamba_cache.checkpoint_fold is None:
            yield
            return
        self._scan_on_fold_copy = True
        try:
            yield
        finally:
            self._scan_on_fold_copy = False

    # -- sizes --
    def replay_tensors(self) -> Dict[str, torch.Tensor]:
        return {name: getattr(self.mamba_cache, name) for name in self.replay_fields}

    def replay_bytes(self) -> int:
        """Bytes of the replay fields and cursors (all layers, all slots)."""
        return (sum(get_tensor_size_bytes(t) for t in self.replay_tensors().values())
                + get_tensor_size_bytes(self.fill) + get_tensor_size_bytes(self.origin))

    def _mem_usage_bytes(self) -> int:
        # As MambaPool.__init__: charge the physical dedup conv windows, not the view.
        b = self.mamba_cache.mem_usage_bytes()
        if isinstance(self.mamba_cache, MambaPool.SpeculativeState):
            b -= get_tensor_size_bytes(self.mamba_cache.intermediate_conv_window)
            b += get_tensor_size_bytes(self._intermediate_conv_window_phys)
        return b + get_tensor_size_bytes(self.fill) + get_tensor_size_bytes(self.origin)

    def get_kv_size_bytes(self):
        # stock: mamba_cache.mem_usage_bytes() (already counts the State fields) + cursors
        return (self.mamba_cache.mem_usage_bytes() + get_tensor_size_bytes(self.fill)
                + get_tensor_size_bytes(self.origin))

    # -- slot ops --
    def clear_slots(self, indices: torch.Tensor):
        """Stock clear (conv + checkpoint zeroed) + fold copy zeroed + empty buffer
        (fill = origin = 0). Buffer contents are not zeroed: fill = 0 means no
        entry is read."""
        super().clear_slots(indices)
        fold = self.mamba_cache.checkpoint_fold
        if fold is not None:
            fold[:, indices] = 0
        self.fill[indices] = 0
        self.origin[indices] = 0

    def copy_from(self, src_indices: torch.Tensor, dst_indices: torch.Tensor):
        """Exact clone of src slots into dst: conv, checkpoint, fold copy, the
        buffers and the cursors (an un-flushed source stays exact)."""
        super().copy_from(src_indices, dst_indices)
        for t in self.replay_tensors().values():
            t[:, dst_indices] = t[:, src_indices]
        self.fill[dst_indices] = self.fill[src_indices]
        self.origin[dst_indices] = self.origin[src_indices]

    def get_cpu_copy(self, indices):
        """``(conv_cpu, temporal_cpu, replay_cpu)``; replay_cpu is a dict of the
        replay fields ([L_m, n, ...]) and the cursors ``fill``/``origin`` ([n]).
        The stock reader tolerates a 3-tuple; use this pool's load_cpu_copy."""
        conv_cpu, temporal_cpu = super().get_cpu_copy(indices)
        replay_cpu = {name: t[:, indices].to("cpu", non_blocking=True)
                      for name, t in self.replay_tensors().items()}
        replay_cpu["fill"] = self.fill[indices].to("cpu", non_blocking=True)
        replay_cpu["origin"] = self.origin[indices].to("cpu", non_blocking=True)
        current_platform.synchronize()
        return conv_cpu, temporal_cpu, replay_cpu

    def load_cpu_copy(self, mamba_cache_cpu, indices):
        """Inverse of get_cpu_copy. A stock 2-tuple (conv, temporal) loads as a
        fully flushed slot: fill = origin = 0, fold copy = the checkpoint."""
        if len(mamba_cache_cpu) == 3:
            conv_cpu, temporal_cpu, replay_cpu = mamba_cache_cpu
        else:
            (conv_cpu, temporal_cpu), replay_cpu = mamba_cache_cpu, None
        super().load_cpu_copy((conv_cpu, temporal_cpu), indices)
        if not isinstance(replay_cpu, dict):
            fold = self.mamba_cache.checkpoint_fold
            if fold is not None:
                fold[:, indices] = self.mamba_cache.temporal[:, indices].to(fold.dtype)
            self.fill[indices] = 0
            self.origin[indices] = 0
            return
        for name, t in self.replay_tensors().items():
            t[:, indices] = replay_cpu[name].to(t.device, non_blocking=True)
        self.fill[indices] = replay_cpu["fill"].to(self.fill.device, non_blocking=True)
        self.origin[indices] = replay_cpu["origin"].to(self.origin.device, non_blocking=True)
        current_platform.synchronize()
