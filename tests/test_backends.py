"""The serving backends' cursor protocol, driven through SGLang's own pool on CPU.

A scripted sequence of forward batches (prefill, decode across flushes, mixed
prefill + decode, a chunked prefill whose last chunk is one token, padded
rows, retraction through the CPU copy, a radix-style copy of an unflushed slot
that then extends) runs through :class:`ReplayMamba2AttnBackend` and
:class:`ReplayGDNAttnBackend` with the kernels under the Triton interpreter.
Only the model layer is a stand-in: for Mamba-2 a mixer with
``MambaMixer2.forward``'s contract (prefill rows scanned from
``layer_cache.temporal``, final state written back; decode rows through the
module-level ``selective_state_update`` the hook replaces); for GDN the stock
``forward_decode`` / ``forward_extend`` bodies reduced to the SSM call. Every
output is compared with a float64 eager recurrence per request.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.hybrid_linear_attn_backend")

from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool  # noqa: E402

from sglang_replayssm import backends, reference  # noqa: E402
from sglang_replayssm.config import ReplayConfig  # noqa: E402
from sglang_replayssm.pool import ReplayMambaPool  # noqa: E402
from test_pool import LAYERS, M2, GDN, gdn_params, mamba2_params, req  # noqa: E402

# A padded row of the split route computes on whatever its inputs hold (the
# activations SGLang's conv update leaves unset for pad slots, the projection
# scratch (A) never writes for them) without waiting for the slot id to mask
# them, so the interpreter's numpy may report an overflow or an invalid value,
# depending on that memory. Those outputs are discarded (zeros / not stored);
# the live rows are asserted.
PADDED_ROW_GARBAGE = pytest.mark.filterwarnings(
    "ignore:overflow encountered:RuntimeWarning",
    "ignore:invalid value encountered:RuntimeWarning")

SLOTS = 6
L = 4  # small buffer: flushes every 4 decode steps
TOL = dict(rtol=2e-4, atol=2e-5)


def make_pool(monkeypatch, params, family, cfg, drafts=None, topk=None, mamba_size=SLOTS,
              extra_buffer=False):
    """extra_buffer: the radix cache's track slots too (two per request)."""
    monkeypatch.setattr(HybridReqToTokenPool, "mamba_pool_cls",
                        ReplayMambaPool.with_config(cfg, family=family))
    return HybridReqToTokenPool(
        size=SLOTS, mamba_size=mamba_size, mamba_spec_state_size=SLOTS, max_context_len=64,
        device="cpu", enable_memory_saver=False, cache_params=params, mamba_layer_ids=LAYERS,
        enable_mamba_extra_buffer=extra_buffer, enable_overlap_schedule=False,
        speculative_num_draft_tokens=drafts, speculative_eagle_topk=topk)


def bf16(*shape, scale=1.0, g=None):
    # activations enter the buffer in bf16: make them bf16-exact
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(torch.float32)


# ---------------------------------------------------------------- Mamba-2 --

class StandInMixer:
    """MambaMixer2.forward's contract on pre-split inputs.

    ``hidden_states`` is a dict of the batch's tokens (prefill rows' tokens
    first, then one token per decode row): x [t, H, P], dt [t, H], B/C [t, G, N].
    """

    def __init__(self, g):
        H = M2["H"]
        self.A = -torch.rand(H, generator=g) - 0.2
        self.D = torch.randn(H, generator=g)
        self.dt_bias = torch.randn(H, generator=g) * 0.3

    def forward(self, *, hidden_states, output, layer_cache, metadata, mup_vector,
                use_triton_causal_conv):
        inp = hidden_states
        H, P, N = M2["H"], M2["P"], M2["N"]
        slots = metadata.mamba_cache_indices
        n_p, n_d = metadata.num_prefills, metadata.num_decodes
        state = layer_cache.temporal
        if metadata.is_target_verify:
            return self.verify(inp, layer_cache, metadata), None
        outs, t = [], 0
        for r in range(n_p):  # prefill rows: scan from the checkpoint, write the final state
            s = int(slots[r])
            h = state[s:s + 1].to(torch.float64).clone()
            for _ in range(metadata.extend_lens[r]):
                outs.append(reference.selective_state_update_ref(
                    h, inp["x"][t:t + 1], inp["dt"][t:t + 1], self.A, inp["B"][t:t + 1],
                    inp["C"][t:t + 1], self.D, dt_bias=self.dt_bias,
                    state_batch_indices=torch.zeros(1, dtype=torch.int32))[0].float())
                t += 1
            state[s] = h[0].to(state.dtype)
        if n_d:
            from sglang.srt.layers.attention.mamba import mamba as mamba_module

            x, dt = inp["x"][t:t + n_d], inp["dt"][t:t + n_d]
            out = torch.empty(n_d, H, P)
            # exactly as mamba.py:739-752 passes them
            mamba_module.selective_state_update(
                state, x, dt[:, :, None].expand(-1, -1, P),
                self.A[:, None, None].expand(-1, P, N), inp["B"][t:t + n_d],
                inp["C"][t:t + n_d], self.D[:, None].expand(-1, P), z=None,
                dt_bias=self.dt_bias[:, None].expand(-1, P), dt_softplus=True,
                state_batch_indices=slots[n_p:n_p + n_d], out=out)
            outs.extend(out.unbind(0))
        return torch.stack(outs), None


    def verify(self, inp, layer_cache, md):
        """The verify rows (n_d rows of T tokens, no prefill rows) exactly as
        mamba.py:703-737 passes them to selective_state_update."""
        from sglang.srt.layers.attention.mamba import mamba as mamba_module

        H, P, N = M2["H"], M2["P"], M2["N"]
        n, T = md.num_decodes, md.draft_token_num
        out = torch.empty(n * T, H, P)
        mamba_module.selective_state_update(
            layer_cache.temporal, inp["x"].view(n, T, H, P),
            inp["dt"][:, :, None].expand(-1, -1, P).view(n, T, H, P),
            self.A[:, None, None].expand(-1, P, N), inp["B"].view(n, T, M2["G"], N),
            inp["C"].view(n, T, M2["G"], N), self.D[:, None].expand(-1, P), z=None,
            dt_bias=self.dt_bias[:, None].expand(-1, P), dt_softplus=True,
            state_batch_indices=md.mamba_cache_indices[:n], out=out.view(n, T, H, P),
            disable_state_update=True, intermediate_states_buffer=layer_cache.intermediate_ssm,
            cache_steps=T, retrieve_parent_token=md.retrieve_parent_token,
            intermediate_state_indices=torch.arange(n, dtype=torch.int32))
        return out


class Truth:
    """Float64 eager recurrence per request and layer."""

    def __init__(self, layers, H, P, N):
        self.h = {}
        self.shape = (H, P, N)
        self.layers = layers

    def start(self, rid):
        for lid in self.layers:
            self.h[(rid, lid)] = torch.zeros(1, *self.shape, dtype=torch.float64)


