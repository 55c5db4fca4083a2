"""ReplaySSM serving configuration.

The launcher parses the ``--enable-replayssm`` / ``--replayssm-*`` flags and
exports them as ``SGLANG_REPLAYSSM_*`` environment variables: SGLang starts its
scheduler processes with multiprocessing *spawn*, and environment variables are
the one channel every child inherits before it imports anything of ours.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, MutableMapping, Optional

ENV_PREFIX = "SGLANG_REPLAYSSM_"
# Set by the launcher from the model config: "mamba2" | "gdn" (see sglang_hooks.model_family).
FAMILY_ENV = ENV_PREFIX + "FAMILY"
CHECKPOINT_DTYPES = ("auto", "float32", "bfloat16", "float16")
FOLD_DTYPES = (None, "float32")
# auto: the kernels' default_route(batch) (measured: split from batch 2 for Mamba-2, 8 for GDN)
DECODE_ROUTES = ("auto", "output_only", "split")
# Test knob, read by sglang_replayssm.plugin in every process, stock or not:
# "scaled" = dummy weights at trained-model scale (sglang_replayssm.dummy_init).
DUMMY_INIT_ENV = ENV_PREFIX + "DUMMY_INIT"
# Test knob, read the same way: "1" = SGLang's norm, activation, rotary and
# MoE ops take their own PyTorch path for fp32 input (sgl-kernel's CUDA
# kernels for the first dispatch fp16/bf16 only, the triton MoE rounds fp32
# through tf32 dots and fp16) and its GDN chunk prefill runs fp32 input on
# bf16 copies of q/k/v, so `--dtype float32` serves: greedy parity without
# low-precision rounding amplifying the SSM's fp32 rounding differences.
NATIVE_FP32_OPS_ENV = ENV_PREFIX + "NATIVE_FP32_OPS"


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    enabled: bool = False
    # Tokens buffered per request between two flushes of the checkpoint.
    buffer_len: int = 16
    # dtype of the checkpoint the decode kernels read; 'auto' = --mamba-ssm-dtype.
    checkpoint_dtype: str = "auto"
    # None: one checkpoint. 'float32': a second, precise copy that the flush
    # folds into (dual precision), so the read copy's rounding never enters
    # the recurrence.
    fold_dtype: Optional[str] = None
    # Which decode kernel route: the fused kernel ('output_only') or two
    # launches ('split': projection, which folds on a row's flush step, then
    # outputs; a third fold launch only for GDN with a fold copy); 'auto' picks
    # per batch.
    decode_route: str = "auto"

    def validate(self) -> "ReplayConfig":
        if self.buffer_len < 2:
            raise ValueError(
                f"--replayssm-buffer-len must be >= 2, got {self.buffer_len}"
            )
        if self.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(
                f"--replayssm-checkpoint-dtype must be one of {CHECKPOINT_DTYPES}, "
                f"got {self.checkpoint_dtype!r}"
            )
        if self.fold_dtype not in FOLD_DTYPES:
            raise ValueError(
                f"--replayssm-fold-dtype must be 'none' or 'float32', got {self.fold_dtype!r}"
            )
        if self.decode_route not in DECODE_ROUTES:
            raise ValueError(
                f"--replayssm-decode-route must be one of {DECODE_ROUTES}, got {self.decode_route!r}"
            )
        if self.fold_dtype is not None and self.checkpoint_dtype == "float32":
            raise ValueError(
                "--replayssm-fold-dtype float32 needs a lower-precision "
                "--replayssm-checkpoint-dtype (got float32: the copies would be identical)"
            )
        return self

    # -- environment round trip (launcher -> spawned scheduler processes) --
    def to_env(self, env: Optional[MutableMapping[str, str]] = None) -> None:
        env = os.environ if env is None else env
        env[ENV_PREFIX + "ENABLED"] = "1" if self.enabled else "0"
        env[ENV_PREFIX + "BUFFER_LEN"] = str(self.buffer_len)
        env[ENV_PREFIX + "CHECKPOINT_DTYPE"] = self.checkpoint_dtype
        env[ENV_PREFIX + "FOLD_DTYPE"] = self.fold_dtype or "none"
        env[ENV_PREFIX + "DECODE_ROUTE"] = self.decode_route

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "ReplayConfig":
        env = os.environ if env is None else env
        default = cls()
        fold = env.get(ENV_PREFIX + "FOLD_DTYPE", "none")
        try:
            buffer_len = int(env.get(ENV_PREFIX + "BUFFER_LEN", default.buffer_len))
        except ValueError:
            raise ValueError(
                f"{ENV_PREFIX}BUFFER_LEN must be an integer, "
                f"got {env[ENV_PREFIX + 'BUFFER_LEN']!r}"
            ) from None
        return cls(
            enabled=env.get(ENV_PREFIX + "ENABLED", "0") not in ("", "0", "false", "False"),
            buffer_len=buffer_len,
            checkpoint_dtype=env.get(ENV_PREFIX + "CHECKPOINT_DTYPE", default.checkpoint_dtype),
            fold_dtype=None if fold in ("", "none") else fold,
            decode_route=env.get(ENV_PREFIX + "DECODE_ROUTE", default.decode_route),
        )


def is_enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    return ReplayConfig.from_env(env).enabled
