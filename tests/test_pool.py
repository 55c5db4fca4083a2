"""ReplayMambaPool built through SGLang's own HybridReqToTokenPool (CPU, tiny shapes)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool

from sglang_replayssm.config import ReplayConfig
from sglang_replayssm.pool import ReplayMambaPool, detect_family, replay_dims

LAYERS = [1, 3]  # model layer ids of the two mamba layers
SLOTS = 4
L = 6  # buffer_len -> capacity required_capacity(6, 1) = 6
CAP = 6
# Mamba-2: H=4, P=8, N=16, G=2 -> conv_dim 4*8 + 2*2*16 = 96
M2 = dict(H=4, P=8, N=16, G=2)
# GDN: Hk=2, K=16, HV=4, V=8 -> conv_dim 2*2*16 + 4*8 = 96
GDN = dict(Hk=2, K=16, HV=4, V=8)


def mamba2_params(ssm=torch.float32):
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=M2["H"] * M2["P"], n_groups=M2["G"],
        num_heads=M2["H"], head_dim=M2["P"], state_size=M2["N"], conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=LAYERS,
                             dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=ssm))


def gdn_params(ssm=torch.float32):
    """As Qwen3NextConfig.mamba2_cache_params (srt/configs/qwen3_next.py:287-313)."""
    key_dim, value_dim = GDN["K"] * GDN["Hk"], GDN["V"] * GDN["HV"]
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=value_dim, n_groups=GDN["Hk"],
        num_heads=GDN["HV"], head_dim=GDN["V"], state_size=GDN["K"], conv_kernel=4,
        conv_shard_groups=[key_dim, key_dim, value_dim])
    return Mamba2CacheParams(shape=shape, layers=LAYERS,
                             dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=ssm))


def build(monkeypatch, params, cfg, family=None, **kwargs):
    """kwargs override HybridReqToTokenPool's arguments below."""
    monkeypatch.setattr(HybridReqToTokenPool, "mamba_pool_cls",
                        ReplayMambaPool.with_config(cfg, family=family))
    r2t = HybridReqToTokenPool(**{
        **dict(size=SLOTS, mamba_size=SLOTS, mamba_spec_state_size=SLOTS, max_context_len=32,
               device="cpu", enable_memory_saver=False, cache_params=params,
               mamba_layer_ids=LAYERS, enable_mamba_extra_buffer=False,
               enable_overlap_schedule=False), **kwargs})
    assert type(r2t.mamba_pool).__mro__[1] is ReplayMambaPool
    return r2t


def req():
    return SimpleNamespace(req_pool_idx=None, mamba_pool_idx=None, mamba_needs_clear=False,
                           mamba_ping_pong_track_buffer=None, inflight_middle_chunks=0,
                           kv_committed_len=0)


def nbytes(t):
    return t.numel() * t.element_size()


def mamba2_fields(fold):
    H, P, N, G = M2["H"], M2["P"], M2["N"], M2["G"]
    f = {"x_buffer": ((H, CAP, P), torch.bfloat16),
         "B_buffer": ((G, CAP, N), torch.bfloat16),
         "dt_buffer": ((H, CAP), torch.float32)}
    if fold:
        f["checkpoint_fold"] = ((H, P, N), torch.float32)
    return f


def gdn_fields(ku, fold=False):
    Hk, K, HV, V = GDN["Hk"], GDN["K"], GDN["HV"], GDN["V"]
    f = {"k_buffer": ((Hk, CAP, K), torch.float32 if fold else ku),
         "u_buffer": ((HV, CAP, V), ku), "g_buffer": ((HV, CAP), torch.float32)}
    if fold:  # the precise copy and the raw inputs its flushes recompute u from
        f.update(checkpoint_fold=((HV, V, K), torch.float32),
                 v_buffer=((HV, CAP, V), torch.bfloat16), beta_buffer=((HV, CAP), torch.float32))
    return f


