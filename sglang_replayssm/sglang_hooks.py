"""Every SGLang-0.5.17-specific patch of sglang-replayssm, in one place.

Each patch names the sglang file:line it targets (paths relative to the
installed ``sglang/`` package, version 0.5.17). Another sglang version gets a
warning: the targets may have moved.
"""

from __future__ import annotations

import argparse
import logging
import os

from sglang_replayssm.config import (CHECKPOINT_DTYPES, DECODE_ROUTES, DUMMY_INIT_ENV, FAMILY_ENV,
                                     NATIVE_FP32_OPS_ENV, ReplayConfig)

logger = logging.getLogger("sglang_replayssm")

SUPPORTED_SGLANG_VERSION = "0.5.17"
_ORIGINALS: dict = {}  # (owner, attribute) -> original, so patches apply once


def check_sglang_version() -> str:
    from sglang.version import __version__

    if __version__ != SUPPORTED_SGLANG_VERSION:
        logger.warning(
            "sglang-replayssm patches sglang %s internals; found sglang %s",
            SUPPORTED_SGLANG_VERSION,
            __version__,
        )
    return __version__


def _patch(owner, name: str, replacement) -> None:
    key = (owner, name)
    if key in _ORIGINALS:
        return
    _ORIGINALS[key] = owner.__dict__[name]
    setattr(owner, name, replacement)


# --------------------------------------------------------------------------
# Command-line flags.
# sglang/launch_server.py:64-68 runs load_plugins() before prepare_server_args
# (srt/server_args.py:9344), which builds its parser with the staticmethod
# ServerArgs.add_cli_args (srt/server_args.py:8214) and turns the namespace
# into ServerArgs with the classmethod ServerArgs.from_cli_args
# (srt/server_args.py:8463; it keeps only dataclass fields, so our flags never
# reach ServerArgs itself). We wrap both.
# --------------------------------------------------------------------------


def add_replayssm_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "ReplaySSM", "Checkpoint + input-buffer decoding of Mamba-2 / Gated DeltaNet layers"
    )
    default = ReplayConfig()
    group.add_argument(
        "--enable-replayssm",
        action="store_true",
        help="Decode Mamba-2 and Gated DeltaNet layers with the ReplaySSM kernels.",
    )
    group.add_argument(
        "--replayssm-buffer-len",
        type=int,
        default=default.buffer_len,
        help="Tokens buffered per request between two checkpoint flushes (>= 2).",
    )
    group.add_argument(
        "--replayssm-checkpoint-dtype",
        choices=CHECKPOINT_DTYPES,
        default=default.checkpoint_dtype,
        help="dtype of the checkpoint the decode reads; auto = --mamba-ssm-dtype.",
    )
    group.add_argument(
        "--replayssm-fold-dtype",
        choices=("none", "float32"),
        default="none",
        help="float32: keep a precise checkpoint copy the flush folds into "
        "(dual precision: the read copy's rounding never enters the recurrence).",
    )
    group.add_argument(
        "--replayssm-decode-route",
        choices=DECODE_ROUTES,
        default=default.decode_route,
        help="Decode kernel: output_only = one fused launch, split = a projection "
        "launch (which also folds the buffer on a row's flush step) then an outputs "
        "launch; auto = picked per batch size (split from batch 2 for Mamba-2, 8 for "
        "Gated DeltaNet).",
    )


def config_from_namespace(args: argparse.Namespace) -> ReplayConfig:
    fold = getattr(args, "replayssm_fold_dtype", "none")
    return ReplayConfig(
        enabled=bool(getattr(args, "enable_replayssm", False)),
        buffer_len=getattr(args, "replayssm_buffer_len", ReplayConfig.buffer_len),
        checkpoint_dtype=getattr(args, "replayssm_checkpoint_dtype", "auto"),
        fold_dtype=None if fold == "none" else fold,
        decode_route=getattr(args, "replayssm_decode_route", "auto"),
    )


