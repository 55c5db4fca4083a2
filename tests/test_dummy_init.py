"""Scaled dummy weights (sglang_replayssm.dummy_init) and their SGLang hook."""
import math

import pytest
import torch

from sglang_replayssm import config
from sglang_replayssm.dummy_init import WEIGHT_STD, scaled_dummy_weights


class Mixer(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.A = torch.nn.Parameter(torch.zeros(64))
        self.A_log = torch.nn.Parameter(torch.zeros(64))
        self.dt_bias = torch.nn.Parameter(torch.zeros(64))
        self.D = torch.nn.Parameter(torch.zeros(64))
        self.in_proj = torch.nn.Linear(256, 512, bias=True, dtype=dtype)
        self.norm = torch.nn.LayerNorm(512, dtype=dtype)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


def test_values_follow_the_rules():
    m = Mixer(torch.bfloat16)
    scaled_dummy_weights(m)
    assert bool((m.A <= -1).all() and (m.A >= -16).all())
    assert bool((m.A_log >= 0).all() and (m.A_log <= math.log(16) + 1e-6).all())
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert bool((dt >= 1e-3 * 0.999).all() and (dt <= 0.1 * 1.001).all())
    assert bool((m.D == 1).all())
    w = m.in_proj.weight.float()
    assert abs(w.std().item() - WEIGHT_STD) < 0.002 and w.dtype == torch.float32
    assert bool((m.in_proj.bias == 0).all() and (m.norm.weight == 1).all()
                and (m.norm.bias == 0).all())
    assert bool((m.steps == 0).all())  # integer state untouched


def test_deterministic_per_parameter():
    a, b = Mixer(torch.float32), Mixer(torch.float32)
    scaled_dummy_weights(a)
    scaled_dummy_weights(b)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n
    # different parameters of the same shape get different values
    assert not torch.equal(a.A_log, a.dt_bias)
    c = Mixer(torch.float32)
    scaled_dummy_weights(c, seed=7)
    assert not torch.equal(a.in_proj.weight, c.in_proj.weight)


def test_hook_replaces_and_restores_sglang_init(monkeypatch, caplog):
    loader = pytest.importorskip("sglang.srt.model_loader.loader")
    from sglang_replayssm import plugin, sglang_hooks

    stock = loader.initialize_dummy_weights
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv(config.DUMMY_INIT_ENV, "scaled")
    monkeypatch.delenv("SGLANG_REPLAYSSM_ENABLED", raising=False)
    try:
        plugin.register()
        assert loader.initialize_dummy_weights is not stock
        m = Mixer(torch.float32)
        with caplog.at_level("INFO", logger="sglang_replayssm"):
            loader.initialize_dummy_weights(m)
        assert bool((m.D == 1).all())
        # logged when used: the server log is set up only after plugins load
        assert [r.getMessage() for r in caplog.records] == [
            "dummy weights of Mixer: trained-model scale, seed 1234 "
            "(SGLANG_REPLAYSSM_DUMMY_INIT=scaled)"]
    finally:
        sglang_hooks.uninstall_all()
    assert loader.initialize_dummy_weights is stock
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv(config.DUMMY_INIT_ENV, "large")
    with pytest.raises(ValueError, match="SGLANG_REPLAYSSM_DUMMY_INIT must be"):
        plugin.register()
    sglang_hooks.uninstall_all()