def mamba2_truth_step(truth, rid, lid, mixer, tok):
    return reference.selective_state_update_ref(
        truth.h[(rid, lid)], tok["x"][None], tok["dt"][None], mixer.A, tok["B"][None],
        tok["C"][None], mixer.D, dt_bias=mixer.dt_bias,
        state_batch_indices=torch.zeros(1, dtype=torch.int32))[0]


def mamba2_token(g):
    H, P, N, G = M2["H"], M2["P"], M2["N"], M2["G"]
    return dict(x=bf16(H, P, g=g), dt=torch.randn(H, generator=g) * 0.5,
                B=bf16(G, N, scale=0.5, g=g), C=bf16(G, N, scale=0.5, g=g))


def stack(tokens):
    return {k: torch.stack([t[k] for t in tokens]) for k in tokens[0]}


@pytest.fixture
def ssu_hook(monkeypatch):
    from sglang.srt.layers.attention.mamba import mamba as mamba_module

    monkeypatch.setattr(backends, "_STOCK_SSU", mamba_module.selective_state_update)
    monkeypatch.setattr(mamba_module, "selective_state_update", backends.selective_state_update)


class Harness:
    """Drives a backend through scheduler-like steps and checks every output."""

    def __init__(self, monkeypatch, family, cfg, seed, conv_dtype=None, drafts=None, topk=None,
                 **pool_kwargs):
        self.g = torch.Generator().manual_seed(seed)
        self.family = family
        params = mamba2_params(torch.float32) if family == "mamba2" else gdn_params(torch.float32)
        if conv_dtype is not None:
            params = dataclasses.replace(params, dtype=dataclasses.replace(params.dtype,
                                                                           conv=conv_dtype))
        self.r2t = make_pool(monkeypatch, params, family, cfg, drafts, topk, **pool_kwargs)
        self.pool = self.r2t.mamba_pool
        cls = backends.ReplayMamba2AttnBackend if family == "mamba2" else backends.ReplayGDNAttnBackend
        be = cls.__new__(cls)  # the stock __init__ needs a ModelRunner; set what forward reads
        be.req_to_token_pool = self.r2t
        be.replay = backends._ReplayStep(self.r2t, family)
        if family == "gdn":
            be.kernel_dispatcher = backends._ReplayGDNDispatcher(SimpleNamespace())
        monkeypatch.setattr(cls, "_use_triton_causal_conv", lambda self, flag: flag, raising=False)
        self.be = be
        if family == "mamba2":
            self.layers = {lid: StandInMixer(self.g) for lid in LAYERS}
            self.truth = Truth(LAYERS, M2["H"], M2["P"], M2["N"])
        else:
            self.layers = {lid: GDNLayer(lid, self.g) for lid in LAYERS}
            self.truth = Truth(LAYERS, GDN["HV"], GDN["V"], GDN["K"])
        self.reqs = {}
        self.expected_fill = {}

    # -- scheduler side --
    def admit(self, rid):
        r = req()
        self.r2t.alloc([r])
        # SGLang defers the clear to the forward stream (model_runner.py:1478-1524)
        self.pool.clear_slots(torch.tensor([r.mamba_pool_idx]))
        self.reqs[rid] = r
        self.expected_fill[rid] = 0
        self.truth.start(rid)
        return r

    def slot(self, rid):
        return int(self.reqs[rid].mamba_pool_idx) if rid is not None else -1

    def token(self):
        return mamba2_token(self.g) if self.family == "mamba2" else gdn_token(self.g)

    def step(self, prefill=(), decode=(), track=None):
        """prefill: [(rid, n_tokens)], decode: [rid or None (= padded row)];
        track: {rid: track slot}, the radix cache's extra_buffer snapshots
        this step takes (a prefill row's: its final state, as SGLang's extend
        tracking copies it at an aligned end; a decode row's: after the step)."""
        tokens, expect = [], []
        for rid, n in prefill:
            for _ in range(n):
                tokens.append(self.token())
        for rid in decode:
            tokens.append(self.token())
        slots = torch.tensor([self.slot(r) for r, _ in prefill] + [self.slot(r) for r in decode],
                             dtype=torch.int32)
        md = SimpleNamespace(mamba_cache_indices=slots, num_prefills=len(prefill),
                             num_decodes=len(decode), is_target_verify=False,
                             extend_lens=[n for _, n in prefill], has_mamba_track_mask=False)
        self.track_mask = None
        if track:
            rows = [r for r, _ in prefill] + list(decode)
            self.track_mask = torch.tensor([r in track for r in rows])
            md.mamba_track_indices = torch.tensor([track.get(r, 0) for r in rows])
            ext = [(self.slot(r), track[r]) for r, _ in prefill if r in track]
            md.has_mamba_track_mask = bool(ext)
            md.track_ssm_h_src = md.track_ssm_h_dst = torch.zeros(0, dtype=torch.int64)
            md.track_ssm_final_src = torch.tensor([s for s, _ in ext], dtype=torch.int64)
            md.track_ssm_final_dst = torch.tensor([d for _, d in ext], dtype=torch.int64)
        self.be.forward_metadata = md
        for lid in LAYERS:
            got = self.run_layer(lid, md, stack(tokens))
            t = 0
            rows = [(rid, n) for rid, n in prefill] + [(rid, 1) for rid in decode]
            for rid, n in rows:
                for _ in range(n):
                    if rid is not None:
                        want = self.truth_step(rid, lid, tokens[t])
                        torch.testing.assert_close(got[t].double(), want, **TOL)
                    t += 1
        # the cursor protocol: extend rows end flushed; decode rows advance by
        # one (GDN runs the decode rows of a mixed batch as extends)
        for rid, _ in prefill:
            self.expected_fill[rid] = 0
        for rid in decode:
            if rid is not None:
                mixed_as_extend = self.family == "gdn" and prefill
                self.expected_fill[rid] = 0 if mixed_as_extend else (
                    self.expected_fill[rid] + 1) % L
        for rid in self.reqs:
            assert self.fill(rid) == self.expected_fill[rid], rid

    def run_layer(self, lid, md, inp):
        fb = SimpleNamespace(mamba_track_mask=self.track_mask, forward_mode=SimpleNamespace(
            is_target_verify=lambda: False))
        if self.family == "mamba2":
            return self.be.forward(self.layers[lid], inp, None, lid, fb)
        layer = self.layers[lid]
        if md.num_prefills:
            return self.be.forward_extend(layer, fb, inp, None, None)
        return self.be.forward_decode(layer, fb, inp, None, None)

    def truth_step(self, rid, lid, tok):
        if self.family == "mamba2":
            return mamba2_truth_step(self.truth, rid, lid, self.layers[lid], tok)
        return gdn_truth_step(self.truth, rid, lid, self.layers[lid], tok)

    def unflushed(self, rid, others=()):
        """Decode ``rid`` until its buffer holds something."""
        while self.fill(rid) == 0:
            self.step(decode=[rid, *others])

    def fill(self, rid):
        return int(self.pool.fill[self.slot(rid)])


