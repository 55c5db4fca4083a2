"""The flags, the launcher-side validation and the plugin's register()."""
import argparse
import types

import pytest

pytest.importorskip("sglang.srt.server_args")

from sglang.srt.server_args import ServerArgs  # noqa: E402

from sglang_replayssm import plugin, sglang_hooks  # noqa: E402
from sglang_replayssm.config import ENV_PREFIX, ReplayConfig  # noqa: E402


@pytest.fixture
def hooks(monkeypatch):
    """Install the CLI hooks for one test and undo every patch afterwards."""
    for key in ("ENABLED", "BUFFER_LEN", "CHECKPOINT_DTYPE", "FOLD_DTYPE"):
        monkeypatch.delenv(ENV_PREFIX + key, raising=False)
    monkeypatch.setattr(plugin, "_registered", False)
    yield
    sglang_hooks.uninstall_all()


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
                 "--replayssm-fold-dtype"):
        assert flag in text


def test_parse_flags_to_config(hooks):
    sglang_hooks.install_cli_hooks()
    args = _parser().parse_args(["--model-path", "m", "--enable-replayssm", "--replayssm-buffer-len", "8",
                                 "--replayssm-checkpoint-dtype", "bfloat16", "--replayssm-fold-dtype", "float32"])
    assert sglang_hooks.config_from_namespace(args) == ReplayConfig(True, 8, "bfloat16", "float32")
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


def test_from_cli_args_enabled_fails_until_backends_exist(hooks, monkeypatch):
    sglang_hooks.install_cli_hooks()
    args = _parser().parse_args(["--model-path", "m", "--enable-replayssm"])
    monkeypatch.setattr(ServerArgs, "__init__", lambda self, **kw: self.__dict__.update(kw))
    with pytest.raises(NotImplementedError, match="not implemented yet"):
        ServerArgs.from_cli_args(args)
    args = _parser().parse_args(["--model-path", "m", "--enable-replayssm", "--replayssm-buffer-len", "1"])
    with pytest.raises(ValueError, match="--replayssm-buffer-len must be >= 2, got 1"):
        ServerArgs.from_cli_args(args)


_STOCK = dict(enable_linear_replayssm=False, enable_linear_replayssm_spec=False, speculative_algorithm=None,
              enable_hierarchical_cache=False, enable_unified_memory=False, disaggregation_mode="null")


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(enable_linear_replayssm=True), "mutually exclusive"),
        (dict(enable_linear_replayssm_spec=True), "mutually exclusive"),
        (dict(speculative_algorithm="EAGLE"), "does not support speculative decoding yet"),
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
