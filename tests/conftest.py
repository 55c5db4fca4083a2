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