def scenario(h: Harness):
    a, b = h.admit("a"), h.admit("b")
    h.step(prefill=[("a", 3), ("b", 5)])
    assert h.fill("a") == h.fill("b") == 0
    for i in range(6):  # decode across a flush (L = 4), with a padded row
        h.step(decode=["a", None, "b"])
    # mixed batch: a new request's prefill beside two decoding ones with
    # partly filled buffers
    h.admit("c")
    h.step(prefill=[("c", 2)], decode=["a", "b"])
    # chunked prefill whose last chunk is one token
    h.admit("d")
    h.step(prefill=[("d", 3)], decode=["a"])
    h.step(prefill=[("d", 1)], decode=["b", "c"])
    for _ in range(3):
        h.step(decode=["a", "b", "c", "d"])
    # retraction and resume through the CPU copy (unflushed buffer kept)
    h.unflushed("b")
    slot_b = torch.tensor([h.slot("b")])
    saved = h.pool.get_cpu_copy(slot_b)
    h.pool.clear_slots(slot_b)
    h.pool.load_cpu_copy(saved, slot_b)
    for _ in range(4):
        h.step(decode=["b", "a"])
    # radix-style reuse: an unflushed slot is copied (copy_from) and the copy
    # then extends: the buffer must be folded before the scan
    h.unflushed("a", others=["b"])
    e = req()
    h.r2t.alloc([e])
    h.reqs["e"] = e
    h.expected_fill["e"] = h.expected_fill["a"]
    h.pool.copy_from(torch.tensor([h.slot("a")]), torch.tensor([h.slot("e")]))
    for lid in LAYERS:
        h.truth.h[("e", lid)] = h.truth.h[("a", lid)].clone()
    h.step(prefill=[("e", 2)], decode=["a", "b"])
    for _ in range(4):
        h.step(decode=["e", None, "a", "c"])
    # free and reuse a slot: the new request starts from a clean checkpoint
    h.r2t.free_mamba_cache(h.reqs.pop("d"))
    h.expected_fill.pop("d")
    h.admit("f")
    h.step(prefill=[("f", 2)], decode=["e"])
    h.step(decode=["f", "e"])


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("route", ["auto", "split"])
def test_mamba2_backend_protocol(monkeypatch, ssu_hook, route):
    scenario(Harness(monkeypatch, "mamba2", ReplayConfig(buffer_len=L, decode_route=route),
                     seed=0))


@PADDED_ROW_GARBAGE
def test_mamba2_backend_protocol_fold_copy(monkeypatch, ssu_hook):
    # bf16 checkpoint read by decode, fp32 fold copy carries the recurrence:
    # outputs within bf16 rounding of the checkpoint, the state stays exact
    cfg = ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16", fold_dtype="float32")
    h = Harness(monkeypatch, "mamba2", cfg, seed=1)
    monkeypatch.setitem(TOL, "rtol", 3e-2)
    monkeypatch.setitem(TOL, "atol", 3e-2)
    scenario(h)
    c = h.pool.mamba_cache
    live = [h.slot(r) for r in h.reqs]
    for lid_i, lid in enumerate(LAYERS):
        for rid in h.reqs:
            if h.fill(rid) == 0:  # flushed: the fold copy is the state itself
                torch.testing.assert_close(c.checkpoint_fold[lid_i, h.slot(rid)].double(),
                                           h.truth.h[(rid, lid)][0], rtol=1e-4, atol=1e-5)
    assert live


def test_stock_selective_state_update_outside_replay_layers(monkeypatch, ssu_hook):
    """Other models (or layers) in the process still get SGLang's function."""
    seen = {}
    monkeypatch.setattr(backends, "_STOCK_SSU", lambda *a, **k: seen.setdefault("called", True))
    backends.selective_state_update(*([None] * 6))
    assert seen == {"called": True}


def test_replay_step_checks_the_pool(monkeypatch):
    r2t = make_pool(monkeypatch, mamba2_params(), "mamba2", ReplayConfig(buffer_len=L))
    with pytest.raises(RuntimeError, match="built for 'mamba2' layers"):
        backends._ReplayStep(r2t, "gdn")
    assert backends._ReplayStep(r2t, "mamba2").pool is r2t.mamba_pool


def track_scenario(h: Harness):
    """The radix cache's extra_buffer snapshots: a prefill's final state and
    a decode step's whole slot (checkpoint, fold copy, buffer mid-fill,
    cursors) copied into track slots that held another request's stale
    state; each snapshot then serves as a cached prefix (a new request
    continuing from it, checked against the float64 truth), beside the
    request it was taken from and one that was never tracked."""
    h.admit("a"), h.admit("b")
    stale = h.admit("s")  # its slot becomes a track slot: a stale buffer and cursors
    h.step(prefill=[("a", 3), ("b", 2), ("s", 2)])
    for _ in range(L + 1):
        h.step(decode=["a", "s"])
    dst = h.slot("s")
    assert h.fill("s") != 0
    h.reqs.pop("s"), h.expected_fill.pop("s")
    # a prefill row's final state tracked (the conv kernel's own tracking and
    # SGLang's copy of the scan's state; the buffer left stale is emptied)
    h.admit("c")
    h.step(prefill=[("c", 3)], decode=["a", "b"], track={"c": dst})
    adopt(h, "c", dst, "t1")
    for _ in range(3):
        h.step(decode=["t1", "c", "a"])
    # a decode row's whole slot, its buffer part full
    t2 = req()
    h.r2t.alloc([t2])
    while not 0 < h.fill("a") < L - 1:  # part full after the tracked step too
        h.step(decode=["a", "t1"])
    h.step(decode=["t1", "a", "b"], track={"a": int(t2.mamba_pool_idx)})
    src, dst2 = h.slot("a"), int(t2.mamba_pool_idx)
    assert h.fill("a") != 0
    for t in h.pool.slot_tensors():
        assert torch.equal(t[:, dst2], t[:, src])
    adopt(h, "a", dst2, "t2", r=t2)
    for _ in range(L + 1):  # across a flush of the snapshot's own buffer
        h.step(decode=["t2", "a", "b", "t1"])


def adopt(h: Harness, src_rid, slot, rid, r=None):
    """A request continuing from the snapshot in ``slot`` of ``src_rid``'s state."""
    if r is None:
        r = req()
        h.r2t.alloc([r])
        r.mamba_pool_idx.fill_(slot)  # the track slot donated to the cache, then matched
    h.reqs[rid] = r
    h.expected_fill[rid] = h.expected_fill[src_rid]
    for lid in LAYERS:
        h.truth.h[(rid, lid)] = h.truth.h[(src_rid, lid)].clone()