def validate_against_server_args(config: ReplayConfig, server_args) -> None:
    """Reject server options ReplaySSM does not support (yet), naming the flag."""
    config.validate()
    if getattr(server_args, "enable_linear_replayssm", False) or getattr(
        server_args, "enable_linear_replayssm_spec", False
    ):
        raise ValueError(
            "--enable-replayssm and SGLang's built-in --enable-linear-replayssm / "
            "--enable-linear-replayssm-spec are mutually exclusive"
        )
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm:
        validate_speculative(config, server_args, algorithm)
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ValueError("--enable-replayssm does not support --enable-hierarchical-cache")
    if getattr(server_args, "enable_unified_memory", False):
        raise ValueError("--enable-replayssm does not support --enable-unified-memory")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        raise ValueError(
            "--enable-replayssm does not support PD disaggregation "
            f"(--disaggregation-mode {server_args.disaggregation_mode})"
        )


# Algorithms whose verify is a fixed window of draft tokens per request (a
# chain, or an EAGLE tree with topk > 1) and whose workers commit through
# update_mamba_state_after_mtp_verify (eagle_worker_common.py:604,
# ngram_worker.py:462). DFLASH / DSPARK verify ragged windows; STANDALONE's
# draft model is a second model with a pool of its own.
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "NGRAM")


def validate_speculative(config: ReplayConfig, server_args, algorithm: str) -> None:
    """Speculative decoding with ReplaySSM: the drafts of one verify are
    buffered after the request's history, so the window must fit the buffer."""
    if str(algorithm).upper() not in SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"--enable-replayssm supports --speculative-algorithm "
            f"{'/'.join(SPECULATIVE_ALGORITHMS)}, got {algorithm}")
    if getattr(server_args, "speculative_adaptive", False):
        raise ValueError("--enable-replayssm does not support --speculative-adaptive (the "
                         "verify window must be the same every step)")
    drafts = getattr(server_args, "speculative_num_draft_tokens", None)
    if drafts is not None and drafts >= config.buffer_len:
        raise ValueError(
            f"--replayssm-buffer-len ({config.buffer_len}) must exceed "
            f"--speculative-num-draft-tokens ({drafts}): a verify buffers its drafts after "
            f"the request's history; raise --replayssm-buffer-len to at least {drafts + 1}")


def install_cli_hooks() -> None:
    from sglang.srt.server_args import ServerArgs

    original_add = ServerArgs.__dict__["add_cli_args"].__func__
    original_from = ServerArgs.__dict__["from_cli_args"].__func__

    def add_cli_args(parser: argparse.ArgumentParser):
        original_add(parser)
        add_replayssm_args(parser)

    def from_cli_args(cls, args: argparse.Namespace):
        config = config_from_namespace(args)
        if config.enabled:
            resolve_radix_cache_strategy(args)
        server_args = original_from(cls, args)
        if config.enabled:
            prepare_launch(config, server_args)
        return server_args

    _patch(ServerArgs, "add_cli_args", staticmethod(add_cli_args))
    _patch(ServerArgs, "from_cli_args", classmethod(from_cli_args))


# --------------------------------------------------------------------------
# Which SSM family the served model has (launcher side).
# The pool is built (kv_cache_configurator.py:777) before the attention
# backend is chosen (attention_registry.py:415-461), so the family is decided
# here from the HF config with SGLang's own config classes (the ones
# srt/configs/hybrid_arch.py:48-98 dispatches on) and exported to the
# scheduler processes.
# --------------------------------------------------------------------------


def model_family(hf_config) -> str:
    """'mamba2' or 'gdn' for a model ReplaySSM supports; ValueError otherwise."""
    from sglang.srt.configs import (FalconH1Config, GraniteMoeHybridConfig, NemotronHConfig,
                                    Qwen3_5Config, Qwen3_5MoeConfig, Qwen3NextConfig)

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if isinstance(text, (Qwen3NextConfig, Qwen3_5Config, Qwen3_5MoeConfig)):
        return "gdn"
    if isinstance(hf_config, (NemotronHConfig, FalconH1Config)):
        return "mamba2"
    if isinstance(hf_config, GraniteMoeHybridConfig) and "mamba" in (
            getattr(hf_config, "layer_types", None) or []):
        return "mamba2"
    archs = getattr(hf_config, "architectures", None) or [type(hf_config).__name__]
    raise ValueError(
        f"--enable-replayssm: {archs[0]} has no Mamba-2 or Gated DeltaNet layers ReplaySSM "
        "supports (Mamba-2: NemotronH, FalconH1, GraniteMoeHybrid; GDN: Qwen3-Next, "
        "Qwen3.5); drop the flag to serve it with stock SGLang")


