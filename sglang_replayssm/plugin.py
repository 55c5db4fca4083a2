"""SGLang entry-point plugin (group ``sglang.srt.plugins``).

SGLang calls ``register()`` in the launcher before it parses the command line
(sglang/launch_server.py:64-66) and again in every scheduler process
(srt/managers/scheduler.py:4895). It only adds the flags, unless ReplaySSM is
enabled (the launcher exported SGLANG_REPLAYSSM_ENABLED=1 for the children):
then it also installs the pool and backend hooks. Nothing CUDA-only is
imported here. ``SGLANG_REPLAYSSM_DUMMY_INIT=scaled`` / ``echo`` (test knobs, stock
or not) swaps SGLang's dummy-weight init for sglang_replayssm.dummy_init;
``SGLANG_REPLAYSSM_NATIVE_FP32_OPS=1`` (the same) lets ``--dtype float32``
serve (sglang_hooks.install_native_fp32_ops_hook).
"""

from __future__ import annotations

import os

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from sglang_replayssm import sglang_hooks
    from sglang_replayssm.config import DUMMY_INIT_ENV, NATIVE_FP32_OPS_ENV, ReplayConfig
    from sglang_replayssm.dummy_init import DUMMY_INITS

    sglang_hooks.check_sglang_version()
    sglang_hooks.install_cli_hooks()
    dummy_init = os.environ.get(DUMMY_INIT_ENV, "")
    if dummy_init not in ("", "sglang", *DUMMY_INITS):
        raise ValueError(f"{DUMMY_INIT_ENV} must be one of {', '.join(DUMMY_INITS)} or sglang, "
                         f"got {dummy_init!r}")
    if dummy_init in DUMMY_INITS:
        sglang_hooks.install_dummy_init_hook(dummy_init)
    native_fp32 = os.environ.get(NATIVE_FP32_OPS_ENV, "")
    if native_fp32 not in ("", "0", "1"):
        raise ValueError(f"{NATIVE_FP32_OPS_ENV} must be '0' or '1', got {native_fp32!r}")
    if native_fp32 == "1":
        sglang_hooks.install_native_fp32_ops_hook()
    config = ReplayConfig.from_env()
    if config.enabled:
        sglang_hooks.install_replay_hooks(config.validate())
    _registered = True