def _track_config(monkeypatch, fold: bool) -> ReplayConfig:
    if not fold:
        return ReplayConfig(buffer_len=L)
    # outputs within bf16 rounding of the read copy (the fold copy stays exact:
    # a drifting one would grow the error flush after flush)
    monkeypatch.setitem(TOL, "rtol", 3e-2)
    monkeypatch.setitem(TOL, "atol", 3e-2)
    return ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16", fold_dtype="float32")


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("fold", [False, True], ids=["fp32", "fold-copy"])
def test_mamba2_radix_track_snapshots(monkeypatch, ssu_hook, fold):
    track_scenario(Harness(monkeypatch, "mamba2", _track_config(monkeypatch, fold), seed=5))


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("fold", [False, True], ids=["fp32", "fold-copy"])
def test_gdn_radix_track_snapshots(monkeypatch, gdn_stock_bodies, fold):
    track_scenario(Harness(monkeypatch, "gdn", _track_config(monkeypatch, fold), seed=6))


# -------------------------------------------------------------------- GDN --

class GDNLayer:
    """What GDNAttnBackend reads from a RadixLinearAttention layer."""

    def __init__(self, layer_id, g):
        HV = GDN["HV"]
        self.layer_id = layer_id
        self.A_log = torch.randn(HV, generator=g) * 0.5
        self.dt_bias = torch.randn(HV, generator=g) * 0.3
        self.head_k_dim = GDN["K"]
        self.num_v_heads = HV
        self.head_v_dim = GDN["V"]
        self.num_k_heads = GDN["Hk"]
        # the causal conv's parameters (the tests stand in for the conv or set them)
        self.conv_weights = self.bias = None
        self.activation = "silu"


def gdn_token(g):
    Hk, K, HV, V = GDN["Hk"], GDN["K"], GDN["HV"], GDN["V"]
    return dict(qkv=bf16(2 * Hk * K + HV * V, g=g), a=bf16(HV, g=g), b=bf16(HV, g=g))


def _gdn_ref(h, layer, tok):
    """One float64 packed-decode step of one request on state h [1, HV, V, K]."""
    return reference.gdn_packed_decode_ref(
        h, tok["qkv"][None], tok["a"][None], tok["b"][None], layer.A_log, layer.dt_bias,
        GDN["K"] ** -0.5, torch.zeros(1, dtype=torch.int32), GDN["Hk"], GDN["HV"], GDN["K"],
        GDN["V"])[0]


def gdn_truth_step(truth, rid, lid, layer, tok):
    return _gdn_ref(truth.h[(rid, lid)], layer, tok)


@pytest.fixture
def gdn_stock_bodies(monkeypatch):
    """GDNAttnBackend's decode/extend reduced to their SSM call (no conv)."""

    def forward_decode(self, layer, forward_batch, mixed_qkv, a, b, **kw):
        out = self.kernel_dispatcher.packed_decode(
            mixed_qkv["qkv"], mixed_qkv["a"], mixed_qkv["b"], A_log=layer.A_log,
            dt_bias=layer.dt_bias, scale=layer.head_k_dim ** -0.5,
            ssm_states=None, cache_indices=self.forward_metadata.mamba_cache_indices,
            num_v_heads=layer.num_v_heads, head_v_dim=layer.head_v_dim)
        return out[0]

    def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kw):
        # chunk scan from the checkpoint (initial_state=ssm_states), final state written back
        md = self.forward_metadata
        state = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id).temporal
        outs, t = [], 0
        lens = list(md.extend_lens) + [1] * md.num_decodes
        for r, n in enumerate(lens):
            s = int(md.mamba_cache_indices[r])
            h = state[s:s + 1].to(torch.float64).clone()
            for _ in range(n):
                outs.append(_gdn_ref(h, layer, {k: v[t] for k, v in mixed_qkv.items()}).float())
                t += 1
            state[s] = h[0].to(state.dtype)
        if forward_batch.mamba_track_mask is not None:  # as the stock body ends
            self._track_mamba_state_extend(forward_batch, None, state, md)
        return torch.stack(outs)

    monkeypatch.setattr(GDNAttnBackend, "forward_decode", forward_decode)
    monkeypatch.setattr(GDNAttnBackend, "forward_extend", forward_extend)


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("route", ["auto", "split"])
def test_gdn_backend_protocol(monkeypatch, gdn_stock_bodies, route):
    scenario(Harness(monkeypatch, "gdn", ReplayConfig(buffer_len=L, decode_route=route), seed=2))


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("route", ["auto", "split"])
def test_gdn_backend_protocol_fold_copy(monkeypatch, gdn_stock_bodies, route):
    """bf16 read copy + fp32 fold copy through the whole scenario (mixed
    batches, chunked prefill, retraction, copy_from, reuse): the prefill scan
    runs on the fold copy, flushes recompute u from it, so wherever a row is
    flushed the fold copy is the float64 state to fp32 accuracy."""
    cfg = ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16", fold_dtype="float32",
                       decode_route=route)
    h = Harness(monkeypatch, "gdn", cfg, seed=3)
    monkeypatch.setitem(TOL, "rtol", 3e-2)
    monkeypatch.setitem(TOL, "atol", 3e-2)
    scenario(h)
    c = h.pool.mamba_cache
    checked = 0
    for lid_i, lid in enumerate(LAYERS):
        for rid in h.reqs:
            if h.fill(rid) == 0:
                torch.testing.assert_close(c.checkpoint_fold[lid_i, h.slot(rid)].double(),
                                           h.truth.h[(rid, lid)][0], rtol=1e-4, atol=1e-5)
                checked += 1
    assert checked


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("route", ["auto", "split"])
def test_gdn_decode_through_the_stock_body(monkeypatch, route):
    """GDNAttnBackend.forward_decode as shipped (causal conv update, then the
    kernel dispatcher's packed decode) with ReplaySSM answering the packed
    decode: outputs vs the stock conv + float64 packed-decode recurrence."""
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    Hk, K, HV, V = GDN["Hk"], GDN["K"], GDN["HV"], GDN["V"]
    dim = 2 * Hk * K + HV * V
    g = torch.Generator().manual_seed(5)
    h = Harness(monkeypatch, "gdn", ReplayConfig(buffer_len=L, decode_route=route), seed=5)
    layers = {}
    for lid in LAYERS:
        lay = h.layers[lid]
        lay.conv_weights = torch.randn(dim, 4, generator=g) * 0.5
        lay.bias = torch.randn(dim, generator=g) * 0.1
        lay.activation = "silu"
        layers[lid] = lay
    rids = ["a", "b", "c"]
    for rid in rids:
        h.admit(rid)
    conv_truth = {(rid, lid): torch.zeros(1, dim, 3) for rid in rids for lid in LAYERS}
    fb = SimpleNamespace(mamba_track_mask=None, batch_size=4)
    for step in range(2 * L + 1):
        rows = ["a", None, "b", "c"] if step != 3 else ["c", "a", None, "b"]
        slots = torch.tensor([h.slot(r) for r in rows], dtype=torch.int32)
        h.be.forward_metadata = SimpleNamespace(
            mamba_cache_indices=slots, query_start_loc=torch.arange(5, dtype=torch.int32),
            replayssm_write_pos=None, replayssm_force_flush=None)
        for lid in LAYERS:
            lay = layers[lid]
            qkv = bf16(4, dim, g=g)
            a, b = bf16(4, HV, g=g), bf16(4, HV, g=g)
            got = h.be.forward_decode(lay, fb, qkv.clone(), a, b)  # [1, 4, HV, V]
            assert got.shape == (1, 4, HV, V)
            for i, rid in enumerate(rows):
                if rid is None:
                    continue
                post = causal_conv1d_update(
                    qkv[i:i + 1].clone(), conv_truth[(rid, lid)], lay.conv_weights, lay.bias,
                    "silu", conv_state_indices=torch.zeros(1, dtype=torch.int32))
                want = _gdn_ref(h.truth.h[(rid, lid)], lay,
                                {"qkv": post[0], "a": a[i], "b": b[i]})
                torch.testing.assert_close(got[0, i].double(), want, **TOL)
    assert [h.fill(r) for r in rids] == [(2 * L + 1) % L] * 3