def _uses_mamba_radix_cache(hf_config) -> bool:
    """Whether SGLang serves this model with the mamba radix cache: the guard
    of arg_groups/overrides.py:1476-1486 (_mamba_radix_cache_resolution)."""
    from sglang.srt.arg_groups.overrides import _MAMBA_RADIX_CACHE_ARCHS
    from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_spec_by_arch

    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    if arch == "GraniteMoeHybridForCausalLM":
        in_branch = "mamba" in (getattr(hf_config, "layer_types", None) or [])
    else:
        in_branch = arch in _MAMBA_RADIX_CACHE_ARCHS
    spec = get_linear_attn_spec_by_arch(arch)
    return in_branch or (spec is not None and spec.uses_mamba_radix_cache)


def resolve_radix_cache_strategy(args: argparse.Namespace) -> None:
    """Launcher side, before ServerArgs resolves ``--mamba-radix-cache-strategy
    auto``: with the radix cache on, ReplaySSM's ``auto`` is ``no_buffer``.

    Both strategies cache exact states. ``no_buffer`` caches a finished
    request's own slot (checkpoint, input buffer and cursors: the pool's
    copy_from clones all of them). ``extra_buffer`` snapshots a request into
    its track slot every ``--mamba-track-interval`` tokens; with ReplaySSM
    the snapshot copies the whole slot (backends._ReplayStep.track_decode),
    which is CPU-tested but has not been served yet, so ``auto``, which
    SGLang resolves to extra_buffer on CUDA with overlap scheduling
    (arg_groups/overrides.py:1490-1502), resolves to ``no_buffer`` here, with
    overlap scheduling off as it requires (server_args.py:5575-5582), which
    is what SGLang's own ``auto`` does for models without extra_buffer
    support. An explicit strategy, what no_buffer cannot serve (``--page-size``
    above 1, ``--attention-backend trtllm_mha``: auto then picks
    extra_buffer) and ``--disable-radix-cache`` are left to SGLang."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    if getattr(args, "disable_radix_cache", False):
        return
    if getattr(args, "mamba_radix_cache_strategy", "auto") != "auto":
        return
    page_size = getattr(args, "page_size", None)
    if page_size is not None and page_size > 1:
        return
    if getattr(args, "attention_backend", None) == "trtllm_mha":
        return  # no_buffer refuses it (server_args.py:5580-5582)
    hf_config = get_config(args.model_path, trust_remote_code=getattr(args, "trust_remote_code", False),
                           revision=getattr(args, "revision", None))
    if not _uses_mamba_radix_cache(hf_config):
        return
    args.mamba_radix_cache_strategy = "no_buffer"
    if not getattr(args, "disable_overlap_schedule", False):
        args.disable_overlap_schedule = True
        logger.warning(
            "ReplaySSM: the radix cache keeps each finished request's checkpoint with its "
            "input buffer (--mamba-radix-cache-strategy no_buffer), which needs overlap "
            "scheduling off: --disable-overlap-schedule is set. --mamba-radix-cache-strategy "
            "extra_buffer or --disable-radix-cache keeps overlap scheduling on.")


def prepare_launch(config: ReplayConfig, server_args) -> str:
    """Launcher side of --enable-replayssm: validate the flags against the
    server arguments and the model, then export the configuration for the
    spawned scheduler processes (sglang/srt/entrypoints/engine.py:1670 uses
    spawn; their plugin load installs the pool and backend hooks)."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    validate_against_server_args(config, server_args)
    hf_config = get_config(server_args.model_path,
                           trust_remote_code=server_args.trust_remote_code,
                           revision=getattr(server_args, "revision", None))
    family = model_family(hf_config)
    config.to_env()
    os.environ[FAMILY_ENV] = family
    logger.info("ReplaySSM: %s layers, buffer_len=%d, checkpoint dtype %s, fold copy %s, "
                "decode route %s", family, config.buffer_len, config.checkpoint_dtype,
                config.fold_dtype or "none", config.decode_route)
    return family


# --------------------------------------------------------------------------
# Pool, backends, the Mamba-2 state update and the capacity solver
# (scheduler processes).
# --------------------------------------------------------------------------


def _draft_tokens():
    """Draft tokens per verify step of this server (None without speculative
    decoding): what the capacity solver reads (kv_cache_configurator.py:1889)."""
    from sglang.srt.runtime_context import get_spec

    try:
        return get_spec().speculative_num_draft_tokens
    except ValueError:  # "config namespace 'spec' not published": no server (tests, tools)
        return None


