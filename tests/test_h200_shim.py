"""scripts/gpu/stubsite/sitecustomize.py, the H200 host's environment shim:
with a transformers that renames legacy layer types in every config's
validation (5.17, the image's), SGLang 0.5.17's GraniteMoeHybridConfig gets
its own names back, so the stock and ReplaySSM servers both find their
layers. Simulated here on the pinned transformers (5.12.1, no renaming) by
renaming at the end of PretrainedConfig.__init__, where 5.17 validates."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STUBSITE = os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu", "stubsite")

PROBE = r"""
import json, sys
from transformers import configuration_utils as cu
from transformers import PretrainedConfig
cu._LEGACY_LAYER_TYPE_REMAP = {"mamba": "linear_attention", "attention": "full_attention",
                               "hybrid": "linear_attention"}
base_init = PretrainedConfig.__init__
def renaming_init(self, *a, **k):
    base_init(self, *a, **k)
    if isinstance(getattr(self, "layer_types", None), list):
        self.layer_types = [cu._LEGACY_LAYER_TYPE_REMAP.get(t, t) for t in self.layer_types]
PretrainedConfig.__init__ = renaming_init
from sglang.srt.configs.granitemoehybrid import GraniteMoeHybridConfig
c = GraniteMoeHybridConfig(num_hidden_layers=4, layer_types=["mamba", "mamba", "mamba", "attention"])
print(json.dumps({"layer_types": c.layer_types,
                  "patched": getattr(GraniteMoeHybridConfig, "_h200_layer_types_patched", False)}))
"""


def _probe(env_extra):
    pytest.importorskip("sglang.srt.configs.granitemoehybrid")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(STUBSITE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        **env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_granite_config_keeps_sglangs_layer_names():
    got = _probe({})
    assert got == {"layer_types": ["mamba", "mamba", "mamba", "attention"], "patched": True}


def test_the_simulated_renaming_has_teeth():
    # without the shim the simulated transformers renames them: the probe is real
    got = _probe({"H200_GRANITE_LAYER_TYPES": "0"})
    assert got == {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "patched": False}
