"""Build SGLang 0.5.17's model class for each dummy model dir, on the meta device.

    python tests/build_dummy_models.py ROOT NAME...

Prints one JSON line per model: its SGLang class, parameter count, the
class names of the SSM mixers it built (a layer SGLang would serve as
Mamba-2 or GDN) and the embedding / LM head ``--dummy-init echo`` ties. tests/test_make_model.py runs it in a subprocess, because
building a model needs process-wide state: a (one-rank, gloo) distributed
group and the runtime context that ``sglang.srt.runtime_context.publish``
fills from ServerArgs. A config field the model code reads but the config
lacks fails here, on any machine, instead of at server start on a GPU host.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import types

import torch

# the mixers that hold an SSM state (Mamba-2: all three Mamba-2 families)
SSM_MIXERS = {"MambaMixer2", "Qwen3GatedDeltaNet", "Qwen3_5GatedDeltaNet"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(root: str, names: list[str]) -> None:
    if not torch.cuda.is_available():
        # RotaryEmbedding imports vllm's CPU op when CUDA is absent; building
        # on the meta device never calls it
        ops = types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = None
        sys.modules.setdefault("vllm", types.ModuleType("vllm"))
        sys.modules.setdefault("vllm._custom_ops", ops)
    from sglang.srt import runtime_context
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_config

    from sglang_replayssm.dummy_init import echo_parameters

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    initialize_model_parallel(1)
    for name in names:
        path = os.path.join(root, f"{name}-dummy")
        cfg = get_config(path, trust_remote_code=False)
        # NemotronH refuses triton attention (bench_serving.py serves it with flashinfer)
        attention = "flashinfer" if cfg.model_type == "nemotron_h" else "triton"
        server_args = ServerArgs(model_path=path, load_format="dummy", skip_tokenizer_init=True,
                                 attention_backend=attention, sampling_backend="pytorch",
                                 disable_cuda_graph=True, disable_radix_cache=True,
                                 device="cpu")
        runtime_context.publish(server_args, role="scheduler", hf_config=cfg)
        cls, _ = ModelRegistry.resolve_model_cls(cfg.architectures)
        with runtime_context.get_parallel().override(attn_tp_size=1, attn_tp_rank=0,
                                                     attn_dp_size=1, attn_dp_rank=0), \
                torch.device("meta"):
            model = cls(config=cfg)
        mixers = [type(m).__name__ for m in model.modules() if type(m).__name__ in SSM_MIXERS]
        try:  # what --dummy-init echo would tie in this model
            echo = list(echo_parameters(model))
        except ValueError as e:
            echo = str(e)
        print(json.dumps({"name": name, "class": cls.__name__,
                          "params": sum(p.numel() for p in model.parameters()),
                          "ssm_mixers": mixers, "echo": echo}), flush=True)
        runtime_context.reset_context()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