def install_replay_hooks(config: ReplayConfig) -> None:
    """Install every serving hook of ReplaySSM (idempotent):

    * srt/mem_cache/memory_pool.py:1139 ``HybridReqToTokenPool.mamba_pool_cls``
      -> :class:`ReplayMambaPool` bound to ``config`` and the family;
    * srt/layers/attention/attention_registry.py:362-370 imports
      ``Mamba2AttnBackend`` / ``GDNAttnBackend`` from their modules inside
      ``attn_backend_wrapper``: the module attributes become our subclasses;
    * srt/layers/attention/mamba/mamba.py:7-10 binds ``selective_state_update``
      at import; ``MambaMixer2.forward`` (:739-752) calls it for decode rows;
    * srt/configs/mamba_utils.py:116 ``mamba_cache_per_req`` is what the
      capacity solver (srt/mem_cache/kv_cache_configurator.py:1839) charges
      per slot: add the buffers, fold copy and cursors, and with speculative
      decoding the conv windows per draft token;
    * srt/mem_cache/kv_cache_configurator.py:1816 ``_handle_max_mamba_cache``
      with speculative decoding on reserves SGLang's per-draft state scratch
      (:1885-1893 and :1926-1947, ``mamba_cache_per_req`` x drafts per running
      request), which this pool never allocates: the solver runs with the
      algorithm hidden (:1842), so it sizes the pool as without speculative
      decoding, from the per-slot bytes above;
    * srt/layers/attention/hybrid_linear_attn_backend.py:1183
      ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``, which
      the speculative workers' commit reaches (speculative/spec_utils.py:1016,
      called from eagle_worker_common.py:604 and ngram_worker.py:462; the
      hybrid attention wrapper forwards it, hybrid_attn_backend.py:218):
      for a ReplaySSM linear backend, roll the conv state back and move the
      cursors (:func:`backends.commit_after_verify`) instead of scattering
      per-draft state snapshots.
    """
    from sglang.srt.configs.mamba_utils import BaseLinearStateParams
    from sglang.srt.layers.attention import hybrid_linear_attn_backend
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.layers.attention.mamba import mamba as mamba_module
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_replayssm import backends
    from sglang_replayssm.pool import ReplayMambaPool

    config = config.validate()
    family = os.environ.get(FAMILY_ENV) or None
    pool_cls = ReplayMambaPool.with_config(config, family=family)
    _patch(HybridReqToTokenPool, "mamba_pool_cls", pool_cls)
    _patch(hybrid_linear_attn_backend, "Mamba2AttnBackend", backends.ReplayMamba2AttnBackend)
    _patch(gdn_backend, "GDNAttnBackend", backends.ReplayGDNAttnBackend)
    if (mamba_module, "selective_state_update") not in _ORIGINALS:
        backends.set_stock_selective_state_update(mamba_module.selective_state_update)
    _patch(mamba_module, "selective_state_update", backends.selective_state_update)

    stock_per_req = BaseLinearStateParams.__dict__["mamba_cache_per_req"]

    def mamba_cache_per_req(self) -> int:
        return stock_per_req.fget(self) + pool_cls.extra_bytes_per_slot(
            self, speculative_num_draft_tokens=_draft_tokens())

    _patch(BaseLinearStateParams, "mamba_cache_per_req", property(mamba_cache_per_req))

    configurator = KVCacheConfigurator
    stock_solve = configurator.__dict__["_handle_max_mamba_cache"]

    def _handle_max_mamba_cache(self, total_rest_memory):
        algorithm = self.spec_algorithm
        if algorithm.is_none():
            return stock_solve(self, total_rest_memory)
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        try:
            return stock_solve(self, total_rest_memory)
        finally:
            self.spec_algorithm = algorithm

    _patch(configurator, "_handle_max_mamba_cache", _handle_max_mamba_cache)

    hybrid = hybrid_linear_attn_backend.HybridLinearAttnBackend
    stock_commit = hybrid.__dict__["update_mamba_state_after_mtp_verify"]

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices,
                                            mamba_steps_to_track, model,
                                            req_pool_indices=None):
        if not backends.commit_after_verify(self.linear_attn_backend, last_correct_step_indices,
                                            mamba_track_indices, mamba_steps_to_track):
            stock_commit(self, last_correct_step_indices, mamba_track_indices,
                         mamba_steps_to_track, model, req_pool_indices)

    _patch(hybrid, "update_mamba_state_after_mtp_verify", update_mamba_state_after_mtp_verify)
    # SGLang loads plugins before the scheduler configures logging
    # (scheduler.py:4895), so an info line here never reaches the server log;
    # the backend logs "ReplaySSM enabled for N ... layers" once serving starts.
    logger.debug("ReplaySSM hooks installed (family %s, buffer_len %d)", family or "auto",
                 config.buffer_len)


