#!/usr/bin/env bash
# Set up the CPU test tier on a fresh machine (no GPU needed).
#
# Creates .venv/ in the repo root with torch 2.13.0 (CPU build), triton 3.6.0,
# sglang 0.5.17 installed --no-deps (its pins want a CUDA torch 2.11) plus the
# pure-Python packages its server-side modules import
# (requirements/sglang-cpu.txt), and this package in editable mode.
# Triton kernels then run on CPU tensors under TRITON_INTERPRET=1
# (scripts/test.sh sets it).
#
# usage: bash scripts/setup_test_env.sh        (idempotent; re-run after a pull)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-warn-conflicts)
# torch first and pinned exactly: anything that pulls in a plain `torch`
# later would otherwise fetch a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0 triton==3.6.0
"${PIP[@]}" --no-deps sglang==0.5.17
"${PIP[@]}" -r "$ROOT/requirements/sglang-cpu.txt"
"${PIP[@]}" --no-deps -e "$ROOT"
"${PIP[@]}" pytest pytest-xdist matplotlib
# sglang imports torchvision.io unconditionally; PyPI's torchvision is a CUDA
# build that does not load beside CPU torch. Put the import stub in
# tests/stubs/ on this venv's path (test venv only, never a GPU host).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT/tests/stubs" > "$SITE/sglang_replayssm_test_stubs.pth"
"$VENV/bin/python" - <<'PY'
import torch, triton, sglang
print(f"[setup] torch {torch.__version__}, triton {triton.__version__}, sglang {sglang.__version__}")
PY
