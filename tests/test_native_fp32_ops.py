"""The fp32-activation test knob (SGLANG_REPLAYSSM_NATIVE_FP32_OPS=1): fp32
input reaches the op's own PyTorch path, other dtypes the unchanged CUDA path,
and uninstall restores SGLang."""
import importlib
import types

import pytest
import torch

pytest.importorskip("sglang.srt.layers.layernorm")

from sglang.srt.layers import activation, layernorm  # noqa: E402
from sglang.srt.layers.attention.linear.kernels import gdn_triton  # noqa: E402
from sglang.srt.layers.moe import fused_moe_native  # noqa: E402
from sglang.srt.layers.quantization import unquant  # noqa: E402
from sglang.srt.layers.rotary_embedding import base as rotary  # noqa: E402
from sglang.srt.models import qwen3_5  # noqa: E402

from sglang_replayssm import config, plugin, sglang_hooks  # noqa: E402


@pytest.fixture
def cuda_paths(monkeypatch):
    """Stand-ins for the CUDA paths (sgl-kernel is not importable here): each
    records the dtype it was called with and returns a marker."""
    calls = []

    def fake(name):
        def forward_cuda(self, *args, **kwargs):
            x = args[1] if name in ("RotaryEmbedding", "UnquantizedFusedMoEMethod") else args[0]
            calls.append((name, getattr(x, "hidden_states", x).dtype))
            return "cuda"
        return forward_cuda

    for module, name in sglang_hooks.NATIVE_FP32_OPS:
        cls = getattr(importlib.import_module(module), name)
        monkeypatch.setattr(cls, "forward_cuda", fake(name))

    def chunk_gated_delta_rule(**kw):
        calls.append(("chunk", {n: kw[n].dtype for n in ("q", "k", "v", "g", "beta")}))
        return kw["v"] * 2, "final_state"

    monkeypatch.setattr(gdn_triton, "chunk_gated_delta_rule", chunk_gated_delta_rule)

    def prepare_cuda_fused(self, positions, hidden_states):
        calls.append(("qwen3_5 prepare", hidden_states.dtype))
        return "cuda"

    monkeypatch.setattr(qwen3_5.Qwen3_5AttentionDecoderLayer, "forward_prepare_cuda_fused",
                        prepare_cuda_fused)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv("SGLANG_REPLAYSSM_ENABLED", raising=False)
    monkeypatch.delenv(config.DUMMY_INIT_ENV, raising=False)
    yield calls
    sglang_hooks.uninstall_all()  # back to the stand-ins; monkeypatch then to SGLang's


def test_fp32_takes_the_native_path_and_others_the_cuda_path(cuda_paths, monkeypatch):
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "1")
    plugin.register()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)

    norm = layernorm.GemmaRMSNorm(64, eps=1e-6)
    norm.weight.data.normal_(0.0, 0.1, generator=g)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + norm.weight)
    torch.testing.assert_close(norm.forward_cuda(x), want, rtol=1e-6, atol=1e-6)
    # the fused-add form returns (normed x + residual, x + residual)
    r = torch.randn(5, 64, generator=g)
    out, res = norm.forward_cuda(x.clone(), r.clone())
    torch.testing.assert_close(res, x + r)
    assert norm.forward_cuda(x.bfloat16()) == "cuda"

    rms = layernorm.RMSNorm(64, eps=1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms.forward_cuda(x), want, rtol=1e-6, atol=1e-6)
    assert rms.forward_cuda(x.half()) == "cuda"

    # its constructor reads the server's config namespace; the ops need nothing of it
    act = activation.SiluAndMul.__new__(activation.SiluAndMul)
    torch.nn.Module.__init__(act)
    torch.testing.assert_close(act.forward_cuda(x),
                               torch.nn.functional.silu(x[:, :32]) * x[:, 32:])
    assert act.forward_cuda(x.bfloat16()) == "cuda"

    # its constructor reads the server's exec config (deterministic mode: off)
    # and picks a kernel by platform (this CPU torch is none it knows)
    monkeypatch.setattr(rotary, "get_exec", lambda: types.SimpleNamespace(
        deterministic=types.SimpleNamespace(rl_on_policy_target=None)))
    monkeypatch.setattr(rotary, "_is_cpu", True)
    rope = rotary.RotaryEmbedding(64, 64, 128, 10000, True, torch.float32)
    pos = torch.arange(5)
    q, k = torch.randn(5, 2 * 64, generator=g), torch.randn(5, 64, generator=g)
    q_nat, k_nat = rope.forward_native(pos, q.clone(), k.clone())
    q_out, k_out = rope.forward_cuda(pos, q.clone(), k.clone())
    torch.testing.assert_close(q_out, q_nat)
    torch.testing.assert_close(k_out, k_nat)
    assert not torch.allclose(q_out[1:], q[1:])  # the rotation did something
    assert rope.forward_cuda(pos, q.bfloat16(), k.bfloat16()) == "cuda"

    assert [dt for _, dt in cuda_paths] == [torch.bfloat16, torch.float16, torch.bfloat16,
                                            torch.bfloat16]