# --------------------------------------------------------------------------
# Test knob: dummy weights at trained-model scale (sglang_replayssm.dummy_init).
# srt/model_loader/loader.py:111 imports initialize_dummy_weights by name and
# DummyModelLoader.load_model calls it (:1456); replace that binding. Installed
# in every process that has SGLANG_REPLAYSSM_DUMMY_INIT=scaled (or echo), stock or not,
# so both arms of a parity comparison get the same weights.
# --------------------------------------------------------------------------

def install_dummy_init_hook(kind: str = "scaled") -> None:
    from sglang.srt.model_loader import loader

    from sglang_replayssm.dummy_init import DUMMY_INITS

    init = DUMMY_INITS[kind]
    what = {"scaled": "trained-model scale",
            "echo": "trained-model scale, LM head = scaled embedding (greedy echo)"}[kind]

    def initialize_dummy_weights(model, low=-1e-3, high=1e-3, seed=1234):
        # logged here, not at install: SGLang loads plugins before it sets up
        # logging in the scheduler process (scheduler.py:4895), so a line
        # logged at install time never reaches the server log
        logger.info("dummy weights of %s: %s, seed %d (%s=%s)",
                    type(model).__name__, what, seed, DUMMY_INIT_ENV, kind)
        init(model, seed=seed)

    _patch(loader, "initialize_dummy_weights", initialize_dummy_weights)


# --------------------------------------------------------------------------
# Test knob: fp32 activations (`--dtype float32`) for greedy-parity runs.
# With bf16 activations a 1e-7 difference in the SSM's fp32 rounding flips
# bf16 roundings downstream and greedy tokens of a random-weight model diverge
# within tens of steps, stock against itself included (benchmarks/NOTES.md).
# SGLang 0.5.17 cannot serve these models in fp32 as shipped: the CUDA paths
# of these MultiPlatformOps call sgl-kernel / flashinfer kernels that dispatch
# fp16/bf16 only (gemma_rmsnorm: "failed to dispatch data type Float"). Each
# op binds its forward_cuda at construction (srt/layers/utils/multi_platform.py:38),
# so the class attribute is wrapped before the model is built: fp32 input
# takes the op's own forward_native, anything else the unchanged CUDA path.
# The GDN chunk prefill has no PyTorch path: it runs fp32 input on bf16
# copies of q/k/v (Qwen3-Next, Qwen3.5). Qwen3.5's fused attention prep is
# replaced by the layer's own PyTorch path for fp32 input.
# Installed in every process with SGLANG_REPLAYSSM_NATIVE_FP32_OPS=1, stock or
# not, so both arms of a comparison compute these ops the same way.
# --------------------------------------------------------------------------

NATIVE_FP32_OPS = (
    ("sglang.srt.layers.layernorm", "RMSNorm"),                  # layernorm.py:405
    ("sglang.srt.layers.layernorm", "GemmaRMSNorm"),             # layernorm.py:922
    ("sglang.srt.layers.activation", "SiluAndMul"),              # activation.py:142
    ("sglang.srt.layers.activation", "GeluAndMul"),              # activation.py:244
    ("sglang.srt.layers.rotary_embedding.base", "RotaryEmbedding"),  # base.py:363
    # Its triton kernel computes fp32 input with tf32 dots and fp16
    # intermediates (moe_runner/triton_utils/fused_moe.py:488), which turns a
    # 1e-7 difference upstream into ~1e-3. forward_native (= forward_cpu,
    # unquant.py:822) is SGLang's per-expert loop (fused_moe_native.py:61):
    # exact fp32, silu only, ignores a routed scaling factor (Qwen3-Next has
    # none), and syncs with the host, so it needs CUDA graphs off
    # (--disable-decode-cuda-graph --disable-prefill-cuda-graph).
    ("sglang.srt.layers.quantization.unquant", "UnquantizedFusedMoEMethod"),  # unquant.py:613
)


