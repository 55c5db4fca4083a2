"""SGLang attention backends that decode Mamba-2 and GDN layers with ReplaySSM.

Thin subclasses of SGLang 0.5.17's own backends: everything but the SSM state
update is stock (projections, causal conv, gating, norms, prefill scans).
They need the pool to be :class:`~sglang_replayssm.pool.ReplayMambaPool`;
:mod:`sglang_replayssm.sglang_hooks` installs both.

Per forward batch and SSM layer:

* **extend / mixed** rows (prefill, chunked-prefill continuation, and for GDN
  the decode rows of a mixed batch, which SGLang runs as one-token extends):
  first fold each row's buffer into its checkpoint (``*_replay_flush``; rows
  with an empty buffer cost nothing), so the stock chunk scan starts from the
  exact state and writes its final state as the new checkpoint;
* **decode** rows: the ReplaySSM decode kernel reads checkpoint + buffer,
  appends the token and folds on the row's flush step.

After the model's last SSM layer the cursors advance once for the whole
model (``cursors.commit``): extend rows end with an empty buffer
(``MODE_FLUSH``), decode rows by one token (``MODE_DECODE``). The commit
reads the slot ids from the backend's metadata tensor, so it is recorded in
the decode CUDA graph like the kernels; padded rows (slot -1) are untouched.

Mamba-2 models call ``MambaMixer2.forward`` with the layer's cache and the
mixer calls the module-level ``selective_state_update`` of SGLang's
``mamba.py`` for its decode rows. The hook replaces that name with
:func:`selective_state_update`, which routes to the ReplaySSM kernel while a
:class:`ReplayMamba2AttnBackend` runs the layer (``_ACTIVE`` is set for the
duration of one mixer call) and to SGLang's own function otherwise.
GDN's decode goes through ``GDNAttnBackend.kernel_dispatcher.packed_decode``,
which :class:`_ReplayGDNDispatcher` answers.
"""
from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from typing import Callable, Optional

import torch
from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

from sglang_replayssm.kernels.cursors import (MODE_DECODE, MODE_FLUSH, MODE_VERIFY, accept_path,
                                              commit, tree_path)
from sglang_replayssm.kernels.gdn_replay import (gdn_replay_decode, gdn_replay_flush,
                                                 gdn_replay_verify)
from sglang_replayssm.kernels.mamba2_replay import (mamba2_replay_decode, mamba2_replay_flush,
                                                    mamba2_replay_verify)
from sglang_replayssm.kernels.slots import copy_slots
from sglang_replayssm.pool import ReplayMambaPool

logger = logging.getLogger("sglang_replayssm")

__all__ = ["ReplayMamba2AttnBackend", "ReplayGDNAttnBackend", "selective_state_update",
           "set_stock_selective_state_update", "commit_after_verify"]


@dataclasses.dataclass
class _ActiveLayer:
    """The SSM layer a ReplaySSM backend is running right now."""

    cache: ReplayMambaPool.State  # the layer's slice of the pool
    pool: ReplayMambaPool


_ACTIVE: Optional[_ActiveLayer] = None
# SGLang's own selective_state_update (set by the hook that replaces it).
_STOCK_SSU: Optional[Callable] = None


def set_stock_selective_state_update(fn: Callable) -> None:
    global _STOCK_SSU
    _STOCK_SSU = fn