class _OutProjStandIn(torch.nn.Module):
    """RowParallelLinear needs a TP group; the SSM path ends before it."""

    def forward(self, x):
        return x, None


@pytest.fixture
def stock_mixer_hooks(monkeypatch, ssu_hook):
    """SGLang's MambaMixer2 runnable on CPU: its Triton causal conv bound
    (mamba.py binds it only when CUDA is present), and outside ReplaySSM
    layers the float64 stock recurrence as selective_state_update."""
    from sglang.kernels.ops.mamba import causal_conv1d_triton
    from sglang.srt.layers.attention.mamba import mamba as mamba_module

    monkeypatch.setattr(mamba_module, "causal_conv1d_update_triton",
                        causal_conv1d_triton.causal_conv1d_update, raising=False)

    def stock_ssu(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                  state_batch_indices=None, pad_slot_id=-1, out=None, **kw):
        y = reference.selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias,
                                                 dt_softplus, state_batch_indices)
        out.copy_(y.to(out.dtype))

    monkeypatch.setattr(backends, "_STOCK_SSU", stock_ssu)


def close_to_scale(got, want, rel=5e-2):
    """Equal to ``rel`` of the outputs' scale: the bf16 buffer's rounding of
    x and B moves a few outputs by up to ~2% of it here, while a state that
    misses or counts one token moves them by their own order (10x)."""
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * float(want.abs().max()))


def stock_mixer(params, hidden, seed):
    """SGLang's MambaMixer2 with weights under which the state matters: at
    the dummy init's trained-model scale a token's state term is ~1e-4 of
    its skip term at this hidden size, below the tolerance of a bf16 buffer,
    so a wrong state would pass. Here the skip is off (D = 0), the input
    projection 10x and the step dt ~ 0.3-1, so the outputs are the state's."""
    from sglang.srt.layers.attention.mamba import mamba as mamba_module
    from sglang.srt.runtime_context import get_parallel

    from sglang_replayssm.dummy_init import scaled_dummy_weights

    with get_parallel().override(attn_tp_size=1, tp_size=1, tp_rank=0):
        mixer = mamba_module.MambaMixer2(
            cache_params=params, hidden_size=hidden, use_conv_bias=True, use_bias=False,
            n_groups=M2["G"], prefix=f"layers.{seed}.mixer")
    scaled_dummy_weights(mixer, seed=seed)
    with torch.no_grad():
        mixer.in_proj.weight.mul_(10.0)
        mixer.D.zero_()
        g = torch.Generator().manual_seed(seed)
        mixer.dt_bias.copy_(torch.rand(mixer.dt_bias.shape, generator=g) * 0.8)
        mixer.A.copy_(-(torch.rand(mixer.A.shape, generator=g) * 1.5 + 0.1))
    mixer.out_proj = _OutProjStandIn()
    return mixer


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("route", ["auto", "split"])
def test_mamba2_decode_through_the_stock_mixer(monkeypatch, stock_mixer_hooks, route):
    """SGLang's own MambaMixer2.forward (in_proj, causal conv, the decode call
    of selective_state_update, gated RMS norm) run by ReplayMamba2AttnBackend,
    against the same mixer on a copy of the state with the float64 stock
    recurrence as its selective_state_update."""
    # fp32 activations and conv state: the Triton interpreter garbles bf16 in
    # SGLang's causal conv (the buffer's bf16 x/B rounding then sets the tolerance)
    h = Harness(monkeypatch, "mamba2", ReplayConfig(buffer_len=L, decode_route=route), seed=6,
                conv_dtype=torch.float32)
    params = mamba2_params()
    hidden = 32
    mixers = {lid: stock_mixer(params, hidden, lid) for lid in LAYERS}
    rids = ["a", "b"]
    for rid in rids:
        h.admit(rid)
    c = h.pool.mamba_cache
    stock_conv = {lid: c.conv[0][i].clone() for i, lid in enumerate(LAYERS)}
    stock_state = {lid: c.temporal[i].clone() for i, lid in enumerate(LAYERS)}
    g = torch.Generator().manual_seed(6)
    fb = SimpleNamespace(mamba_track_mask=None)
    for step in range(2 * L + 1):
        rows = ["a", None, "b"] if step % 3 else ["b", "a", None]
        slots = torch.tensor([h.slot(r) for r in rows], dtype=torch.int32)
        md = SimpleNamespace(mamba_cache_indices=slots, query_start_loc=torch.arange(4, dtype=torch.int32),
                             num_prefills=0, num_decodes=3, num_prefill_tokens=0,
                             is_target_verify=False, draft_token_num=1,
                             has_mamba_track_mask=False, mixed_metadata=None)
        h.be.forward_metadata = md
        with torch.no_grad():
            for lid in LAYERS:
                hs = bf16(3, hidden, g=g)
                got = h.be.forward(mixers[lid], hs, None, lid, fb, use_triton_causal_conv=True)
                stock_cache = SimpleNamespace(conv=[stock_conv[lid]], temporal=stock_state[lid],
                                              intermediate_ssm=None)
                want, _ = mixers[lid].forward(hidden_states=hs, layer_cache=stock_cache,
                                              metadata=md, use_triton_causal_conv=True)
                live = [i for i, r in enumerate(rows) if r is not None]
                close_to_scale(got[live], want[live])
    assert [h.fill(r) for r in rids] == [(2 * L + 1) % L] * 2
    # the checkpoint equals the stock state right after a flush of every row
    for i, lid in enumerate(LAYERS):
        for rid in rids:
            s = h.slot(rid)
            if h.fill(rid) == 0:
                torch.testing.assert_close(c.temporal[i, s], stock_state[lid][s],
                                           rtol=1e-4, atol=1e-6)


