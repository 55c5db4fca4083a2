"""Every SGLang-0.5.17-specific patch of sglang-replayssm, in one place.

Each patch names the sglang file:line it targets (paths relative to the
installed ``sglang/`` package, version 0.5.17). Another sglang version gets a
warning: the targets may have moved.
"""

from __future__ import annotations

import argparse
import logging
import os

from sglang_replayssm.config import CHECKPOINT_DTYPES, ReplayConfig

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
        "(dual precision; Mamba-2 only).",
    )


def config_from_namespace(args: argparse.Namespace) -> ReplayConfig:
    fold = getattr(args, "replayssm_fold_dtype", "none")
    return ReplayConfig(
        enabled=bool(getattr(args, "enable_replayssm", False)),
        buffer_len=getattr(args, "replayssm_buffer_len", ReplayConfig.buffer_len),
        checkpoint_dtype=getattr(args, "replayssm_checkpoint_dtype", "auto"),
        fold_dtype=None if fold == "none" else fold,
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
    if getattr(server_args, "speculative_algorithm", None):
        raise ValueError(
            "--enable-replayssm does not support speculative decoding yet "
            f"(--speculative-algorithm {server_args.speculative_algorithm})"
        )
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ValueError("--enable-replayssm does not support --enable-hierarchical-cache")
    if getattr(server_args, "enable_unified_memory", False):
        raise ValueError("--enable-replayssm does not support --enable-unified-memory")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        raise ValueError(
            "--enable-replayssm does not support PD disaggregation "
            f"(--disaggregation-mode {server_args.disaggregation_mode})"
        )


def install_cli_hooks() -> None:
    from sglang.srt.server_args import ServerArgs

    original_add = ServerArgs.__dict__["add_cli_args"].__func__
    original_from = ServerArgs.__dict__["from_cli_args"].__func__

    def add_cli_args(parser: argparse.ArgumentParser):
        original_add(parser)
        add_replayssm_args(parser)

    def from_cli_args(cls, args: argparse.Namespace):
        config = config_from_namespace(args)
        server_args = original_from(cls, args)
        if config.enabled:
            validate_against_server_args(config, server_args)
            install_replay_hooks(config)  # raises until stages b-d land
            # Children (spawned schedulers) read the config back from env.
            config.to_env()
        return server_args

    _patch(ServerArgs, "add_cli_args", staticmethod(add_cli_args))
    _patch(ServerArgs, "from_cli_args", classmethod(from_cli_args))


def install_replay_hooks(config: ReplayConfig) -> None:
    """Pool and backend hooks (issue 5 stages b-d): not written yet.

    Fail loudly rather than serve with stock kernels under a flag that says
    otherwise.
    """
    raise NotImplementedError(
        "--enable-replayssm: the ReplaySSM pool and attention backends are not "
        "implemented yet (sglang_replayssm.pool / sglang_replayssm.backends)"
    )


def uninstall_all() -> None:
    """Undo every patch (tests)."""
    for (owner, name), original in list(_ORIGINALS.items()):
        setattr(owner, name, original)
    _ORIGINALS.clear()
