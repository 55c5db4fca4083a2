"""The flags, the launcher-side validation and the plugin's register()."""
import argparse
import os
import types

import pytest

pytest.importorskip("sglang.srt.server_args")

from sglang.srt.server_args import ServerArgs  # noqa: E402

from sglang_replayssm import plugin, sglang_hooks  # noqa: E402
from sglang_replayssm.config import ENV_PREFIX, ReplayConfig  # noqa: E402


@pytest.fixture
def hooks(monkeypatch):
    """Install the CLI hooks for one test and undo every patch afterwards."""
    for key in ("ENABLED", "BUFFER_LEN", "CHECKPOINT_DTYPE", "FOLD_DTYPE", "FAMILY",
                "DECODE_ROUTE"):
        monkeypatch.delenv(ENV_PREFIX + key, raising=False)
    monkeypatch.setattr(plugin, "_registered", False)
    yield
    sglang_hooks.uninstall_all()
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        del os.environ[key]  # set by the code under test, not by monkeypatch


def _parser():
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def test_register_disabled_adds_only_flags(hooks):
    from sglang.srt.layers.attention import hybrid_linear_attn_backend
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool

    mamba2_cls = hybrid_linear_attn_backend.Mamba2AttnBackend
    gdn_cls = gdn_backend.GDNAttnBackend
    original_add = ServerArgs.__dict__["add_cli_args"]
    plugin.register()
    patched_add = ServerArgs.__dict__["add_cli_args"]
    assert patched_add is not original_add
    plugin.register()  # idempotent: nothing patched twice
    plugin._registered = False
    plugin.register()  # even a second real run does not wrap the wrapper
    assert ServerArgs.__dict__["add_cli_args"] is patched_add
    assert HybridReqToTokenPool.mamba_pool_cls is MambaPool
    assert hybrid_linear_attn_backend.Mamba2AttnBackend is mamba2_cls
    assert gdn_backend.GDNAttnBackend is gdn_cls
    sglang_hooks.uninstall_all()
    assert ServerArgs.__dict__["add_cli_args"] is original_add


def test_help_lists_the_flags_in_their_group(hooks):
    sglang_hooks.install_cli_hooks()
    text = _parser().format_help()
    assert "ReplaySSM:" in text
    for flag in ("--enable-replayssm", "--replayssm-buffer-len", "--replayssm-checkpoint-dtype",
                 "--replayssm-fold-dtype", "--replayssm-decode-route"):
        assert flag in text


def test_parse_flags_to_config(hooks):
    sglang_hooks.install_cli_hooks()
    args = _parser().parse_args(["--model-path", "m", "--enable-replayssm", "--replayssm-buffer-len", "8",
                                 "--replayssm-checkpoint-dtype", "bfloat16", "--replayssm-fold-dtype", "float32",
                                 "--replayssm-decode-route", "split"])
    assert sglang_hooks.config_from_namespace(args) == ReplayConfig(True, 8, "bfloat16", "float32",
                                                                    "split")
    args = _parser().parse_args(["--model-path", "m"])
    assert sglang_hooks.config_from_namespace(args) == ReplayConfig()


def test_from_cli_args_stock_when_disabled(hooks, monkeypatch):
    import os

    sglang_hooks.install_cli_hooks()
    args = _parser().parse_args(["--model-path", "m"])
    seen = {}
    monkeypatch.setattr(ServerArgs, "__init__", lambda self, **kw: seen.update(kw))
    ServerArgs.from_cli_args(args)
    # Our flags never reach ServerArgs; nothing is exported for the children.
    assert seen["model_path"] == "m" and not any("replayssm" in k and "linear" not in k for k in seen)
    assert ENV_PREFIX + "ENABLED" not in os.environ


