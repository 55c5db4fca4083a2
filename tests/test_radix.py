"""A cached prefix continued exactly, through SGLang's own radix cache.

SGLang's ``UnifiedRadixCache`` (the default prefix cache of hybrid SSM
models) decides what is cached and under which key: a finished request's
slot under its fed tokens (``no_buffer``), or its last track snapshot under
the length it was taken at (``extra_buffer``); a later request that matches
gets a copy of that slot (copy-on-write, ``copy_from``). Here a request runs
through the ReplaySSM backends (the stand-in layers of test_backends, the
kernels under the interpreter), is cached by SGLang's code with a part-full
input buffer, and a second request that extends it is matched, copied and
continued, every output against the float64 recurrence.
"""
from __future__ import annotations

import os
import sys
from array import array

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_replayssm.config import ReplayConfig  # noqa: E402
from test_backends import (LAYERS, PADDED_ROW_GARBAGE, SLOTS, L, Harness,  # noqa: E402,F401
                           gdn_stock_bodies, ssu_hook)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import make_model  # noqa: E402

MODEL = {"mamba2": "nemotron-h-8b-4layer", "gdn": "qwen3-next-80b-4layer"}


class RadixRig:
    """A Harness whose pool is shared with a full-attention KV pool, a token
    allocator and SGLang's UnifiedRadixCache, as the scheduler builds them."""

    def __init__(self, monkeypatch, family, extra_buffer, seed):
        # three slots per request, as SGLang sizes the pool with a radix cache
        self.h = h = Harness(monkeypatch, family, ReplayConfig(buffer_len=L), seed=seed,
                             mamba_size=3 * SLOTS, extra_buffer=extra_buffer)
        r2t = h.r2t
        kv = HybridLinearKVPool(size=128, dtype=torch.bfloat16, page_size=1, head_num=1,
                                head_dim=8, full_attention_layer_ids=[max(LAYERS) + 1],
                                device="cpu", enable_memory_saver=False,
                                mamba_pool=r2t.mamba_pool)
        self.alloc = TokenToKVPoolAllocator(size=128, dtype=torch.bfloat16, device="cpu",
                                            kvcache=kv, need_sort=False)
        self.tree = UnifiedRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=self.alloc,
            page_size=1, tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            enable_mamba_extra_buffer=extra_buffer))
        self.snapshot = {}  # layer -> the float64 state a later request continues from

    def admit(self, rid, ids):
        """Match the prompt (copy-on-write of a cached state), allocate, copy
        the matched slot as the forward stream does (model_runner.py:1478-1524)."""
        h = self.h
        r = Req(rid, "", array("i", ids), SamplingParams(max_new_tokens=64))
        res = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(r.origin_input_ids),
                                                       req=r, cow_mamba=True))
        r.last_node = res.last_device_node
        self.tree.inc_lock_ref(r.last_node)
        r.prefix_indices = res.device_indices
        h.r2t.alloc([r])
        cached = len(res.device_indices)
        src = getattr(r, "mamba_cow_src_index", None)
        if src is not None:
            h.pool.copy_from(src.view(-1), r.mamba_pool_idx.view(-1))
        else:
            h.pool.clear_slots(r.mamba_pool_idx.view(-1))
        kv = self.alloc.alloc(len(ids) - cached)
        h.r2t.req_to_token[r.req_pool_idx, :cached] = res.device_indices
        h.r2t.req_to_token[r.req_pool_idx, cached:len(ids)] = kv
        h.reqs[rid] = r
        return r, cached

    def start(self, rid, prompt):
        """A fresh request (nothing cached yet) prefilled with ``prompt``,
        its first output token 100."""
        h = self.h
        r, cached = self.admit(rid, prompt)
        assert cached == 0
        h.expected_fill[rid] = 0
        h.truth.start(rid)
        h.step(prefill=[(rid, len(prompt))])
        r.output_ids = array("i", [100])
        return r

    def decode(self, rids, out_ids, track=None):
        """One decode step: each request feeds its last output token."""
        h = self.h
        for rid in rids:
            r = h.reqs[rid]
            pos = len(r.origin_input_ids) + len(r.output_ids) - 1
            h.r2t.req_to_token[r.req_pool_idx, pos] = self.alloc.alloc(1)
        h.step(decode=list(rids), track=track)
        for rid in rids:
            h.reqs[rid].output_ids.append(out_ids[rid])

    def finish(self, rid):
        r = self.h.reqs[rid]
        fed = len(r.origin_input_ids) + len(r.output_ids) - 1  # the last output is never fed
        self.tree.cache_finished_req(r, kv_len_to_handle=fed)
        self.h.r2t.free(r)
        return fed


