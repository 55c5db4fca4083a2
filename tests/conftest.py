"""Shared test setup.

* Without CUDA the Triton kernels run on CPU tensors through Triton's
  interpreter. Triton reads ``TRITON_INTERPRET`` when ``@triton.jit``
  decorates a kernel, i.e. when the kernel module is *imported* (and the
  launchers read it again at launch to pick the dot precision), so it has to
  be set before any test module imports ``sglang_replayssm.kernels``.
  pytest imports this file before it collects the test modules, so setting it
  here at import time is early enough; ``_check_interpreter`` below fails
  loudly if a kernel module got imported first anyway.
* ``@pytest.mark.gpu`` tests (marker declared in pyproject.toml) are skipped
  without CUDA.
* ``device`` fixture: "cuda" when available, else "cpu".
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _check_interpreter():
    if HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime.interpreter import InterpretedFunction
    for name in ("sglang_replayssm.kernels.mamba2_replay", "sglang_replayssm.kernels.cursors",
                 "sglang_replayssm.kernels.projection", "sglang_replayssm.kernels.fold",
                 "sglang_replayssm.kernels.gdn_replay"):
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for attr in ("_mamba2_replay_kernel", "_mamba2_split_outputs_kernel",
                     "_mamba2_split_fold_kernel", "_mamba2_split_projection_kernel",
                     "_projection_kernel", "_commit_kernel",
                     "split_fold_kernel", "_gdn_replay_kernel", "_gdn_split_outputs_kernel",
                     "_gdn_split_projection_kernel"):
            fn = getattr(mod, attr, None)
            if fn is not None and not isinstance(fn, InterpretedFunction):
                raise RuntimeError(
                    f"{name}.{attr} was compiled for a GPU: the module was imported before "
                    "TRITON_INTERPRET=1 was set (export it, or import kernels only in tests)")


_check_interpreter()


def _patch_the_language_once_per_launch():
    """Triton 3.6's interpreter re-patches triton.language (inspect.getmembers
    over tl, tl.tensor and tl.math) on every call of a @triton.jit helper,
    although the launch running it has patched the same module already and
    restores it only when the launch ends. Our kernels call helpers per draft
    and per ring read, so this was ~40% of an interpreted verify test's time
    (cProfile, 2026-12-07). Inside a launch, a helper whose language modules
    (tl, or tl.core for Triton's own helpers) were all patched earlier in the
    launch gets an empty scope; everything else is patched as before."""
    if HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch is None or scope_cls is None or executor is None:  # another Triton
        return
    launches = []  # per launch running now: the language modules patched in it

    def langs_of(fn):
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_once(fn):
        langs = langs_of(fn)
        if launches and langs <= launches[-1]:
            return scope_cls()
        scope = patch(fn)
        if launches:
            launches[-1] |= langs
        return scope

    launch = executor.__call__

    def launch_patching_once(self, *args, **kwargs):
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_once
    executor.__call__ = launch_patching_once


_patch_the_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def get_device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def device() -> str:
    return get_device()


@pytest.fixture
def non_ssm_model(tmp_path):
    """A model dir whose config.json is a tiny Llama (no SSM layers): what
    --enable-replayssm must refuse at startup."""
    import json

    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 256}))
    return path