def test_from_cli_args_enabled_validates_and_exports(hooks, monkeypatch, tmp_path, non_ssm_model):
    """The launcher validates the flags and the model, then exports the
    configuration (and the model's SSM family) for the spawned schedulers."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import make_model

    monkeypatch.delenv(ENV_PREFIX + "FAMILY", raising=False)
    (path,) = make_model.write_model_configs(str(tmp_path), ["qwen3-next-80b-4layer"])
    sglang_hooks.install_cli_hooks()
    monkeypatch.setattr(ServerArgs, "__init__", lambda self, **kw: self.__dict__.update(kw))
    args = _parser().parse_args(["--model-path", path, "--enable-replayssm",
                                 "--replayssm-buffer-len", "8"])
    ServerArgs.from_cli_args(args)
    assert os.environ[ENV_PREFIX + "ENABLED"] == "1"
    assert os.environ[ENV_PREFIX + "BUFFER_LEN"] == "8"
    assert os.environ[ENV_PREFIX + "FAMILY"] == "gdn"
    assert ReplayConfig.from_env() == ReplayConfig(enabled=True, buffer_len=8)
    for key in ("ENABLED", "BUFFER_LEN", "CHECKPOINT_DTYPE", "FOLD_DTYPE", "FAMILY",
                "DECODE_ROUTE"):
        os.environ.pop(ENV_PREFIX + key)

    args = _parser().parse_args(["--model-path", path, "--enable-replayssm",
                                 "--replayssm-buffer-len", "1"])
    with pytest.raises(ValueError, match="--replayssm-buffer-len must be >= 2, got 1"):
        ServerArgs.from_cli_args(args)
    args = _parser().parse_args(["--model-path", str(non_ssm_model), "--enable-replayssm"])
    with pytest.raises(ValueError, match="has no Mamba-2 or Gated DeltaNet layers"):
        ServerArgs.from_cli_args(args)
    assert ENV_PREFIX + "ENABLED" not in os.environ


@pytest.mark.parametrize("model", ["qwen3-next-80b-4layer", "nemotron-h-8b-4layer",
                                   "granite-4.0-h-4layer"])
def test_radix_cache_resolves_to_no_buffer(hooks, monkeypatch, tmp_path, model, caplog):
    """With the radix cache on, `auto` becomes no_buffer with overlap
    scheduling off, logged; --disable-radix-cache, an explicit strategy and
    a page size > 1 (auto: extra_buffer) are left to SGLang."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import make_model

    (path,) = make_model.write_model_configs(str(tmp_path), [model])
    sglang_hooks.install_cli_hooks()
    seen = {}

    def init(self, **kw):
        seen.clear()
        seen.update(kw)
        self.__dict__.update(kw)

    monkeypatch.setattr(ServerArgs, "__init__", init)

    def launch(*flags):
        args = _parser().parse_args(["--model-path", path, "--enable-replayssm", *flags])
        ServerArgs.from_cli_args(args)
        return seen["mamba_radix_cache_strategy"], seen["disable_overlap_schedule"]

    with caplog.at_level("WARNING", logger="sglang_replayssm"):
        assert launch() == ("no_buffer", True)
    assert any("--disable-overlap-schedule is set" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="sglang_replayssm"):
        assert launch("--disable-overlap-schedule") == ("no_buffer", True)
        assert launch("--mamba-radix-cache-strategy", "no_buffer",
                      "--disable-overlap-schedule") == ("no_buffer", True)
        for strategy in ("extra_buffer", "extra_buffer_lazy"):
            assert launch("--mamba-radix-cache-strategy", strategy) == (strategy, False)
        assert launch("--page-size", "16") == ("auto", False)
        assert launch("--attention-backend", "trtllm_mha") == ("auto", False)
        assert launch("--disable-radix-cache") == ("auto", False)
    assert not caplog.records


_STOCK = dict(enable_linear_replayssm=False, enable_linear_replayssm_spec=False, speculative_algorithm=None,
              enable_hierarchical_cache=False, enable_unified_memory=False, disaggregation_mode="null")


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(enable_linear_replayssm=True), "mutually exclusive"),
        (dict(enable_linear_replayssm_spec=True), "mutually exclusive"),
        (dict(speculative_algorithm="DFLASH"), "supports --speculative-algorithm"),
        (dict(speculative_algorithm="STANDALONE"), "supports --speculative-algorithm"),
        (dict(speculative_algorithm="EAGLE", speculative_num_draft_tokens=16),
         r"--replayssm-buffer-len \(16\) must exceed --speculative-num-draft-tokens \(16\)"),
        (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
              speculative_adaptive=True), "--speculative-adaptive"),
        (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
        (dict(enable_unified_memory=True), "--enable-unified-memory"),
        (dict(disaggregation_mode="decode"), "PD disaggregation"),
    ],
)
def test_server_args_validation(override, message):
    server_args = types.SimpleNamespace(**{**_STOCK, **override})
    with pytest.raises(ValueError, match=message):
        sglang_hooks.validate_against_server_args(ReplayConfig(enabled=True), server_args)


def test_server_args_validation_accepts_stock():
    sglang_hooks.validate_against_server_args(ReplayConfig(enabled=True), types.SimpleNamespace(**_STOCK))


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "NGRAM"])
def test_server_args_validation_accepts_speculative(algorithm):
    """A fixed verify window shorter than the buffer (15 drafts, buffer 16)."""
    server_args = types.SimpleNamespace(**{**_STOCK, "speculative_algorithm": algorithm,
                                           "speculative_num_draft_tokens": 15})
    sglang_hooks.validate_against_server_args(ReplayConfig(enabled=True, buffer_len=16),
                                              server_args)