_FP32_PATHS_LOGGED: set[str] = set()


def _log_first_fp32_use(what: str) -> None:
    """One server-log line per op the first time fp32 input takes its
    replacement path, so a run's log shows the path was taken (SGLang sets up
    logging only after loading plugins: an install-time line is lost)."""
    if what not in _FP32_PATHS_LOGGED:
        _FP32_PATHS_LOGGED.add(what)
        logger.info("fp32 input: %s (%s=1)", what, NATIVE_FP32_OPS_ENV)


def _native_for_fp32(forward_cuda, name: str, native: str = "forward_native"):
    """``forward_cuda`` for fp32 input replaced by the op's PyTorch method
    ``native`` (called with the same arguments)."""
    import torch

    taken = f"{name} runs its PyTorch path ({native})"  # built once, not per call

    def is_fp32(a):
        a = getattr(a, "hidden_states", a)  # the MoE's dispatch output carries its input
        return isinstance(a, torch.Tensor) and a.dtype == torch.float32

    def forward(self, *args, **kwargs):
        if any(is_fp32(a) for a in (*args, *kwargs.values())):
            _log_first_fp32_use(taken)
            return getattr(self, native)(*args, **kwargs)
        return forward_cuda(self, *args, **kwargs)

    forward.__wrapped__ = forward_cuda
    return forward


def _gdn_chunk_in_bf16_for_fp32(chunk_gated_delta_rule):
    """SGLang's GDN chunk prefill (kernels/ops/attention/fla/chunk.py:211)
    refuses fp32 q/k/v and has no PyTorch path: for fp32 input it runs on
    bf16 copies of q, k, v (g, beta and the state stay fp32, as in a bf16
    server) and its output is returned as fp32. Prefill is this stock kernel
    in both arms of a comparison, so both start decoding from the same state."""
    import torch

    def chunk(*args, **kwargs):
        if kwargs.get("q") is not None and kwargs["q"].dtype == torch.float32 and not args:
            _log_first_fp32_use("GDN chunk prefill runs on bf16 copies of q/k/v")
            for name in ("q", "k", "v"):
                kwargs[name] = kwargs[name].to(torch.bfloat16)
            o, *rest = chunk_gated_delta_rule(**kwargs)
            return (o.float(), *rest)
        return chunk_gated_delta_rule(*args, **kwargs)

    chunk.__wrapped__ = chunk_gated_delta_rule
    return chunk


def install_native_fp32_ops_hook() -> None:
    import importlib

    for module, name in NATIVE_FP32_OPS:
        cls = getattr(importlib.import_module(module), name)
        _patch(cls, "forward_cuda", _native_for_fp32(cls.__dict__["forward_cuda"], name))
    # srt/layers/attention/linear/kernels/gdn_triton.py:9 imports it by name
    # and TritonGDNKernel.extend calls it with keywords (:188)
    gdn_triton = importlib.import_module("sglang.srt.layers.attention.linear.kernels.gdn_triton")
    _patch(gdn_triton, "chunk_gated_delta_rule",
           _gdn_chunk_in_bf16_for_fp32(gdn_triton.__dict__["chunk_gated_delta_rule"]))
    # Qwen3.5's full-attention layers on CUDA prepare q/k/v/gate with one fused
    # GemmaRMSNorm + RoPE + gate kernel (models/qwen3_5.py:1128 ->
    # fused_qk_rmsnorm_rope_gate.py:65) that rounds the normalised q and k to
    # bf16 even for fp32 input (fp32 parity: logprob gaps ~10x Qwen3-Next's,
    # whose attention runs the ops above): fp32 input takes the layer's own
    # forward_prepare_native, the same norm and rope in fp32
    layer = importlib.import_module("sglang.srt.models.qwen3_5").Qwen3_5AttentionDecoderLayer
    _patch(layer, "forward_prepare_cuda_fused",
           _native_for_fp32(layer.__dict__["forward_prepare_cuda_fused"],
                            "Qwen3.5 attention's q/k norm + RoPE + gate",
                            native="forward_prepare_native"))


def uninstall_all() -> None:
    """Undo every patch (tests)."""
    for (owner, name), original in list(_ORIGINALS.items()):
        setattr(owner, name, original)
    _ORIGINALS.clear()
    _FP32_PATHS_LOGGED.clear()