def test_uninstall_restores_and_bad_value_is_refused(cuda_paths, monkeypatch):
    before = layernorm.GemmaRMSNorm.__dict__["forward_cuda"]
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "1")
    plugin.register()
    assert layernorm.GemmaRMSNorm.__dict__["forward_cuda"] is not before
    sglang_hooks.uninstall_all()
    assert layernorm.GemmaRMSNorm.__dict__["forward_cuda"] is before
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "yes")
    with pytest.raises(ValueError, match="SGLANG_REPLAYSSM_NATIVE_FP32_OPS must be"):
        plugin.register()
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "0")
    plugin.register()
    assert layernorm.GemmaRMSNorm.__dict__["forward_cuda"] is before


def test_gdn_chunk_prefill_runs_fp32_input_on_bf16_copies(cuda_paths, monkeypatch):
    """SGLang's chunk kernel refuses fp32 q/k/v: with the knob it gets bf16
    copies of q, k, v (g, beta and the state untouched) and returns fp32."""
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "1")
    plugin.register()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 6, 2, 4, generator=g) for _ in range(3))
    gate, beta = torch.randn(1, 6, 2, generator=g), torch.rand(1, 6, 2, generator=g)
    o, state = gdn_triton.chunk_gated_delta_rule(q=q, k=k, v=v, g=gate, beta=beta,
                                                 initial_state=None)
    assert cuda_paths[-1] == ("chunk", {"q": torch.bfloat16, "k": torch.bfloat16,
                                        "v": torch.bfloat16, "g": torch.float32,
                                        "beta": torch.float32})
    assert o.dtype == torch.float32 and state == "final_state"
    torch.testing.assert_close(o, v.bfloat16().float() * 2)
    o, _ = gdn_triton.chunk_gated_delta_rule(q=q.bfloat16(), k=k.bfloat16(), v=v.bfloat16(),
                                             g=gate, beta=beta)
    assert cuda_paths[-1][1]["q"] == torch.bfloat16 and o.dtype == torch.bfloat16
    sglang_hooks.uninstall_all()
    gdn_triton.chunk_gated_delta_rule(q=q, k=k, v=v, g=gate, beta=beta)
    assert cuda_paths[-1][1]["q"] == torch.float32  # uninstalled: fp32 reaches the kernel