# ------------------------------------------------------ speculative verify --

def _apply(h, lid, state, tok):
    """One float64 step of layer ``lid`` on a [1, ...] state (updated in place)."""
    lay = h.layers[lid]
    if h.family == "mamba2":
        return reference.selective_state_update_ref(
            state, tok["x"][None], tok["dt"][None], lay.A, tok["B"][None], tok["C"][None],
            lay.D, dt_bias=lay.dt_bias, state_batch_indices=torch.zeros(1, dtype=torch.int32))[0]
    return _gdn_ref(state, lay, tok)


def _conv_window_scatter(dst, src, dst_indices, step_indices):
    """SGLang's fused_conv_window_scatter_with_mask (CUDA only) in PyTorch:
    conv state of slot dst_indices[i] = window of batch row i after draft
    step_indices[i], every layer."""
    for i, (slot, step) in enumerate(zip(dst_indices.tolist(), step_indices.tolist())):
        if slot >= 0 and step >= 0:
            dst[:, slot] = src[:, i, step]


class _VerifyConv:
    """GDN's causal conv of a verify, as the backend calls it: returns the
    (already post-conv) input, fills a tree's retrieve_parent_token as the
    Triton conv does (the root's entry left unset) and marks the window it
    writes after draft t of batch row i with the value 10 * i + t + 1."""

    def __init__(self):
        self.parents = None

    def __call__(self, x, conv_state, weight, bias, activation, *, conv_state_indices,
                 intermediate_conv_window, intermediate_state_indices, retrieve_next_token,
                 retrieve_next_sibling, retrieve_parent_token):
        batch, _, T = x.shape
        if retrieve_parent_token is not None:
            retrieve_parent_token[:, 1:] = self.parents[:, 1:]
        for i in range(batch):
            for t in range(T):
                intermediate_conv_window[int(intermediate_state_indices[i]), t] = 10 * i + t + 1
        return x


