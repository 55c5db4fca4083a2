"""scripts/make_model.py: every config parses through SGLang 0.5.17's own config
classes (get_config) and gives the SSM state shape the script meant."""
from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import make_model  # noqa: E402

get_config = pytest.importorskip("sglang.srt.utils.hf_transformers_utils").get_config
from sglang.srt.runtime_context import get_parallel  # noqa: E402


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    make_model.write_model_configs(str(root))
    return str(root)


def test_every_model_and_its_4layer_variant_exist():
    names = set(make_model.MODELS)
    for base in ("nemotron-h-8b", "nemotron-3-nano-4b", "qwen3-next-80b", "qwen3.5-4b"):
        assert base in names and f"{base}-4layer" in names
    assert {"falcon-h1-4layer", "granite-4.0-h-4layer"} <= names


@pytest.mark.parametrize("name", sorted(make_model.MODELS))
def test_sglang_derives_the_intended_ssm_shape(model_root, name):
    cfg_json, want = make_model.MODELS[name]
    path = make_model.model_dir(model_root, name)
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json"]
    cfg = get_config(path, trust_remote_code=False)
    assert cfg.architectures == cfg_json["architectures"]
    with get_parallel().override(attn_tp_size=1):
        params = cfg.mamba2_cache_params
    shape = params.shape
    assert shape.temporal == (want["heads"], want["head_dim"], want["state"])
    # conv channels = x (heads * head_dim) + B and C (2 * groups * state)
    assert shape.conv_dim == want["heads"] * want["head_dim"] + 2 * want["groups"] * want["state"]
    assert shape.num_k_heads_per_tp == want["groups"]
    assert len(list(params.layers)) == want["layers"]
    assert cfg.vocab_size == make_model.VOCAB
    if cfg_json["model_type"] == "nemotron_h":
        # the mixer reads mamba_n_groups, the cache params n_groups (docs/SGLANG_0517.md 3.2)
        assert cfg.mamba_n_groups == cfg.n_groups == want["groups"]
        assert cfg.conv_kernel == 4
    if cfg_json["model_type"] in ("qwen3_next", "qwen3_5_text"):
        assert cfg.linear_num_key_heads == want["groups"]
    if cfg_json["model_type"] == "qwen3_5_text":
        # the dense text model: no MoE fields, SGLang's MLP choice reads the type
        assert "moe" not in cfg.model_type and "num_experts" not in cfg_json


def test_every_model_builds_in_sglang(model_root):
    """SGLang's own model class builds from every config (meta device, in a
    subprocess: tests/build_dummy_models.py) with one SSM mixer per SSM
    layer of the intended family. A field the model code reads but the
    config lacks fails here, not at server start on a GPU host (the Qwen3.5
    attention reads rope_theta from rope_parameters, for one)."""
    helper = os.path.join(os.path.dirname(__file__), "build_dummy_models.py")
    proc = subprocess.run([sys.executable, helper, model_root, *make_model.MODELS],
                          capture_output=True, text=True, timeout=600)
    built = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            built[rec["name"]] = rec
    assert proc.returncode == 0 and set(built) == set(make_model.MODELS), proc.stderr[-3000:]
    mixer = {"mamba2": {"MambaMixer2"}, "gdn": {"Qwen3GatedDeltaNet", "Qwen3_5GatedDeltaNet"}}
    for name, (cfg_json, want) in make_model.MODELS.items():
        rec = built[name]
        assert rec["class"] == cfg_json["architectures"][0]
        assert len(rec["ssm_mixers"]) == want["layers"], name
        assert set(rec["ssm_mixers"]) <= mixer[want["family"]], name
        # --dummy-init echo finds the token embedding and the LM head
        assert isinstance(rec["echo"], list) and "embed" in rec["echo"][0], (name, rec["echo"])
    # sizes the names promise (dummy vocab 131072; Qwen3-Next keeps 64 of 512 experts)
    assert 7.5e9 < built["nemotron-h-8b"]["params"] < 8.5e9
    assert 3.5e9 < built["nemotron-3-nano-4b"]["params"] < 4.5e9
    assert 3.5e9 < built["qwen3.5-4b"]["params"] < 4.5e9


def test_real_layer_counts():
    # the full-size configs keep the real layer patterns
    assert make_model.MODELS["nemotron-h-8b"][0]["hybrid_override_pattern"].count("*") == 4
    assert len(make_model.MODELS["nemotron-h-8b"][0]["hybrid_override_pattern"]) == 52
    assert len(make_model.MODELS["nemotron-3-nano-4b"][0]["hybrid_override_pattern"]) == 42
    assert make_model.MODELS["qwen3-next-80b"][0]["num_hidden_layers"] == 48
    assert make_model.MODELS["qwen3-next-80b"][0]["num_experts"] == 64
    assert make_model.MODELS["qwen3.5-4b"][0]["num_hidden_layers"] == 32


def test_tiny_tokenizer_is_deterministic_and_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "def f(x): return x + 1\n" * 20]
    dirs = []
    for run in ("a", "b"):
        d = tmp_path / run
        assert make_model.make_tokenizer(str(d), vocab_size=400, corpus=iter(corpus)) <= 400
        dirs.append(d)
    blobs = [lzma.open(d / "tokenizer.json.xz").read() for d in dirs]
    assert blobs[0] == blobs[1]
    (dirs[0] / "tokenizer.json").write_bytes(blobs[0])  # what device_setup.sh does
    tok = transformers.AutoTokenizer.from_pretrained(str(dirs[0]))
    assert len(tok) == 400
    ids = tok.encode("the lazy fox")
    assert tok.decode(ids) == "the lazy fox"
    assert json.load(open(dirs[0] / "tokenizer_config.json"))["eos_token"] == "</s>"


@pytest.mark.parametrize("name", sorted(make_model.MODELS))
def test_replayssm_family_of_every_model(model_root, name):
    from sglang_replayssm.sglang_hooks import model_family

    cfg = get_config(make_model.model_dir(model_root, name), trust_remote_code=False)
    assert model_family(cfg) == make_model.MODELS[name][1]["family"]


def test_replayssm_refuses_a_model_without_ssm_layers(non_ssm_model):
    from sglang_replayssm.sglang_hooks import model_family

    cfg = get_config(str(non_ssm_model), trust_remote_code=False)
    with pytest.raises(ValueError, match="--enable-replayssm: LlamaForCausalLM has no Mamba-2"):
        model_family(cfg)
