"""The fused kernels' plain steps keep the state tile out of the tensor-core
(MMA) layout that only the flush's tl.dot needs.

Triton 3.6 moved such a conversion of a bf16 checkpoint to its load, outside
the flush branch, so that every decode step paid a shared-memory round trip
of the whole tile (GDN b=1 bf16: 5.76 -> 5.12 us per plain step once gone,
benchmarks/NOTES.md 2026-12-04 night); verify had the same with its fold
before the outputs, and the split routes' projection (A) when it folded the
tile it held (fold_cols=0 until 2026-12-04). Also: the launchers' default
configs for verify and flush-only at a serving batch compile without
register spills (they took decode's 64 rows / 2 warps until 2026-12-04:
verify T=4 spilled 1.7-2.9 KB a thread). This compiles the kernels for
sm_90 offline (no GPU: Triton's bundled ptxas) and reads the TTGIR and
ptxas' report: `scripts/kernel_regs.py check`.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nvidia_backend() -> bool:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return False
    import triton

    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "ptxas"))


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its NVIDIA backend / ptxas")
def test_no_state_tile_in_the_mma_layout_outside_the_flush_and_no_spilling_defaults():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kernel_regs.py"), "check"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 2 dtypes x 2 families x (fused decode, fused chain and tree verify, (A)
    # at 2 fold_cols with and without the outputs; no spills at the default
    # chain verify, tree verify and flush-only launch of batch 256, and at
    # the split verify route's (B) for a chain and a tree)
    assert proc.stdout.count(" ok") == 48, proc.stdout