def verify_step(h, rows, T, tree, conv, track=None):
    """One verify of T drafts for ``rows`` (trailing None = padded rows, as
    CUDA graphs pad), every output against the float64 recurrence along its
    draft's path; then a random acceptance, the commit SGLang's spec worker
    reaches, and the cursors, conv states and truth it leaves. ``track``
    {rid: track slot}: the radix cache's extra_buffer snapshot of that row at
    a random accepted draft (SGLang's mamba_steps_to_track); returns then
    also {rid: (fill, truth)} of each snapshot."""
    from draft_trees import path_to, random_tree

    n = len(rows)
    live = [r for r in rows if r is not None]
    trees = [random_tree(h.g, T) if tree else [-1] + list(range(T - 1)) for _ in rows]
    tokens = [[h.token() for _ in range(T)] for _ in rows]
    inp = stack([t for row in tokens for t in row])
    slots = torch.tensor([h.slot(r) for r in rows], dtype=torch.int32)
    parents = torch.tensor(trees, dtype=torch.int64)
    md = SimpleNamespace(
        mamba_cache_indices=slots, num_prefills=0, num_decodes=n, is_target_verify=True,
        draft_token_num=T, extend_lens=[],
        retrieve_parent_token=torch.full((n, T), 99, dtype=torch.int64) if tree else None,
        retrieve_next_token=None, retrieve_next_sibling=None)
    h.be.forward_metadata = md
    fb = SimpleNamespace(mamba_track_mask=None, spec_info=SimpleNamespace(draft_token_num=T),
                         forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    conv.parents = parents
    for lid in LAYERS:
        if h.family == "mamba2":
            if tree:  # the mixer's causal conv fills it before the state update
                md.retrieve_parent_token[:, 1:] = parents[:, 1:]
            got = h.be.forward(h.layers[lid], inp, None, lid, fb)
        else:
            got = h.be.forward_extend(h.layers[lid], fb, inp["qkv"], inp["a"], inp["b"])
            assert got.shape == (1, n * T, GDN["HV"], GDN["V"])
            got = got[0]
        for i, rid in enumerate(rows):
            if rid is None:
                continue
            for j in range(T):
                state = h.truth.h[(rid, lid)].clone()
                for k in path_to(trees[i], j):
                    want = _apply(h, lid, state, tokens[i][k])
                torch.testing.assert_close(got[i * T + j].double(), want, **TOL)
    last = torch.randint(0, T, (len(live),), generator=h.g)
    fills = [h.fill(r) for r in live]
    track = track or {}
    depth = {rid: int(torch.randint(0, len(path_to(trees[i], int(last[i]))), (1,),
                                    generator=h.g)) for i, rid in enumerate(live) if rid in track}
    steps = torch.tensor([path_to(trees[i], int(last[i]))[depth[rid]] if rid in track else -1
                          for i, rid in enumerate(live)])
    track_slots = torch.tensor([track.get(rid, 0) for rid in live])
    assert backends.commit_after_verify(h.be, last, *((track_slots, steps) if track else ()))
    snapshots = {}
    for i, rid in enumerate(live):
        path = path_to(trees[i], int(last[i]))
        truth = {}
        for lid in LAYERS:
            for d, k in enumerate(path):
                _apply(h, lid, h.truth.h[(rid, lid)], tokens[i][k])
                if rid in track and d == depth[rid]:
                    truth[lid] = h.truth.h[(rid, lid)].clone()
        f = fills[i]
        h.expected_fill[rid] = len(path) if f + T >= L_SPEC else f + len(path)
        if h.family == "gdn":  # the conv state is the window after the last accepted draft
            for c in h.pool.mamba_cache.conv:
                assert bool((c[:, h.slot(rid)] == 10 * i + int(last[i]) + 1).all())
        if rid in track:
            dst, fill = track[rid], h.expected_fill[rid] - len(path) + depth[rid] + 1
            assert int(h.pool.fill[dst]) == fill
            for c in h.pool.mamba_cache.conv if h.family == "gdn" else ():
                assert bool((c[:, dst] == 10 * i + int(steps[i]) + 1).all())
            snapshots[rid] = (fill, truth)
    for rid in h.reqs:
        assert h.fill(rid) == h.expected_fill[rid], rid
    acc = [len(path_to(trees[i], int(last[i]))) for i in range(len(live))]
    return (acc, fills, snapshots) if track else (acc, fills)


L_SPEC = 6  # buffer_len of the verify tests: T = 3 drafts, ring capacity 8


def spec_harness(monkeypatch, family, tree, T, seed):
    """A Harness for T-draft verifies through the backends (SGLang's CUDA-only
    conv-window scatter in PyTorch, GDN's verify conv stood in for) with
    requests a and b prefilled. Returns (harness, the stand-in conv)."""
    from sglang.kernels.ops.mamba import mamba_state_scatter_triton
    from sglang.srt.layers.attention.linear import gdn_backend

    monkeypatch.setattr(mamba_state_scatter_triton, "fused_conv_window_scatter_with_mask",
                        _conv_window_scatter)
    conv = _VerifyConv()
    monkeypatch.setattr(gdn_backend, "causal_conv1d_update", conv, raising=False)
    h = Harness(monkeypatch, family, ReplayConfig(buffer_len=L_SPEC), seed=seed, drafts=T,
                topk=2 if tree else None)
    if family == "gdn":
        h.be.verify_intermediate_state_indices = torch.arange(SLOTS + 1, dtype=torch.int32)
    h.admit("a"), h.admit("b")
    h.step(prefill=[("a", 3), ("b", 2)])
    return h, conv


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_verify_and_commit(monkeypatch, ssu_hook, gdn_stock_bodies, family, tree):
    """Verify steps through the backends (Mamba-2: the mixer's verify call of
    selective_state_update; GDN: forward_extend in TARGET_VERIFY) and the
    post-verify commit SGLang's speculative workers reach
    (update_mamba_state_after_mtp_verify), chains and trees, random
    acceptance, a padded row, a prefill admitted between verifies, across
    flushes: every draft's output against the float64 recurrence along its
    path, the cursors after every commit."""
    T = 3
    h, conv = spec_harness(monkeypatch, family, tree, T, seed=11)
    accepted, flushed = [], 0
    for step in range(7):
        if step == 3:  # a new request's prefill between two verifies
            h.admit("c")
            h.step(prefill=[("c", 2)])
        rows = (["a", "b"] if step % 2 else ["b", "a"]) + (["c"] if step >= 3 else []) + [None]
        acc, fills = verify_step(h, rows, T, tree, conv)
        accepted += acc
        flushed += sum(f + T >= L_SPEC for f in fills)
    assert flushed >= 4 and set(accepted) == {1, 2, 3}


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("family", ["mamba2", "gdn"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_commit_radix_track_snapshots(monkeypatch, ssu_hook, gdn_stock_bodies,
                                                  family, tree):
    """The radix cache's extra_buffer snapshot in a verify's commit: a row's
    state at one of its accepted drafts (its buffer up to that draft, the
    conv window after it) copied into a track slot, which then serves as a
    cached prefix: a request continuing from it through more verifies,
    every draft checked against the float64 truth."""
    T = 3
    h, conv = spec_harness(monkeypatch, family, tree, T, seed=13)
    snaps = 0
    for step in range(6):
        t = req()
        h.r2t.alloc([t])
        rows = ["a", "b"] + [r for r in h.reqs if r.startswith("t")][-1:] + [None]
        _, _, shots = verify_step(h, rows, T, tree, conv, track={"a": int(t.mamba_pool_idx)})
        fill, truth = shots["a"]
        rid = f"t{step}"
        h.reqs[rid], h.expected_fill[rid] = t, fill
        for lid in LAYERS:
            h.truth.h[(rid, lid)] = truth[lid]
        snaps += 1
        if step >= 2:  # keep the pool's slots: retire the oldest snapshot
            old = h.reqs.pop(f"t{step - 2}")
            h.r2t.free_mamba_cache(old)
            h.r2t.free(old)
            h.expected_fill.pop(f"t{step - 2}")
    assert snaps == 6


def _sglang_tree(parents):
    """SGLang's links of a draft tree with one root (parents[0] = -1):
    retrieve_next_token[i] = i's first child, retrieve_next_sibling[i] = the
    next child of i's parent (-1 = none), as EAGLE builds them."""
    T = len(parents)
    nxt, sib = [-1] * T, [-1] * T
    for j in range(1, T):
        p = parents[j]
        if nxt[p] < 0:
            nxt[p] = j
        else:
            k = nxt[p]
            while sib[k] >= 0:
                k = sib[k]
            sib[k] = j
    return nxt, sib


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_mamba2_verify_through_the_stock_mixer(monkeypatch, stock_mixer_hooks, tree):
    """SGLang's own MambaMixer2.forward in TARGET_VERIFY (its causal conv
    with the per-draft conv windows and, for a tree, the parents it derives
    from retrieve_next_token / retrieve_next_sibling; its verify call of
    selective_state_update) run by ReplayMamba2AttnBackend, then the commit
    SGLang's speculative worker reaches, over verify steps with random
    acceptance: each draft's output against the same mixer decoding the
    draft's path one token at a time from the committed conv and SSM state
    (float64 stock recurrence), which the commit's conv rollback and cursor
    move must reproduce at the next verify."""
    from draft_trees import path_to
    from sglang.kernels.ops.mamba import mamba_state_scatter_triton

    monkeypatch.setattr(mamba_state_scatter_triton, "fused_conv_window_scatter_with_mask",
                        _conv_window_scatter)
    T = 3
    h = Harness(monkeypatch, "mamba2", ReplayConfig(buffer_len=L_SPEC), seed=13,
                conv_dtype=torch.float32, drafts=T, topk=2 if tree else None)
    params = mamba2_params()
    hidden = 32
    mixers = {lid: stock_mixer(params, hidden, lid) for lid in LAYERS}
    rids = ["a", "b"]
    for rid in rids:
        h.admit(rid)
    c = h.pool.mamba_cache
    # the committed (conv, ssm) state of each request and layer, decoded by the stock mixer
    ref = {(rid, lid): (torch.zeros(1, *c.conv[0].shape[2:]), torch.zeros(1, *c.temporal.shape[2:]))
           for rid in rids for lid in LAYERS}

    def decode(lid, conv, ssm, hs):
        """One stock decode step of one request on (conv, ssm), in place."""
        md = SimpleNamespace(mamba_cache_indices=torch.zeros(1, dtype=torch.int32),
                             query_start_loc=torch.arange(2, dtype=torch.int32), num_prefills=0,
                             num_decodes=1, num_prefill_tokens=0, is_target_verify=False,
                             draft_token_num=1, has_mamba_track_mask=False, mixed_metadata=None)
        out, _ = mixers[lid].forward(hidden_states=hs[None], layer_cache=SimpleNamespace(
            conv=[conv], temporal=ssm, intermediate_ssm=None), metadata=md,
            use_triton_causal_conv=True)
        return out[0]

    g = torch.Generator().manual_seed(13)
    fb = SimpleNamespace(mamba_track_mask=None)
    flushed = 0
    for step in range(5):
        rows = ["a", "b", None] if step % 2 else ["b", "a", None]
        n = len(rows)
        trees = []
        for _ in rows:
            trees.append([-1] + [int(torch.randint(0, j, (1,), generator=g)) if tree else j - 1
                                 for j in range(1, T)])
        links = [_sglang_tree(p) for p in trees]
        md = SimpleNamespace(
            mamba_cache_indices=torch.tensor([h.slot(r) for r in rows], dtype=torch.int32),
            query_start_loc=torch.arange(0, n * T + 1, T, dtype=torch.int32), num_prefills=0,
            num_decodes=n, num_prefill_tokens=0, is_target_verify=True, draft_token_num=T,
            has_mamba_track_mask=False, mixed_metadata=None,
            retrieve_next_token=torch.tensor([l[0] for l in links]) if tree else None,
            retrieve_next_sibling=torch.tensor([l[1] for l in links]) if tree else None,
            retrieve_parent_token=torch.full((n, T), 99, dtype=torch.int64) if tree else None)
        h.be.forward_metadata = md
        hs = {lid: bf16(n * T, hidden, g=g) for lid in LAYERS}
        with torch.no_grad():
            for lid in LAYERS:
                got = h.be.forward(mixers[lid], hs[lid], None, lid, fb, use_triton_causal_conv=True)
                for i, rid in enumerate(rows):
                    if rid is None:
                        continue
                    for j in range(T):
                        conv, ssm = (t.clone() for t in ref[(rid, lid)])
                        for k in path_to(trees[i], j):
                            want = decode(lid, conv, ssm, hs[lid][i * T + k])
                        close_to_scale(got[i * T + j], want)
            live = [i for i, r in enumerate(rows) if r is not None]
            last = torch.randint(0, T, (len(live),), generator=g)
            flushed += sum(h.fill(rows[i]) + T >= L_SPEC for i in live)
            assert backends.commit_after_verify(h.be, last)
            for i in live:
                for lid in LAYERS:
                    conv, ssm = ref[(rows[i], lid)]
                    for k in path_to(trees[i], int(last[i])):
                        decode(lid, conv, ssm, hs[lid][i * T + k])
                    # the conv rollback: the window after the last accepted draft
                    lay = LAYERS.index(lid)
                    torch.testing.assert_close(c.conv[0][lay, h.slot(rows[i])], conv[0],
                                               rtol=1e-6, atol=1e-6)
    assert flushed >= 2


@PADDED_ROW_GARBAGE
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_gdn_verify_through_the_stock_conv(monkeypatch, tree):
    """ReplayGDNAttnBackend's verify with SGLang's Triton causal conv (the
    per-draft conv windows, a tree's parents derived from its links), then
    the commit, over verify steps with random acceptance: each draft's output
    against the stock conv and the float64 packed-decode recurrence run
    token by token along the draft's path from the committed state."""
    from draft_trees import path_to
    from sglang.kernels.ops.mamba import mamba_state_scatter_triton
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update
    from sglang.srt.layers.attention.linear import gdn_backend

    monkeypatch.setattr(gdn_backend, "causal_conv1d_update", causal_conv1d_update)
    monkeypatch.setattr(mamba_state_scatter_triton, "fused_conv_window_scatter_with_mask",
                        _conv_window_scatter)
    Hk, K, HV, V = GDN["Hk"], GDN["K"], GDN["HV"], GDN["V"]
    dim = 2 * Hk * K + HV * V
    T = 3
    g = torch.Generator().manual_seed(17)
    h = Harness(monkeypatch, "gdn", ReplayConfig(buffer_len=L_SPEC), seed=17,
                conv_dtype=torch.float32, drafts=T, topk=2 if tree else None)
    h.be.verify_intermediate_state_indices = torch.arange(SLOTS + 1, dtype=torch.int32)
    for lid in LAYERS:
        lay = h.layers[lid]
        lay.conv_weights = torch.randn(dim, 4, generator=g) * 0.5
        lay.bias = torch.randn(dim, generator=g) * 0.1
    rids = ["a", "b"]
    for rid in rids:
        h.admit(rid)
    conv_truth = {(rid, lid): torch.zeros(1, dim, 3) for rid in rids for lid in LAYERS}

    def step_ref(rid, lid, conv, state, qkv, a, b):
        lay = h.layers[lid]
        post = causal_conv1d_update(qkv[None].clone(), conv, lay.conv_weights, lay.bias, "silu",
                                    conv_state_indices=torch.zeros(1, dtype=torch.int32))
        return _gdn_ref(state, lay, {"qkv": post[0], "a": a, "b": b})

    fb = SimpleNamespace(mamba_track_mask=None, spec_info=SimpleNamespace(draft_token_num=T),
                         forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    flushed = 0
    for step in range(5):
        rows = ["a", "b", None] if step % 2 else ["b", "a", None]
        n = len(rows)
        trees = [[-1] + [int(torch.randint(0, j, (1,), generator=g)) if tree else j - 1
                         for j in range(1, T)] for _ in rows]
        links = [_sglang_tree(p) for p in trees]
        h.be.forward_metadata = SimpleNamespace(
            mamba_cache_indices=torch.tensor([h.slot(r) for r in rows], dtype=torch.int32),
            retrieve_next_token=torch.tensor([l[0] for l in links]) if tree else None,
            retrieve_next_sibling=torch.tensor([l[1] for l in links]) if tree else None,
            retrieve_parent_token=torch.full((n, T), 99, dtype=torch.int64) if tree else None)
        inp = {lid: (bf16(n * T, dim, g=g), bf16(n * T, HV, g=g), bf16(n * T, HV, g=g))
               for lid in LAYERS}
        for lid in LAYERS:
            qkv, a, b = inp[lid]
            got = h.be.forward_extend(h.layers[lid], fb, qkv.clone(), a, b)[0]
            for i, rid in enumerate(rows):
                if rid is None:
                    continue
                for j in range(T):
                    conv, state = conv_truth[(rid, lid)].clone(), h.truth.h[(rid, lid)].clone()
                    for k in path_to(trees[i], j):
                        r = i * T + k
                        want = step_ref(rid, lid, conv, state, qkv[r], a[r], b[r])
                    torch.testing.assert_close(got[i * T + j].double(), want, **TOL)
        live = [i for i, r in enumerate(rows) if r is not None]
        last = torch.randint(0, T, (len(live),), generator=g)
        flushed += sum(h.fill(rows[i]) + T >= L_SPEC for i in live)
        assert backends.commit_after_verify(h.be, last)
        for i in live:
            rid = rows[i]
            for lid in LAYERS:
                qkv, a, b = inp[lid]
                for k in path_to(trees[i], int(last[i])):
                    r = i * T + k
                    step_ref(rid, lid, conv_truth[(rid, lid)], h.truth.h[(rid, lid)],
                             qkv[r], a[r], b[r])
                torch.testing.assert_close(
                    h.pool.mamba_cache.conv[0][LAYERS.index(lid), h.slot(rid)],
                    conv_truth[(rid, lid)][0], rtol=1e-6, atol=1e-6)
    assert flushed >= 2