@contextmanager
def _running(layer: _ActiveLayer):
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, layer
    try:
        yield
    finally:
        _ACTIVE = previous


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None, pad_slot_id=-1,
                           out=None, disable_state_update=False, **verify_kwargs):
    """Drop-in for SGLang's ``selective_state_update`` as ``mamba.py`` calls it.

    Outside a ReplaySSM layer: SGLang's own function, unchanged. Inside:
    ``mamba2_replay_decode`` on the layer's checkpoint and buffer (``state``,
    the stock state tensor, is the layer's checkpoint and is not used
    directly: with a fold copy the prefill path may hand the mixer that copy).
    """
    layer = _ACTIVE
    if layer is None:
        if _STOCK_SSU is None:
            raise RuntimeError("sglang_replayssm: SGLang's selective_state_update was not "
                               "recorded (install the hooks through sglang_hooks)")
        return _STOCK_SSU(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                          state_batch_indices, pad_slot_id, out=out,
                          disable_state_update=disable_state_update, **verify_kwargs)
    if pad_slot_id != -1:
        raise ValueError(f"ReplaySSM kernels mark padded rows with slot -1, got "
                         f"pad_slot_id={pad_slot_id}")
    c, pool = layer.cache, layer.pool
    if disable_state_update:
        # a verify (mamba.py:703-737): x [b, T, H, P]; the per-draft state
        # snapshots SGLang asks for (intermediate_states_buffer) are not
        # needed: the drafts are appended to the ring, and the commit moves
        # the cursors
        if x.dim() != 4:
            raise ValueError(f"ReplaySSM Mamba-2 verify expects x [batch, T, H, P], got "
                             f"{tuple(x.shape)}")
        return mamba2_replay_verify(
            c.temporal, c.x_buffer, c.B_buffer, c.dt_buffer, pool.fill, pool.origin,
            state_batch_indices, x, dt, A, B, C, buffer_len=pool.buffer_len, D=D, z=z,
            dt_bias=dt_bias, dt_softplus=dt_softplus, out=out,
            checkpoint_fold=c.checkpoint_fold,
            parents=verify_kwargs.get("retrieve_parent_token"))
    return mamba2_replay_decode(
        c.temporal, c.x_buffer, c.B_buffer, c.dt_buffer, pool.fill, pool.origin,
        state_batch_indices, x, dt, A, B, C, buffer_len=pool.buffer_len, D=D, z=z,
        dt_bias=dt_bias, dt_softplus=dt_softplus, out=out,
        checkpoint_fold=c.checkpoint_fold, route=pool.decode_route)