def test_qwen3_5_attention_prep_takes_its_pytorch_path_for_fp32(cuda_paths, monkeypatch):
    """Qwen3.5's fused q/k norm + RoPE + gate kernel rounds q and k to bf16:
    fp32 input takes the layer's forward_prepare_native, called as SGLang
    calls the fused one (keywords), other dtypes the fused kernel."""
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "1")
    plugin.register()
    native = []
    layer = types.SimpleNamespace(
        forward_prepare_native=lambda positions, hidden_states: native.append(
            (positions, hidden_states)) or ("q", "k", "v", "gate"))
    prepare = qwen3_5.Qwen3_5AttentionDecoderLayer.forward_prepare_cuda_fused
    pos, x = torch.arange(3), torch.randn(3, 8)
    assert prepare(layer, positions=pos, hidden_states=x) == ("q", "k", "v", "gate")
    assert native == [(pos, x)] and cuda_paths == []
    assert prepare(layer, positions=pos, hidden_states=x.bfloat16()) == "cuda"
    assert cuda_paths == [("qwen3_5 prepare", torch.bfloat16)] and len(native) == 1
    sglang_hooks.uninstall_all()
    assert prepare.__wrapped__ is qwen3_5.Qwen3_5AttentionDecoderLayer.forward_prepare_cuda_fused
    assert qwen3_5.Qwen3_5AttentionDecoderLayer.forward_prepare_cuda_fused(layer, pos, x) == "cuda"


def test_moe_fp32_runs_sglangs_per_expert_loop_exactly(cuda_paths, monkeypatch):
    """The triton MoE computes fp32 input with tf32 dots and fp16
    intermediates: with the knob fp32 input takes SGLang's own per-expert loop,
    which must equal the float64 mixture of experts to fp32 rounding."""
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "1")
    plugin.register()
    # SiluAndMul's constructor reads the server's config namespace
    monkeypatch.setattr(fused_moe_native, "SiluAndMul",
                        lambda: lambda gu: torch.nn.functional.silu(gu[:, :gu.shape[1] // 2])
                        * gu[:, gu.shape[1] // 2:])
    g = torch.Generator().manual_seed(2)
    tokens, hidden, inter, experts, topk = 7, 16, 8, 6, 2
    layer = types.SimpleNamespace(
        num_experts=experts,
        w13_weight=torch.randn(experts, 2 * inter, hidden, generator=g) / 4,
        w2_weight=torch.randn(experts, hidden, inter, generator=g) / 4)
    method = unquant.UnquantizedFusedMoEMethod.__new__(unquant.UnquantizedFusedMoEMethod)
    method.moe_runner_config = types.SimpleNamespace(
        activation="silu", apply_router_weight_on_input=False, gemm1_alpha=None)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, topk, generator=g)
    dispatch = types.SimpleNamespace(hidden_states=x, topk_output=(weights, ids, None))

    out = method.forward_cuda(layer, dispatch).hidden_states

    w13, w2 = layer.w13_weight.double(), layer.w2_weight.double()
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(topk):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t].double()).chunk(2)
            want[t] += weights[t, j].double() * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    bf16 = types.SimpleNamespace(hidden_states=x.bfloat16(), topk_output=(weights, ids, None))
    assert method.forward_cuda(layer, bf16) == "cuda"
    assert cuda_paths[-1] == ("UnquantizedFusedMoEMethod", torch.bfloat16)


def test_each_fp32_path_is_logged_once_when_first_taken(cuda_paths, monkeypatch, caplog):
    """SGLang sets up logging only after loading plugins, so the knob says what
    it did at first use, once per op; bf16 input logs nothing."""
    monkeypatch.setenv(config.NATIVE_FP32_OPS_ENV, "1")
    plugin.register()
    rms = layernorm.RMSNorm(8, eps=1e-6)
    x = torch.randn(2, 8)
    with caplog.at_level("INFO", logger="sglang_replayssm"):
        rms.forward_cuda(x.bfloat16())
        assert not caplog.records
        for _ in range(3):
            rms.forward_cuda(x)
        q = torch.randn(1, 3, 2, 4)
        for _ in range(2):
            gdn_triton.chunk_gated_delta_rule(q=q, k=q, v=q, g=q[..., 0], beta=q[..., 0])
    assert [r.getMessage() for r in caplog.records] == [
        "fp32 input: RMSNorm runs its PyTorch path (forward_native) "
        "(SGLANG_REPLAYSSM_NATIVE_FP32_OPS=1)",
        "fp32 input: GDN chunk prefill runs on bf16 copies of q/k/v "
        "(SGLANG_REPLAYSSM_NATIVE_FP32_OPS=1)"]