def _register_mamba2(monkeypatch):
    """register() in a scheduler process of a Mamba-2 model (buffer 8);
    returns a cache-params object of that model (2 layers, 16 heads x 8,
    2 groups, state 16) and its stock bytes per slot, taken before."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    params = Mamba2CacheParams(
        shape=Mamba2StateShape.create(tp_world_size=1, intermediate_size=16 * 8, n_groups=2,
                                      num_heads=16, head_dim=8, state_size=16, conv_kernel=4),
        layers=[0, 2])
    stock_bytes = params.mamba_cache_per_req
    ReplayConfig(enabled=True, buffer_len=8).to_env()
    monkeypatch.setenv(ENV_PREFIX + "FAMILY", "mamba2")
    plugin.register()
    return params, stock_bytes


def test_register_enabled_installs_and_uninstall_restores(hooks, monkeypatch):
    """In a scheduler process (env exported by the launcher) register()
    installs the pool, both backends, the Mamba-2 state-update dispatcher and
    the capacity-solver charge; uninstall_all() restores SGLang."""
    from sglang.srt.layers.attention import hybrid_linear_attn_backend
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.layers.attention.mamba import mamba as mamba_module
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool

    from sglang_replayssm import backends
    from sglang_replayssm.pool import ReplayMambaPool

    stock_ssu = mamba_module.selective_state_update
    params, stock_bytes = _register_mamba2(monkeypatch)
    pool_cls = HybridReqToTokenPool.mamba_pool_cls
    assert issubclass(pool_cls, ReplayMambaPool) and pool_cls.replay_family == "mamba2"
    assert pool_cls.replay_config.buffer_len == 8
    assert hybrid_linear_attn_backend.Mamba2AttnBackend is backends.ReplayMamba2AttnBackend
    assert gdn_backend.GDNAttnBackend is backends.ReplayGDNAttnBackend
    assert mamba_module.selective_state_update is backends.selective_state_update
    # per layer: x ring 16 heads x 8 entries x 8 (bf16) + B ring 2 x 8 x 16 (bf16)
    # + dt ring 16 x 8 (fp32); + the two int32 cursors
    extra = 2 * (16 * 8 * 8 * 2 + 2 * 8 * 16 * 2 + 16 * 8 * 4) + 8
    assert params.mamba_cache_per_req == stock_bytes + extra
    sglang_hooks.uninstall_all()
    assert HybridReqToTokenPool.mamba_pool_cls is MambaPool
    assert mamba_module.selective_state_update is stock_ssu
    assert params.mamba_cache_per_req == stock_bytes


def test_capacity_solver_with_speculative_decoding(hooks, monkeypatch):
    """With speculative decoding the solver charges, per slot, the rings
    sized for the verify window and the conv windows per draft token, and
    runs as without speculative decoding (it would reserve SGLang's per-draft
    state scratch, which this pool does not allocate); without it, as stock.
    The commit after a verify is ours for a ReplaySSM backend, stock's
    otherwise."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    seen = []
    monkeypatch.setattr(KVCacheConfigurator, "_handle_max_mamba_cache",
                        lambda self, rest: seen.append(self.spec_algorithm) or rest - 1)
    commits = []
    monkeypatch.setattr(HybridLinearAttnBackend, "update_mamba_state_after_mtp_verify",
                        lambda self, *a, **k: commits.append(a))
    monkeypatch.setattr(sglang_hooks, "_draft_tokens", lambda: 4)
    params, stock_bytes = _register_mamba2(monkeypatch)
    # per layer: rings of 8 - 1 + 4 = 11 entries (x 16 x 11 x 8 bf16, B 2 x 11 x 16
    # bf16, dt 16 x 11 fp32) + 4 conv windows (conv dim 16*8 + 2*2*16 = 192, 3 wide, bf16)
    per_layer = 16 * 11 * 8 * 2 + 2 * 11 * 16 * 2 + 16 * 11 * 4 + 4 * 192 * 3 * 2
    assert params.mamba_cache_per_req == stock_bytes + 2 * per_layer + 8
    solver = types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.NGRAM)
    assert KVCacheConfigurator._handle_max_mamba_cache(solver, 10.0) == 9.0
    assert seen == [SpeculativeAlgorithm.NONE]
    assert solver.spec_algorithm == SpeculativeAlgorithm.NGRAM
    plain = types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.NONE)
    KVCacheConfigurator._handle_max_mamba_cache(plain, 10.0)
    assert seen[-1] == SpeculativeAlgorithm.NONE
    # the commit: a stock linear backend gets stock's
    hybrid = types.SimpleNamespace(linear_attn_backend=types.SimpleNamespace())
    HybridLinearAttnBackend.update_mamba_state_after_mtp_verify(
        hybrid, "last", None, None, "model", None)
    assert commits == [("last", None, None, "model", None)]