CASES = {
    # name: (params factory, config, family override, temporal dtype, expected replay fields)
    "mamba2_fp32": (mamba2_params, ReplayConfig(buffer_len=L), None, torch.float32,
                    mamba2_fields(False)),
    "mamba2_bf16_fold": (mamba2_params,
                         ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16",
                                      fold_dtype="float32"),
                         None, torch.bfloat16, mamba2_fields(True)),
    "gdn_fp32": (gdn_params, ReplayConfig(buffer_len=L), None, torch.float32,
                 gdn_fields(torch.float32)),
    "gdn_bf16": (gdn_params, ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16"), "gdn",
                 torch.bfloat16, gdn_fields(torch.bfloat16)),
    "gdn_bf16_fold": (gdn_params, ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16",
                                               fold_dtype="float32"),
                      "gdn", torch.bfloat16, gdn_fields(torch.bfloat16, fold=True)),
}


@pytest.fixture(params=list(CASES))
def case(request, monkeypatch):
    make, cfg, family, tdt, fields = CASES[request.param]
    params = make()
    r2t = build(monkeypatch, params, cfg, family)
    return SimpleNamespace(r2t=r2t, pool=r2t.mamba_pool, params=params, cfg=cfg, tdt=tdt,
                           fields=fields, family=family or detect_family(params))


def test_family_detection_and_dims():
    m2, gdn = mamba2_params(), gdn_params()
    # both families carry num_k_heads_per_tp (Mamba2StateShape field): not a marker
    assert m2.shape.num_k_heads_per_tp == M2["G"] and gdn.shape.num_k_heads_per_tp == GDN["Hk"]
    assert detect_family(m2) == "mamba2" and detect_family(gdn) == "gdn"
    assert detect_family(m2, "gdn") == "gdn"
    assert replay_dims(m2) == (4, 8, 16, 2)
    assert replay_dims(gdn) == (4, 8, 16, 2)
    with pytest.raises(ValueError):
        detect_family(m2, "kda")


def test_shapes_and_dtypes(case):
    pool, r2t = case.pool, case.r2t
    assert pool.family == case.family
    assert pool.capacity == CAP and pool.buffer_len == L
    assert set(pool.replay_fields) == set(case.fields)
    temporal_shape = case.params.shape.temporal
    for layer in LAYERS:
        st = r2t.mamba2_layer_cache(layer)
        assert isinstance(st, ReplayMambaPool.State)
        assert st.temporal.shape == (SLOTS + 1, *temporal_shape) and st.temporal.dtype == case.tdt
        assert st.conv[0].shape == (SLOTS + 1, 96, 3) and st.conv[0].dtype == torch.bfloat16
        for name in ("x_buffer", "B_buffer", "dt_buffer", "checkpoint_fold",
                     "k_buffer", "u_buffer", "g_buffer", "v_buffer", "beta_buffer"):
            t = getattr(st, name)
            if name not in case.fields:
                assert t is None
                continue
            shape, dtype = case.fields[name]
            assert tuple(t.shape) == (SLOTS + 1, *shape), name
            assert t.dtype == dtype, name
    if "checkpoint_fold" in case.fields:
        assert pool.mamba_cache.checkpoint_fold.stride() == pool.mamba_cache.temporal.stride()
    assert pool.fill.shape == (SLOTS + 1,) and pool.fill.dtype == torch.int32
    assert pool.origin.shape == (SLOTS + 1,) and pool.origin.dtype == torch.int32
    # PD transfer leaves the replay fields out: only conv + temporal
    assert [f for f, _, _ in pool._iter_transfer_state_tensors()] == ["conv", "temporal"]


def all_tensors(pool):
    return [("conv", pool.mamba_cache.conv[0]), ("temporal", pool.mamba_cache.temporal),
            *pool.replay_tensors().items()]


def fill_distinct(pool, slots, seed):
    g = torch.Generator().manual_seed(seed)
    for _, t in all_tensors(pool):
        t[:, slots] = torch.randn(t[:, slots].shape, generator=g).to(t.dtype)
    pool.fill[slots] = torch.tensor([3 + seed, 5 + seed], dtype=torch.int32)
    pool.origin[slots] = torch.tensor([1 + seed, 2 + seed], dtype=torch.int32)


def snapshot(pool):
    return {n: t.clone() for n, t in all_tensors(pool)} | {
        "fill": pool.fill.clone(), "origin": pool.origin.clone()}