class _ReplayStep:
    """What both backends share: the pool, the last SSM layer, the commits."""

    def __init__(self, req_to_token_pool, family: str):
        pool = req_to_token_pool.mamba_pool
        if not isinstance(pool, ReplayMambaPool):
            raise RuntimeError(
                f"--enable-replayssm: the mamba pool is {type(pool).__name__}, not "
                "ReplayMambaPool (the pool hook was not installed in this process)")
        if pool.family != family:
            raise RuntimeError(f"--enable-replayssm: the pool was built for {pool.family!r} "
                               f"layers but the model's SSM layers are {family!r}")
        self.req_to_token_pool = req_to_token_pool
        self.pool = pool
        self.last_layer_id = max(req_to_token_pool.mamba_map)

    def layer(self, layer_id) -> _ActiveLayer:
        return _ActiveLayer(self.req_to_token_pool.mamba2_layer_cache(layer_id), self.pool)

    def commit(self, slots: torch.Tensor, mode: int) -> None:
        p = self.pool
        commit(p.fill, p.origin, slots, mode=mode, buffer_len=p.buffer_len,
               capacity=p.capacity)

    # -- the radix cache's track snapshots (--mamba-radix-cache-strategy
    # extra_buffer): SGLang copies a request's conv and SSM state into its
    # track slot when its length crosses a multiple of --mamba-track-interval;
    # here the slot's state is the checkpoint, fold copy, buffer and cursors
    # together, so the snapshot takes all of them.

    def track_decode(self, slots: torch.Tensor, track_slots: torch.Tensor,
                     mask: torch.Tensor) -> None:
        """After a forward's commit (every layer's buffer holds this step's
        token): whole-slot copies ``slots[r] -> track_slots[r]`` where
        ``mask[r]`` (as track_mamba_states_all_layers, hybrid_linear_attn_backend.py:757-799,
        copies conv and state). Inside the CUDA graph; rows off the mask
        return at once."""
        n = mask.shape[0]
        copy_slots(self.pool.slot_tensors(), slots[:n], track_slots[:n], mask)

    def track_extend_fixup(self, cache, md, last_layer: bool) -> None:
        """After SGLang's extend tracking (``_track_mamba_state_extend`` and the
        causal conv's ``track_conv_indices``) wrote a plain state, the scan's
        state at a chunk boundary or its final state, into track slots' state
        tensor: with a fold copy that tensor was the fold copy (the scan runs on
        it), so the read copy follows; at the last layer the track slots'
        buffers are emptied (they hold no buffered token)."""
        if not getattr(md, "has_mamba_track_mask", False):
            return
        dst = torch.cat([md.track_ssm_h_dst, md.track_ssm_final_dst]).long()
        if cache.checkpoint_fold is not None:
            cache.temporal[dst] = cache.checkpoint_fold[dst].to(cache.temporal.dtype)
        if last_layer:
            self.pool.fill[dst] = 0
            self.pool.origin[dst] = 0

    def commit_verify(self, slots: torch.Tensor, last_step: torch.Tensor,
                      retrieve_parent_token: Optional[torch.Tensor],
                      mamba_track_indices: Optional[torch.Tensor] = None,
                      mamba_steps_to_track: Optional[torch.Tensor] = None) -> None:
        """After a verify and its sampling, once for the model: roll the conv
        state to the last accepted draft (SGLang's own scatter of the conv
        windows the verify's causal conv wrote), then keep the accepted
        drafts in the input buffer: for a tree move their ring entries to
        the first window positions (every ring, every layer), then advance
        the cursors by the accepted count. Rejected drafts stay behind the
        cursor and are overwritten by the next step.

        slots [b] (-1 = padded row), last_step [b]: the window index of each
        row's last accepted draft (SGLang's ``last_correct_step_indices``,
        the bonus token's position). With the radix cache's extra_buffer,
        ``mamba_steps_to_track`` [b] is the window index of the accepted draft
        at which a row's length crossed a track interval (-1: none) and
        ``mamba_track_indices`` [b] its track slot: the slot after the commit
        is copied there, keeping the buffer up to that draft, and the conv
        state at that draft (SGLang's scatter of that conv window)."""
        from sglang.kernels.ops.mamba.mamba_state_scatter_triton import (
            fused_conv_window_scatter_with_mask)

        p = self.pool
        cache = p.mamba_cache
        # mamba_state_scatter_triton.py:375 (as commit_mamba_states_after_verify
        # does for SGLang's built-in ReplaySSM, spec_utils.py:908-913)
        for conv, windows in zip(cache.conv, cache.intermediate_conv_window):
            fused_conv_window_scatter_with_mask(conv, windows, slots, last_step)
        if retrieve_parent_token is None:
            accepted = (last_step + 1).to(torch.int32)
        else:
            path, accepted = tree_path(retrieve_parent_token, last_step)
            accept_path(p.rings(), p.fill, p.origin, slots, path, accepted,
                        capacity=p.capacity, stacked=True)
        commit(p.fill, p.origin, slots, mode=MODE_VERIFY, buffer_len=p.buffer_len,
               capacity=p.capacity, window=p.window, accepted=accepted)
        if mamba_track_indices is None or mamba_steps_to_track is None:
            return
        steps = mamba_steps_to_track.to(slots.device)
        mask = (steps >= 0) & (slots >= 0)
        track = mamba_track_indices.to(slots.device)
        copy_slots(p.slot_tensors(), slots, track, mask)
        # the accepted drafts are the last `accepted` entries of the buffer
        # (in path order); the snapshot keeps them up to the tracked draft
        if retrieve_parent_token is None:
            depth = steps
        else:
            depth = (path == steps[:, None]).int().argmax(1)
        rows = mask.nonzero().flatten()  # the commit runs eagerly, after sampling
        live = slots[rows].long()
        p.fill[track[rows].long()] = (p.fill[live] - accepted[rows] + depth[rows] + 1).to(
            p.fill.dtype)
        for conv, windows in zip(cache.conv, cache.intermediate_conv_window):
            fused_conv_window_scatter_with_mask(conv, windows, track, torch.where(mask, steps, -1))


