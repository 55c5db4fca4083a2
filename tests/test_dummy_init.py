"""Scaled dummy weights (sglang_replayssm.dummy_init) and their SGLang hook."""
import math

import pytest
import torch

from sglang_replayssm import config
from sglang_replayssm.dummy_init import (ECHO_EMBEDDING_SCALE, WEIGHT_STD, echo_dummy_weights,
                                         scaled_dummy_weights)


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


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.input_layernorm = torch.nn.RMSNorm(d)
        self.up_proj = torch.nn.Linear(d, 512, bias=False)
        self.down_proj = torch.nn.Linear(512, d, bias=False)

    def forward(self, h):
        return self.down_proj(torch.nn.functional.silu(self.up_proj(self.input_layernorm(h))))


class TinyLM(torch.nn.Module):
    """Pre-norm residual layers between an embedding and an LM head, at the
    widths of the 4-layer Qwen3-Next model's residual (2048) and a 2k vocab."""

    def __init__(self, vocab=2048, d=2048, layers=4, tied=False):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(self.norm(h))


def test_echo_init_repeats_the_input_token():
    """echo: the LM head is the scaled embedding, so greedy decoding returns
    the input token, while the layers still change the logits; scaled (the
    same weights otherwise) does not echo."""
    m = TinyLM()
    echo_dummy_weights(m)
    e = m.embed_tokens.weight
    assert torch.equal(m.lm_head.weight, e)
    assert abs(e.std().item() - WEIGHT_STD * ECHO_EMBEDDING_SCALE) < 0.02
    ids = torch.arange(0, 2048, 7)
    logits = m(ids)
    assert torch.equal(logits.argmax(-1), ids)
    plain = m.lm_head(m.norm(m.embed_tokens(ids)))
    assert (logits - plain).abs().max() > 1e-2 * plain.abs().max()  # the layers matter
    s = TinyLM()
    scaled_dummy_weights(s)
    assert (s(ids).argmax(-1) == ids).float().mean() < 0.1
    t = TinyLM(tied=True)
    echo_dummy_weights(t)
    assert t.lm_head.weight is t.embed_tokens.weight
    assert torch.equal(t(ids).argmax(-1), ids)


def test_echo_init_needs_one_embedding():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="echo dummy init needs one token embedding"):
        echo_dummy_weights(m)