def test_alloc_clear_copy(case):
    pool, r2t = case.pool, case.r2t
    reqs = [req(), req()]
    assert r2t.alloc(reqs) == [1, 2]
    slots = torch.tensor([r.mamba_pool_idx.item() for r in reqs])
    assert slots.tolist() == [1, 2] and all(r.mamba_needs_clear for r in reqs)
    fill_distinct(pool, torch.tensor([1, 2]), 0)
    fill_distinct(pool, torch.tensor([3, 4]), 10)
    pool.fill[0] = 7
    before = snapshot(pool)

    # clear slot 1 only: conv, checkpoint, fold copy zeroed, cursors reset
    pool.clear_slots(torch.tensor([1]))
    after = snapshot(pool)
    for name, t in after.items():
        ax = (lambda x, i: x[i]) if t.dim() == 1 else (lambda x, i: x[:, i])
        if name in ("conv", "temporal", "checkpoint_fold", "fill", "origin"):
            assert not ax(t, [1]).any(), name
            keep = [0, 2, 3, 4]
        else:  # buffers: never read while fill = 0, left as they were
            keep = [0, 1, 2, 3, 4]
        assert torch.equal(ax(t, keep), ax(before[name], keep)), name
    assert before["temporal"][:, 1].any()

    # copy 3 -> 1 and 4 -> 2: everything of the source, exactly; others untouched
    before = snapshot(pool)
    pool.copy_from(torch.tensor([3, 4]), torch.tensor([1, 2]))
    after = snapshot(pool)
    for name, t in after.items():
        ax = (lambda x, i: x[i]) if t.dim() == 1 else (lambda x, i: x[:, i])
        assert torch.equal(ax(t, [1, 2]), ax(before[name], [3, 4])), name
        assert torch.equal(ax(t, [0, 3, 4]), ax(before[name], [0, 3, 4])), name
    assert after["fill"][[1, 2]].tolist() == [13, 15]
    assert after["origin"][[1, 2]].tolist() == [11, 12]


def test_exhausted_pool_queues_without_touching_live_slots(case):
    """Every slot taken: SGLang's alloc answers None (the scheduler keeps the
    request queued) and no pool tensor or cursor changes; a slot freed and
    handed out again is cleared before use (mamba_needs_clear, cleared by the
    scheduler's prepare step), its neighbours untouched."""
    pool, r2t = case.pool, case.r2t
    reqs = [req() for _ in range(SLOTS)]
    assert r2t.alloc(reqs) == [1, 2, 3, 4]
    slots = [r.mamba_pool_idx.item() for r in reqs]
    for i in range(0, SLOTS, 2):
        fill_distinct(pool, torch.tensor(slots[i:i + 2]), 20 * i)
    before = snapshot(pool)

    late = req()
    assert r2t.alloc([late]) is None
    assert late.req_pool_idx is None and late.mamba_pool_idx is None
    after = snapshot(pool)
    for name, t in after.items():
        assert torch.equal(t, before[name]), name

    gone = reqs[1]
    freed = gone.mamba_pool_idx.item()
    r2t.free_mamba_cache(gone)
    r2t.free(gone)
    assert r2t.alloc([late]) is not None
    assert late.mamba_pool_idx.item() == freed and late.mamba_needs_clear
    pool.clear_slots(late.mamba_pool_idx.unsqueeze(0))
    after = snapshot(pool)
    assert pool.fill[freed] == 0 and pool.origin[freed] == 0
    for name, t in after.items():
        ax = (lambda x, i: x[i]) if t.dim() == 1 else (lambda x, i: x[:, i])
        others = [s for s in range(SLOTS + 1) if s != freed]
        assert torch.equal(ax(t, others), ax(before[name], others)), name