def _log_enabled(family: str, pool: ReplayMambaPool, num_layers: int) -> None:
    c = pool.mamba_cache
    fold = c.checkpoint_fold
    logger.info(
        "ReplaySSM enabled for %d %s layers: buffer_len=%d (ring capacity %d), checkpoint %s%s, "
        "decode route %s, %d slots, %.2f GB of buffers and cursors",
        num_layers, "Mamba-2" if family == "mamba2" else "Gated DeltaNet", pool.buffer_len,
        pool.capacity, str(c.temporal.dtype).replace("torch.", ""),
        "" if fold is None else f" + fold copy {str(fold.dtype).replace('torch.', '')}",
        pool.decode_route, pool.size, pool.replay_bytes() / 1024**3)


class ReplayMamba2AttnBackend(Mamba2AttnBackend):
    """Mamba2AttnBackend (the class NemotronH / FalconH1 / GraniteMoeHybrid
    assert on) whose decode rows run the ReplaySSM kernels."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.replay = _ReplayStep(self.req_to_token_pool, "mamba2")
        _log_enabled("mamba2", self.replay.pool, len(self.req_to_token_pool.mamba_map))

    def forward(self, mixer, hidden_states, output, layer_id, forward_batch, mup_vector=None,
                use_triton_causal_conv=False):
        md = self.forward_metadata
        use_triton_causal_conv = self._use_triton_causal_conv(use_triton_causal_conv)
        layer = self.replay.layer(layer_id)
        cache, pool = layer.cache, layer.pool
        n_p, n_d = md.num_prefills, md.num_decodes
        slots = md.mamba_cache_indices
        prefill_slots = slots[:n_p]
        mixer_cache = cache
        if n_p > 0:
            # The scan starts from the checkpoint: fold what is buffered first.
            mamba2_replay_flush(cache.temporal, cache.x_buffer, cache.B_buffer, cache.dt_buffer,
                                pool.fill, pool.origin, prefill_slots, mixer.A,
                                buffer_len=pool.buffer_len, checkpoint_fold=cache.checkpoint_fold)
            if cache.checkpoint_fold is not None:
                # the scan reads and writes the precise copy
                mixer_cache = dataclasses.replace(cache, temporal=cache.checkpoint_fold)
        with _running(layer):
            mixer_out, intermediate_states = mixer.forward(
                hidden_states=hidden_states, output=output, layer_cache=mixer_cache,
                metadata=md, mup_vector=mup_vector,
                use_triton_causal_conv=use_triton_causal_conv)
        last = layer_id == self.replay.last_layer_id
        tracking = forward_batch.mamba_track_mask is not None
        if n_p > 0 and tracking:  # as Mamba2AttnBackend.forward (hybrid_linear_attn_backend.py:910-918)
            self._track_mamba_state_extend(forward_batch, intermediate_states,
                                           mixer_cache.temporal, md)
        if n_p > 0 and cache.checkpoint_fold is not None:
            idx = prefill_slots.long()
            cache.temporal[idx] = cache.checkpoint_fold[idx].to(cache.temporal.dtype)
        if n_p > 0 and tracking:
            self.replay.track_extend_fixup(cache, md, last)
        # a verify's cursors move in commit_verify, once the drafts are accepted
        if last and not md.is_target_verify:
            if n_p > 0:
                self.replay.commit(prefill_slots, MODE_FLUSH)
            if n_d > 0:
                self.replay.commit(slots[n_p:n_p + n_d], MODE_DECODE)
                if tracking:  # hybrid_linear_attn_backend.py:920-930, after the commit
                    self.replay.track_decode(slots[-n_d:], md.mamba_track_indices[-n_d:],
                                             forward_batch.mamba_track_mask[-n_d:])
        return mixer_out


    @staticmethod
    def _use_triton_causal_conv(requested: bool) -> bool:
        # as Mamba2AttnBackend.forward: page-major state needs the stride-aware conv
        from sglang.srt.runtime_context import get_memory

        return requested or get_memory().enable_page_major_kv_layout


def _gdn_fold_kwargs(cache) -> dict:
    """The dual-precision fields of a GDN layer's cache (empty without a fold copy)."""
    if cache.checkpoint_fold is None:
        return {}
    return dict(checkpoint_fold=cache.checkpoint_fold, v_buffer=cache.v_buffer,
                beta_buffer=cache.beta_buffer)


