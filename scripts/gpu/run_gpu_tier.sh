#!/usr/bin/env bash
# The GPU tier in one command, on the offline H200 host (torch 2.11, triton 3.6,
# no sglang, no internet), from the repo root with the bundle carried in .whl517/:
#   bash scripts/gpu/run_gpu_tier.sh [bench_kernels.py args...]
#   FAMILIES="mamba2 gdn" bash scripts/gpu/run_gpu_tier.sh --routes output_only,split
# 1. unpacks the sglang 0.5.17 bundle (scripts/gpu/build_bundle.sh) and sets the
#    offline environment (scripts/gpu/device_setup.sh);
# 2. installs this package in place (replayssm_install: scripts/gpu/link_install.py);
# 3. runs `sglang-replayssm check` and the kernel benchmark once per family
#    of FAMILIES (default mamba2; benchmarks/results/kernels_<family>.{json,md,png});
# 4. runs the GPU-marked tests (bounded by TEST_TIMEOUT, default 300 s).
# Logs and results are also copied to $OUT when it is set (the device tool),
# then packed into $OUT/results.tgz (scripts/gpu/pack_out.sh: the tool brings
# back at most 8 files).
# env: FAMILIES, SKIP_CHECK=1, SKIP_TESTS=1, SKIP_BENCH=1, TEST_TIMEOUT, PACK_OUT=0
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-results}; mkdir -p "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
. scripts/gpu/device_setup.sh .whl517 .model
replayssm_install
echo "[gpu] setup done at $(( $(date +%s) - T0 ))s"
rc=0
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  python3 -m sglang_replayssm check 2>&1 | tee "$OUT/check.log" || rc=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for fam in ${FAMILIES:-mamba2}; do
    python3 scripts/bench_kernels.py --family "$fam" "$@" 2>&1 | tee "$OUT/bench_$fam.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    cp benchmarks/results/kernels_"$fam".* "$OUT/" 2>/dev/null
    echo "[gpu] bench $fam done at $(( $(date +%s) - T0 ))s"
  done
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  echo "[gpu] tests done at $(( $(date +%s) - T0 ))s"
fi
echo "[gpu] done at $(( $(date +%s) - T0 ))s rc=$rc"
bash scripts/gpu/pack_out.sh
exit $rc
