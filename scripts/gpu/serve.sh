#!/usr/bin/env bash
# One serving-benchmark arm in one device call, on the offline H200 host, from
# the repo root with the bundle in .whl517/ and the models (scripts/make_model.py)
# in .model/:
#   bash scripts/gpu/serve.sh MODEL ARM [bench_serving.py run args...]
#   bash scripts/gpu/serve.sh nemotron-h-8b replayssm --parity
#   bash scripts/gpu/serve.sh qwen3-next-80b sglang-replay --parity
# 1. unpacks the sglang bundle and sets the offline env (device_setup.sh);
# 2. installs this package in place (replayssm_install) so the replayssm arm's
#    plugin is registered;
# 3. runs scripts/bench_serving.py run --model MODEL --arms ARM, bounded by
#    RUN_TIMEOUT (default 570 s: a device command may run 600 s);
# 4. leaves server/bench logs and the partial JSON (e2e_MODEL_ARM.json) in $OUT,
#    packed into $OUT/results.tgz (scripts/gpu/pack_out.sh; PACK_OUT=0: loose).
# env: OUT (default gpu-results/), RUN_TIMEOUT, GIT_COMMIT (recorded in the
# JSON: the device tree has no .git)
set -uo pipefail
[ $# -ge 2 ] || { sed -n 2,16p "$0"; exit 2; }
MODEL=$1; ARM=$2; shift 2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-results}; mkdir -p "$OUT"; export OUT
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
. scripts/gpu/device_setup.sh .whl517 .model
replayssm_install
echo "[serve] setup done at $(( $(date +%s) - T0 ))s"
timeout -k 15 "${RUN_TIMEOUT:-570}" python3 scripts/bench_serving.py run --model "$MODEL" \
  --arms "$ARM" --model-root .model --partial-dir "$OUT" --log-dir "$OUT" "$@"
rc=$?
echo "[serve] done at $(( $(date +%s) - T0 ))s rc=$rc"
bash scripts/gpu/pack_out.sh
exit $rc