class _ReplayGDNDispatcher:
    """GDNKernelDispatcher whose packed decode is the ReplaySSM kernel;
    every other kernel (extend, verify) is the wrapped stock dispatcher's."""

    supports_packed_decode = True

    def __init__(self, stock):
        self._stock = stock

    def __getattr__(self, name):
        return getattr(self._stock, name)

    def packed_decode(self, mixed_qkv, a, b, *, A_log, dt_bias, scale, ssm_states,
                      cache_indices, num_v_heads, head_v_dim, **unused):
        layer = _ACTIVE
        if layer is None:
            raise RuntimeError("ReplaySSM GDN decode called outside a ReplaySSM layer")
        c, pool = layer.cache, layer.pool
        out = gdn_replay_decode(
            c.temporal, c.k_buffer, c.u_buffer, c.g_buffer, pool.fill, pool.origin,
            cache_indices, mixed_qkv, a, b, A_log, dt_bias, scale,
            buffer_len=pool.buffer_len, num_k_heads=c.k_buffer.shape[1],
            route=pool.decode_route, **_gdn_fold_kwargs(c))
        return out.unsqueeze(0)  # [1, B, HV, V], the stock packed decode's layout


class ReplayGDNAttnBackend(GDNAttnBackend):
    """GDNAttnBackend (Qwen3-Next, Qwen3.5) whose decode runs the ReplaySSM kernels."""

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.replay = _ReplayStep(self.req_to_token_pool, "gdn")
        self.kernel_dispatcher = _ReplayGDNDispatcher(self.kernel_dispatcher)
        _log_enabled("gdn", self.replay.pool, len(self.req_to_token_pool.mamba_map))

    def forward_decode(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
        with _running(self.replay.layer(layer.layer_id)):
            out = super().forward_decode(layer, forward_batch, mixed_qkv, a, b, **kwargs)
        if layer.layer_id == self.replay.last_layer_id:
            md = self.forward_metadata
            self.replay.commit(md.mamba_cache_indices, MODE_DECODE)
            if forward_batch.mamba_track_mask is not None:
                # the stock body's snapshot (_track_mamba_state_decode) took the
                # checkpoint alone, before this commit: the whole slot replaces it
                self.replay.track_decode(md.mamba_cache_indices, md.mamba_track_indices,
                                         forward_batch.mamba_track_mask)
        return out

    def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return self._forward_verify(layer, forward_batch, mixed_qkv, a, b)
        active = self.replay.layer(layer.layer_id)
        c, pool = active.cache, active.pool
        slots = self.forward_metadata.mamba_cache_indices
        # Every row of an extend batch (mixed decode rows included) goes
        # through the chunk scan from the checkpoint: fold the buffer first.
        gdn_replay_flush(c.temporal, c.k_buffer, c.u_buffer, c.g_buffer, pool.fill,
                         pool.origin, slots, buffer_len=pool.buffer_len,
                         num_k_heads=c.k_buffer.shape[1], **_gdn_fold_kwargs(c))
        # with a fold copy the stock scan starts from and writes the precise
        # copy (it fetches the layer cache itself), then the read copy follows
        with pool.fold_copy_as_state():
            out = super().forward_extend(layer, forward_batch, mixed_qkv, a, b, **kwargs)
        if c.checkpoint_fold is not None:
            idx = slots.long()
            c.temporal[idx] = c.checkpoint_fold[idx].to(c.temporal.dtype)
        last = layer.layer_id == self.replay.last_layer_id
        if forward_batch.mamba_track_mask is not None:
            # the stock body tracked the scan's states into the track slots
            self.replay.track_extend_fixup(c, self.forward_metadata, last)
        if last:
            self.replay.commit(slots, MODE_FLUSH)
        return out

    def _forward_verify(self, layer, forward_batch, mixed_qkv, a, b):
        """A verify of T drafts per row: the causal conv as
        ``GDNAttnBackend.forward_extend`` runs it for a verify
        (gdn_backend.py:533-551; it writes the conv window after each draft,
        which the commit reads, and a tree's ``retrieve_parent_token``), then
        the ReplaySSM verify on the packed conv output (no q/k/v split: the
        kernel reads q, k, v from it as the packed decode does)."""
        from sglang.srt.layers.attention.linear import gdn_backend

        md = self.forward_metadata
        T = forward_batch.spec_info.draft_token_num
        tokens = mixed_qkv.shape[0]
        batch = tokens // T
        active = self.replay.layer(layer.layer_id)
        c, pool = active.cache, active.pool
        slots = md.mamba_cache_indices[:batch]
        qkv = gdn_backend.causal_conv1d_update(
            mixed_qkv.view(batch, T, -1).transpose(1, 2), c.conv[0], layer.conv_weights,
            layer.bias, layer.activation, conv_state_indices=slots,
            intermediate_conv_window=c.intermediate_conv_window[0],
            intermediate_state_indices=self.verify_intermediate_state_indices[:batch],
            retrieve_next_token=md.retrieve_next_token,
            retrieve_next_sibling=md.retrieve_next_sibling,
            retrieve_parent_token=md.retrieve_parent_token,
        ).transpose(1, 2)  # [batch, T, dim]
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        out = gdn_replay_verify(
            c.temporal, c.k_buffer, c.u_buffer, c.g_buffer, pool.fill, pool.origin, slots,
            qkv, a.view(batch, T, -1), b.view(batch, T, -1), layer.A_log, layer.dt_bias,
            layer.head_k_dim ** -0.5, buffer_len=pool.buffer_len,
            num_k_heads=c.k_buffer.shape[1], parents=md.retrieve_parent_token,
            **_gdn_fold_kwargs(c))
        return out.view(1, tokens, *out.shape[2:])  # the stock target_verify's layout


def commit_after_verify(backend, last_correct_step_indices: torch.Tensor,
                        mamba_track_indices: Optional[torch.Tensor] = None,
                        mamba_steps_to_track: Optional[torch.Tensor] = None) -> bool:
    """The post-verify commit for a ReplaySSM linear-attention ``backend``
    (what SGLang's ``update_mamba_state_after_mtp_verify`` does with its
    per-draft state snapshots; see :meth:`_ReplayStep.commit_verify`): the
    slots and a tree's parents come from the verify's metadata, as SGLang's
    own commit reads them. Returns False for any other backend."""
    replay = getattr(backend, "replay", None)
    if not isinstance(replay, _ReplayStep):
        return False
    md = backend.forward_metadata
    rows = last_correct_step_indices.shape[0]  # the batch's requests, without CUDA-graph padding
    parents = md.retrieve_parent_token
    replay.commit_verify(md.mamba_cache_indices[:rows], last_correct_step_indices,
                         None if parents is None else parents[:rows],
                         None if mamba_track_indices is None else mamba_track_indices[:rows],
                         None if mamba_steps_to_track is None else mamba_steps_to_track[:rows])
    return True