def test_cpu_copy_round_trip(case):
    pool = case.pool
    fill_distinct(pool, torch.tensor([1, 2]), 0)
    fill_distinct(pool, torch.tensor([3, 4]), 10)
    before = snapshot(pool)
    idx = torch.tensor([1, 2])
    cpu = pool.get_cpu_copy(idx)
    assert len(cpu) == 3
    conv_cpu, temporal_cpu, replay_cpu = cpu
    assert set(replay_cpu) == set(pool.replay_fields) | {"fill", "origin"}
    assert replay_cpu["fill"].tolist() == [3, 5] and replay_cpu["origin"].tolist() == [1, 2]
    for name, t in pool.replay_tensors().items():
        assert replay_cpu[name].shape == (len(LAYERS), 2, *t.shape[2:])
    pool.clear_slots(idx)
    for t in pool.replay_tensors().values():
        t[:, idx] = 0
    pool.load_cpu_copy(cpu, torch.tensor([2, 1]))  # swapped destinations
    after = snapshot(pool)
    for name, t in after.items():
        ax = (lambda x, i: x[i]) if t.dim() == 1 else (lambda x, i: x[:, i])
        assert torch.equal(ax(t, [2, 1]), ax(before[name], [1, 2])), name
        assert torch.equal(ax(t, [0, 3, 4]), ax(before[name], [0, 3, 4])), name

    # a stock 2-tuple loads as a flushed slot
    pool.load_cpu_copy((conv_cpu, temporal_cpu), torch.tensor([3, 4]))
    assert pool.fill[[3, 4]].tolist() == [0, 0] and pool.origin[[3, 4]].tolist() == [0, 0]
    assert torch.equal(pool.mamba_cache.temporal[:, [3, 4]], temporal_cpu)
    if pool.mamba_cache.checkpoint_fold is not None:
        assert torch.equal(pool.mamba_cache.checkpoint_fold[:, [3, 4]],
                           temporal_cpu.to(torch.float32))


def test_sizes(case):
    pool, params, cfg = case.pool, case.params, case.cfg
    n = len(LAYERS)
    state_bytes = (nbytes(pool.mamba_cache.conv[0]) + nbytes(pool.mamba_cache.temporal)
                   + sum(nbytes(t) for t in pool.replay_tensors().values()))
    cursor_bytes = 2 * (SLOTS + 1) * 4
    assert pool.get_kv_size_bytes() == state_bytes + cursor_bytes
    assert pool.mem_usage == (state_bytes + cursor_bytes) / 1024**3
    # exact numbers: conv [2, 5, 96, 3] bf16, temporal [2, 5, 4, 8, 16]
    tsz = case.tdt.itemsize
    assert nbytes(pool.mamba_cache.conv[0]) == n * 5 * 96 * 3 * 2
    assert nbytes(pool.mamba_cache.temporal) == n * 5 * 4 * 8 * 16 * tsz
    per_layer_slot = sum(torch.Size(s).numel() * d.itemsize for s, d in case.fields.values())
    assert pool.replay_bytes() == n * 5 * per_layer_slot + cursor_bytes
    # extra bytes per slot: replay fields + cursors + checkpoint dtype change
    extra = ReplayMambaPool.extra_bytes_per_slot(params, cfg, family=case.family)
    ckpt_delta = n * 4 * 8 * 16 * (tsz - params.dtype.temporal.itemsize)
    assert extra == n * per_layer_slot + 8 + ckpt_delta
    # per slot: the stock solver's bytes + extra == what this pool holds per slot
    assert params.mamba_cache_per_req + extra == pool.get_kv_size_bytes() // (SLOTS + 1)


def test_exact_byte_numbers():
    # hand-computed per-layer per-slot replay bytes (cap = 6)
    m2 = mamba2_params()
    # x 4*6*8*2 + B 2*6*16*2 + dt 4*6*4 = 384 + 384 + 96 = 864
    assert ReplayMambaPool.extra_bytes_per_slot(m2, ReplayConfig(buffer_len=L)) == 2 * 864 + 8
    # bf16 checkpoint (-2*512 B) + fp32 fold copy (+4*512 B)
    cfg = ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16", fold_dtype="float32")
    assert ReplayMambaPool.extra_bytes_per_slot(m2, cfg) == 2 * (864 + 2048 - 1024) + 8
    gdn = gdn_params()
    # k 2*6*16*4 + u 4*6*8*4 + g 4*6*4 = 768 + 768 + 96
    assert ReplayMambaPool.extra_bytes_per_slot(gdn, ReplayConfig(buffer_len=L)) == 2 * 1632 + 8
    # dual precision: k fp32 768 + u bf16 4*6*8*2 = 384 + g 96 + fold copy 4*8*16*4 = 2048
    # + raw v bf16 384 + beta 4*6*4 = 96, checkpoint fp32 -> bf16 -1024
    cfg = ReplayConfig(buffer_len=L, checkpoint_dtype="bfloat16", fold_dtype="float32")
    assert ReplayMambaPool.extra_bytes_per_slot(gdn, cfg, family="gdn") == 2 * 2752 + 8


