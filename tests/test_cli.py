"""The command line (``python -m sglang_replayssm``), run as a user runs it.

Every test starts a fresh interpreter through ``subprocess`` so that the
command's own handling of ``TRITON_INTERPRET`` (it must be set before the
kernels are imported) is what gets exercised; nothing here relies on
conftest.py. Without CUDA the environment gets ``TRITON_INTERPRET=1``; with
CUDA the kernels compile. About 20 s in all on a CPU.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def _env(interpret: bool | None = True):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret and not HAS_CUDA:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(*args, interpret=True, timeout=120):
    return subprocess.run([sys.executable, "-m", "sglang_replayssm", *args], cwd=ROOT,
                          env=_env(interpret), capture_output=True, text=True, timeout=timeout)


def _ok(proc):
    assert proc.returncode == 0, (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                  f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def test_cli_module_imports_no_triton():
    # the kernels (and triton) must be imported lazily, after the command has
    # had a chance to set TRITON_INTERPRET
    code = ("import sys, sglang_replayssm.cli as c; "
            "assert 'triton' not in sys.modules, 'triton imported at module import'; "
            "assert not any(m.startswith('sglang_replayssm.kernels') for m in sys.modules); "
            "c.build_parser()")
    _ok(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(False),
                       capture_output=True, text=True, timeout=60))


def test_check_json():
    from sglang_replayssm import SGLANG_PIN

    r = json.loads(_ok(_run("check", "--json")).stdout)
    assert r["ok"] is True and r["fails"] == 0
    checks = {c["name"]: c for c in r["checks"]}
    assert all(c["status"] in ("OK", "WARN", "FAIL") for c in checks.values())
    assert r["sglang_pin"] == SGLANG_PIN == "0.5.17"
    assert checks["sglang"]["pin"] == SGLANG_PIN
    assert checks["torch"]["status"] == "OK" and checks["triton"]["status"] == "OK"
    plugin = checks["sglang plugin"]
    assert plugin["status"] in ("OK", "WARN")
    if not plugin["registered"]:
        assert plugin["status"] == "WARN" and "not registered" in plugin["detail"]
    if not HAS_CUDA:
        assert checks["device"]["status"] == "WARN"
        assert "Triton interpreter" in checks["device"]["detail"]
        assert r["interpret"] is True
    kernels = {n: c for n, c in checks.items() if n.startswith("kernel ")}
    for name in ("kernel cursors.commit", "kernel decode (output_only)",
                 "kernel decode (reconstruct)", "kernel decode (split)",
                 "kernel verify (output_only)",
                 "kernel verify (reconstruct)", "kernel flush",
                 "kernel GDN decode (output_only)", "kernel GDN decode (split)",
                 "kernel GDN decode (bf16 + fp32 fold copy)", "kernel GDN verify + flush",
                 "kernel tree verify + accept_path (mamba2)",
                 "kernel tree verify + accept_path (gdn)"):
        assert name in kernels, sorted(kernels)
    for name, c in kernels.items():
        assert c["status"] == "OK", (name, c["detail"])
        assert c["max_rel_err"] is not None and c["max_rel_err"] < r["kernel_rtol"] <= 1e-4


def test_demo_json():
    # a short buffer: two flushes per row in few (interpreted, slow) tokens
    proc = _ok(_run("demo", "--tokens", "10", "--buffer-len", "4", "--layers", "2",
                    "--no-progress", "--json"))
    r = json.loads(proc.stdout)
    c = r["config"]
    assert (c["tokens"], c["layers"], c["buffer_len"], c["batch"]) == (10, 2, 4, 2)
    assert r["passed"] is True
    assert 0 <= r["max_rel_diff"] < 1e-3
    assert r["max_abs_diff"] >= 0
    assert r["max_rel_diff_replayssm_vs_exact"] < 1e-3
    assert r["final_state_max_rel_diff"] < 1e-3
    # 10 tokens, flush every 4: two flushes per row, 2 buffered at the end
    assert r["flushes_per_row"] == 2
    assert r["checkpoint_writes"] == 2 * c["batch"] * c["layers"]
    assert r["end_flush_rows"] == c["batch"]
    tr = r["traffic_per_token_per_layer"]
    S = tr["state_bytes"]
    assert S == c["heads"] * c["headdim"] * c["dstate"] * 4
    assert tr["stock"]["read"] == tr["stock"]["written"] == S
    assert tr["replayssm"]["written"] < S <= tr["replayssm"]["read"]
    assert r["bytes_ratio"] > 1
    assert r["bytes_ratio"] == pytest.approx(tr["stock"]["total"] / tr["replayssm"]["total"])


def test_demo_text_and_exit_code():
    # the human-readable form; the progress bar goes to stderr
    proc = _ok(_run("demo", "--tokens", "6", "--buffer-len", "4", "--layers", "2"))
    out = proc.stdout
    m = re.search(r"max abs diff (\S+)\s+max rel diff (\S+)", out)
    assert m, out
    assert float(m.group(2)) < 1e-3
    m = re.search(r"ratio stock / ReplaySSM: ([\d.]+)x", out)
    assert m and float(m.group(1)) > 1, out
    assert re.search(r"flushes: 1 per request row", out), out
    assert "analytic" in out and "result: OK" in out
    assert "decoding" in proc.stderr  # tqdm


def test_demo_fails_when_over_tolerance():
    proc = _run("demo", "--tokens", "2", "--layers", "1", "--no-progress", "--json",
                "--tolerance", "0")
    assert proc.returncode == 1, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["passed"] is False and r["max_rel_diff"] > 0


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter is only switched on without CUDA")
def test_sets_triton_interpret_itself():
    proc = _ok(_run("demo", "--tokens", "2", "--layers", "1", "--no-progress", "--json",
                    interpret=False))
    r = json.loads(proc.stdout)
    assert r["interpret"] is True and r["passed"] is True
    assert any("TRITON_INTERPRET" in n for n in r["notes"])


def test_state_traffic_analytic():
    from sglang_replayssm.cli import state_traffic

    t = state_traffic(4, 32, 64, 2, 16, 4, 4)
    S = 4 * 32 * 64 * 4
    E = (4 * 32 + 2 * 64) * 4 + 4 * 4
    assert t["state_bytes"] == S and t["buffer_entry_bytes"] == E
    assert t["replayssm"]["read"] == pytest.approx(S + E * 15 / 2)
    assert t["replayssm"]["written"] == pytest.approx(S / 16 + E * 15 / 16)
    # buffer_len 1: every token flushes, nothing is buffered -> same as stock
    assert state_traffic(4, 32, 64, 2, 1, 4, 4)["ratio"] == pytest.approx(1.0)
    # a large state against small entries approaches (never reaches) 2x
    assert 1.8 < state_traffic(80, 64, 128, 1, 16, 4, 2)["ratio"] < 2