@pytest.fixture
def published(tmp_path):
    """publish(family): the process-wide server args the radix cache reads
    (page size, chunk size), undone afterwards. They say no_buffer either
    way (SGLang's checks of extra_buffer want CUDA); the cache takes
    extra_buffer from its init params."""
    from contextlib import ExitStack

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    with ExitStack() as stack:
        def publish(family):
            (path,) = make_model.write_model_configs(str(tmp_path), [MODEL[family]])
            stack.enter_context(runtime_context.get_parallel().override(
                attn_tp_size=1, attn_tp_rank=0, tp_size=1, tp_rank=0))
            runtime_context.publish(ServerArgs(
                model_path=path, device="cpu", page_size=1, mamba_radix_cache_strategy="no_buffer",
                disable_overlap_schedule=True,
                attention_backend="flashinfer" if family == "mamba2" else "triton"), role="test")

        yield publish
    runtime_context.reset_context()


def _continue_from_cache(rig, src, rid, prompt, cached_at):
    """Admit ``rid`` (``prompt`` extends ``src``'s first ``cached_at``
    tokens), check the match, then prefill the rest and decode from the
    copied slot against ``src``'s truth at the cached point."""
    h = rig.h
    r, cached = rig.admit(rid, prompt)
    assert cached == cached_at and r.mamba_cow_src_index is not None
    h.expected_fill[rid] = int(h.pool.fill[r.mamba_pool_idx])
    for lid in LAYERS:
        h.truth.h[(rid, lid)] = rig.snapshot[lid].clone()
    h.step(prefill=[(rid, len(prompt) - cached)])
    r.output_ids = array("i", [900])
    for i in range(L + 2):
        rig.decode([rid], {rid: 901 + i})


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_no_buffer_caches_the_slot_with_its_buffer(monkeypatch, request, published, family):
    """no_buffer: the finished request's own slot (a flush behind it, 3
    tokens buffered) is cached under its fed tokens; a request extending
    them is matched to all of them and continues from the copy."""
    request.getfixturevalue("ssu_hook" if family == "mamba2" else "gdn_stock_bodies")
    published(family)
    rig = RadixRig(monkeypatch, family, False, seed=21)
    h = rig.h
    prompt = [11, 12, 13, 14, 15]
    r = rig.start("a", prompt)
    for i in range(L + 3):  # one flush, then 3 tokens buffered
        rig.decode(["a"], {"a": 101 + i})
    assert h.fill("a") == 3
    rig.snapshot = {lid: h.truth.h[("a", lid)].clone() for lid in LAYERS}
    fed = rig.finish("a")
    h.reqs.pop("a"), h.expected_fill.pop("a")
    ids = (prompt + list(r.output_ids))[:fed]
    _continue_from_cache(rig, "a", "b", ids + [r.output_ids[-1], 500, 501], cached_at=fed)


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
def test_extra_buffer_caches_the_track_snapshot(monkeypatch, request, published, family):
    """extra_buffer: a decode step's whole-slot snapshot (2 tokens buffered)
    into the request's ping-pong track slot, bookkept as SGLang's result
    processor does; the finished request is cached under the tracked length
    with the track slot, and a request extending it continues from the copy."""
    request.getfixturevalue("ssu_hook" if family == "mamba2" else "gdn_stock_bodies")
    published(family)
    rig = RadixRig(monkeypatch, family, True, seed=22)
    h = rig.h
    prompt = [11, 12, 13, 14, 15]
    r = rig.start("a", prompt)
    for i in range(L + 2):
        track = None
        if i == L + 1:  # the step that leaves 2 tokens buffered is a track boundary
            track = {"a": int(r.mamba_ping_pong_track_buffer[r.mamba_next_track_idx])}
        rig.decode(["a"], {"a": 101 + i}, track=track)
    assert h.fill("a") == 2
    tracked = len(prompt) + L + 2
    r.mamba_last_track_seqlen = tracked  # batch_result_processor.py:1103-1111
    r.mamba_next_track_idx = h.r2t.get_mamba_ping_pong_other_idx(r.mamba_next_track_idx)
    rig.snapshot = {lid: h.truth.h[("a", lid)].clone() for lid in LAYERS}
    for i in range(3):  # the request goes on past its snapshot
        rig.decode(["a"], {"a": 200 + i})
    rig.finish("a")
    h.reqs.pop("a"), h.expected_fill.pop("a")
    ids = (prompt + list(r.output_ids))[:tracked]
    _continue_from_cache(rig, "a", "b", ids + [700, 701], cached_at=tracked)