def test_config_from_env(monkeypatch):
    ReplayConfig(buffer_len=10, checkpoint_dtype="bfloat16").to_env(
        env=_setenv_proxy(monkeypatch))
    r2t = build(monkeypatch, gdn_params(), None)
    pool = r2t.mamba_pool
    assert pool.buffer_len == 10 and pool.capacity == 10
    assert pool.mamba_cache.temporal.dtype == torch.bfloat16
    assert pool.mamba_cache.u_buffer.dtype == torch.bfloat16


def _setenv_proxy(monkeypatch):
    class Env(dict):
        def __setitem__(self, k, v):
            monkeypatch.setenv(k, v)
    return Env()


def test_rejections(monkeypatch):
    with pytest.raises(ValueError, match="built-in"):
        monkeypatch.setattr(HybridReqToTokenPool, "mamba_pool_cls",
                            ReplayMambaPool.with_config(ReplayConfig(buffer_len=L)))
        HybridReqToTokenPool(
            size=SLOTS, mamba_size=SLOTS, mamba_spec_state_size=SLOTS, max_context_len=32,
            device="cpu", enable_memory_saver=False, cache_params=gdn_params(),
            mamba_layer_ids=LAYERS, enable_mamba_extra_buffer=False,
            enable_overlap_schedule=False, enable_linear_replayssm=True)
    with pytest.raises(ValueError, match="needs a lower-precision"):
        build(monkeypatch, gdn_params(), ReplayConfig(buffer_len=L, fold_dtype="float32"))


def test_fold_copy_as_state(case):
    """Stock prefill scans fetch the layer cache themselves: inside
    fold_copy_as_state they get the fold copy as temporal (no-op without one)."""
    pool, r2t = case.pool, case.r2t
    layer = LAYERS[0]
    plain = r2t.mamba2_layer_cache(layer)
    with pool.fold_copy_as_state():
        scan = r2t.mamba2_layer_cache(layer)
    if "checkpoint_fold" in case.fields:
        assert scan.temporal.data_ptr() == plain.checkpoint_fold.data_ptr()
        assert scan.temporal.dtype == torch.float32 != plain.temporal.dtype
    else:
        assert scan.temporal.data_ptr() == plain.temporal.data_ptr()
    assert r2t.mamba2_layer_cache(layer).temporal.data_ptr() == plain.temporal.data_ptr()


def test_family_override_env(monkeypatch):
    # JetNemotron-style GDN shape: no conv_shard_groups -> looks like Mamba-2
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=2,
                                    num_heads=4, head_dim=8, state_size=16, conv_kernel=4)
    params = Mamba2CacheParams(shape=shape, layers=LAYERS,
                               dtype=Mamba2StateDType(conv=torch.bfloat16,
                                                      temporal=torch.float32))
    assert detect_family(params) == "mamba2"
    monkeypatch.setenv("SGLANG_REPLAYSSM_FAMILY", "gdn")
    assert detect_family(params) == "gdn"
    assert detect_family(params, "mamba2") == "mamba2"  # explicit beats env


def test_speculative_state_dataclass():
    # the spec path of MambaPool.__init__ needs CUDA; check the dataclass on its own
    n, s = 2, 3
    st = ReplayMambaPool.SpeculativeState(
        conv=[torch.zeros(n, s, 96, 3)], temporal=torch.zeros(n, s, 4, 8, 16),
        intermediate_ssm=torch.zeros(n, s, 2, 4, 8, 16),
        intermediate_conv_window=[torch.zeros(n, s, 2, 96, 3)],
        x_buffer=torch.arange(n * s * 4 * CAP * 8.0).reshape(n, s, 4, CAP, 8))
    assert isinstance(st, MambaPool.SpeculativeState) and isinstance(st, ReplayMambaPool.State)
    layer = st.at_layer_idx(1)
    assert type(layer) is ReplayMambaPool.SpeculativeState
    assert torch.equal(layer.x_buffer, st.x_buffer[1]) and layer.B_buffer is None
    assert layer.intermediate_conv_window[0].shape == (s, 2, 96, 3)


@pytest.mark.parametrize("case", ["mamba2", "gdn"])
def test_speculative_pool_without_state_snapshots(monkeypatch, case):
    """With speculative decoding the pool is a SpeculativeState (stock code
    checks for it) holding the conv windows per draft token, which conv
    rollback reads, but no intermediate_ssm (a copy of every layer's state
    per draft token); the rings are sized for the verify window."""
    params = mamba2_params() if case == "mamba2" else gdn_params()
    drafts = 3
    monkeypatch.setattr(HybridReqToTokenPool, "mamba_pool_cls",
                        ReplayMambaPool.with_config(ReplayConfig(buffer_len=L), family=case))
    r2t = HybridReqToTokenPool(
        size=SLOTS, mamba_size=SLOTS, mamba_spec_state_size=SLOTS - 1, max_context_len=32,
        device="cpu", enable_memory_saver=False, cache_params=params, mamba_layer_ids=LAYERS,
        enable_mamba_extra_buffer=False, enable_overlap_schedule=False,
        speculative_num_draft_tokens=drafts, speculative_eagle_topk=2)
    pool = r2t.mamba_pool
    c = pool.mamba_cache
    assert isinstance(c, MambaPool.SpeculativeState) and c.intermediate_ssm is None
    assert pool.capacity == L - 1 + drafts and pool.window == drafts
    conv_shape = tuple(params.shape.conv[0])
    assert [tuple(w.shape) for w in c.intermediate_conv_window] == [
        (len(LAYERS), SLOTS, drafts) + conv_shape]
    assert c.intermediate_conv_window[0].dtype == params.dtype.conv
    ring = c.x_buffer if case == "mamba2" else c.u_buffer
    assert ring.shape[3] == pool.capacity
    assert {id(t) for t in pool.rings()} == {
        id(getattr(c, n)) for n in pool.replay_fields if n != "checkpoint_fold"}
    layer = r2t.mamba2_layer_cache(LAYERS[1])
    assert layer.intermediate_conv_window[0].shape == (SLOTS, drafts) + conv_shape
    windows = sum(w.numel() * w.element_size() for w in c.intermediate_conv_window)
    assert pool.mem_usage * 1024**3 == pytest.approx(
        c.mem_usage_bytes() + 2 * 4 * (SLOTS + 1))
    assert windows > 0


def test_zz_restores_mamba_pool_cls():
    # runs last in this file: every test's monkeypatch of mamba_pool_cls was undone
    assert HybridReqToTokenPool.mamba_pool_cls is MambaPool


def test_extra_buffer_pool_allocates_track_slots(monkeypatch):
    """With the radix cache's extra_buffer SGLang gives each request two
    ping-pong track slots from the same pool (hybrid memory_pool.py:1400);
    they are ReplaySSM slots like the request's own (checkpoint, buffer,
    cursors), distinct from every other."""
    r2t = build(monkeypatch, mamba2_params(), ReplayConfig(buffer_len=4), family="mamba2",
                mamba_size=3 * 2, enable_mamba_extra_buffer=True, enable_overlap_schedule=True)
    reqs = [req(), req()]
    r2t.alloc(reqs)
    own = [int(r.mamba_pool_idx) for r in reqs]
    track = [int(s) for r in reqs for s in r.mamba_ping_pong_track_buffer]
    assert len(set(own + track)) == 6 and min(own + track) >= 1
    pool = r2t.mamba_pool
    assert all(t.shape[1] == pool.size + 1 for t in pool.slot_tensors())
