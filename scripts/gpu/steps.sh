#!/usr/bin/env bash
# One device call running named steps in order, each bounded by what is left
# of the call's budget (a device command may run 600 s; a cold machine costs
# minutes, so one call should carry every step that fits):
#   bash scripts/gpu/steps.sh BUDGET_S STEP...
#   bash scripts/gpu/steps.sh 570 auto        # H200: km parity pytest; else parity pytest + Falcon-H1, Granite parity
#   bash scripts/gpu/steps.sh 570 nemo        # Nemotron-H-8B served, three arms
# Steps (the records benchmarks/NOTES.md lists for the next GPU session):
#   pytest        GPU-marked tests
#   pytest:EXPR   the tests pytest -k EXPR selects, on the GPU (e.g. pytest:tree)
#   km / kg       kernel records kernels_{mamba2,gdn}_h200 (FlashInfer's JIT ~3 min cold)
#   kv[:ITEMS]    verify kernels (chain and tree) vs SGLang's snapshotting verify,
#                 both families, fp32 (kernels_verify_<gpu>; FlashInfer's JIT ~3 min cold);
#                 ITEMS: other arms of ours timed beside the default: launch shapes
#                 ROWSxWARPS and routes (e.g. kv:split or kv:split,16x8)
#   kg-dual       GDN dual precision vs a plain fp32 checkpoint (kernels_gdn_fold_<gpu>)
#   dual[:M]      the same served: ours with an fp32 checkpoint, then with a bf16 read
#                 copy + fp32 fold copy (default M qwen3-next-80b)
#   parity[:M]    fp32-activation greedy parity, stock triton vs ours, of the 4-layer
#                 model M (default qwen3-next-80b-4layer; e.g. parity:falcon-h1-4layer)
#   parity-floor[:M]  the same plus each arm against itself in groups of 8 (noise floor)
#   parity-ours[:M]   only our arm (its dump merges with a stock partial kept from an
#                 earlier call: bench_serving.py merge checks both saw the same prompts)
#   radix[:M]     the radix cache: second turns against cached first turns vs from
#                 scratch, per arm, fp32 activations (default M qwen3-next-80b-4layer)
#   radix-extra[:M]  ours alone with --mamba-radix-cache-strategy extra_buffer (track
#                 snapshots every 64 tokens, decode ones with a part-full buffer)
#   spec[:M]      speculative decoding (NGRAM, 8 drafts) served, stock triton vs ours,
#                 greedy tokens dumped (default M qwen3-next-80b-4layer)
#   spec-accept[:M] the same with echo dummy weights (drafts accepted), bs 1/16/64, speed
#   spec-fp32[:M] the same with fp32 activations and triton attention: greedy parity
#   spec-nextn[:M] NEXTN (an MTP draft, dummy weights), a chain of 4 drafts
#   nemo / qwen   served bs 1/64/256, 1 warm-up + 2 measured runs: Nemotron-H-8B (flashinfer, ours, triton),
#                 Qwen3-Next-80B (triton, ours, SGLang's replay); nemo:A,B / qwen:A,B
#                 runs only those arms (three 80B-class arms may not fit one call);
#                 BATCHES="1 256" overrides the batch sizes
# Everything lands in $OUT, packed into one archive (pack_out.sh). The device
# tree has no .git: the commit comes from GIT_COMMIT or the file .gpu_commit.
set -uo pipefail
[ $# -ge 2 ] || { sed -n 2,20p "$0"; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd); cd "$ROOT"
T0=$(date +%s); BUDGET=$1; shift
OUT=${OUT:-$ROOT/gpu-results}; mkdir -p "$OUT"; export OUT
[ -n "${GIT_COMMIT:-}" ] || { [ -f .gpu_commit ] && export GIT_COMMIT=$(cat .gpu_commit); }
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [ "$1" = auto ]; then
  case $G in *H200*) set -- km parity pytest "${@:2}" ;; *) set -- parity pytest parity:falcon-h1-4layer parity:granite-4.0-h-4layer "${@:2}" ;; esac
fi
echo "[steps] $G at ${GIT_COMMIT:-unknown commit}: $*"
. scripts/gpu/device_setup.sh .whl517 .model >/dev/null 2>&1
replayssm_install >/dev/null 2>&1 || { echo "[steps] install failed"; exit 1; }
echo "[steps] setup done at $(( $(date +%s) - T0 ))s"
# a bench_serving.py run bounded by the time left ($l, set per step)
serve() {
  timeout -k 10 "$l" python3 scripts/bench_serving.py run --model-root .model \
    --partial-dir "$OUT" --log-dir "$OUT" "$@" 2>&1 | tail -25
}
# speculative decoding of the spec steps: NGRAM needs no draft model; 8 drafts
# in a tree (SGLang's default breadth 10), under --replayssm-buffer-len 16
NGRAM="--speculative-algorithm NGRAM --speculative-num-draft-tokens 8 --max-running-requests 64"
for step in "$@"; do
  l=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$l" -gt 30 ] || { echo "[steps] no time left for $step"; break; }
  echo "[steps] $step at $(( $(date +%s) - T0 ))s, ${l}s left"
  case $step in
    pytest) timeout -k 5 "$l" python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 \
              | tee "$OUT/pytest_gpu.log" | tail -5 ;;
    pytest:*) # the CPU tests selected by -k EXPR, compiled for the GPU
      timeout -k 5 "$l" python3 -m pytest -q tests/ -k "${step#*:}" -p no:cacheprovider 2>&1 \
        | tee "$OUT/pytest_k.log" | tail -5 ;;
    parity|parity:*|parity-floor|parity-floor:*|parity-ours|parity-ours:*)
      floor=(); case $step in parity-floor*) floor=(--parity-floor-group 8) ;; esac
      arms=(stock-triton replayssm); case $step in parity-ours*) arms=(replayssm) ;; esac
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b-4layer
      serve --model "$model" --arms "${arms[@]}" --parity "${floor[@]}" \
        --dummy-init scaled --fp32-activations --batch-sizes 1 --output-len 16 --warmup-runs 0 \
        --health-timeout 200 ;;
    km) timeout -k 10 "$l" python3 scripts/bench_kernels.py --out-dir "$OUT" --family mamba2 \
          --batches 1,2,4,8,32,64,128,256,512 --routes output_only,split --breakdown \
          --deadline-s $(( l > 270 ? 240 : l - 30 )) --name kernels_mamba2_h200 2>&1 | tail -30 ;;
    kg) timeout -k 10 "$l" python3 scripts/bench_kernels.py --out-dir "$OUT" --family gdn \
          --routes output_only,split --breakdown --deadline-s $(( l - 40 )) \
          --name kernels_gdn_h200 2>&1 | tail -30 ;;
    kv|kv:*) gpu=$(case $G in *H200*) echo h200;; *H100*) echo h100;; *) echo gpu;; esac)
      # kv:ITEMS: ROWSxWARPS items are launch shapes (--configs), others routes (--routes)
      items=${step#kv}; items=${items#:}; cfgs=(); routes=()
      for it in ${items//,/ }; do
        if [[ $it =~ ^[0-9]+x[0-9]+$ ]]; then cfgs+=("$it"); else routes+=("$it"); fi
      done
      timeout -k 10 "$l" python3 scripts/bench_verify.py --out-dir "$OUT" --batches 256,64,1 \
        --configs "$(IFS=,; echo "${cfgs[*]}")" --routes "$(IFS=,; echo "${routes[*]}")" \
        --deadline-s $(( l - 30 )) --name "kernels_verify_$gpu" 2>&1 | tail -30 ;;
    kg-dual) # GDN dual precision (bf16 read copy + fp32 fold copy) beside a plain
      # fp32 checkpoint, one run: is the cheap read worth the recomputing fold?
      gpu=$(case $G in *H200*) echo h200;; *H100*) echo h100;; *) echo gpu;; esac)
      timeout -k 10 "$l" python3 scripts/bench_kernels.py --out-dir "$OUT" --family gdn \
        --shapes qwen3-next-80b --batches 64,256 --buffer-lens 16 --routes split \
        --gdn-fold-copy --breakdown --deadline-s $(( l - 40 )) \
        --name "kernels_gdn_fold_$gpu" 2>&1 | tail -30 ;;
    dual|dual:*) # served GDN dual precision (bf16 read copy + fp32 fold copy, its
      # partial labelled replayssm-bfloat16, the fold flag in its launch command)
      # after a plain fp32 checkpoint, on the same machine
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b
      serve --model "$model" --arms replayssm --batch-sizes 1 64 256 --repeats 2 \
        --health-timeout 300
      l=$(( BUDGET - ($(date +%s) - T0) ))
      [ "$l" -gt 60 ] && serve --model "$model" --arms replayssm --checkpoint-dtype bfloat16 \
        --server-args "--replayssm-fold-dtype float32" --batch-sizes 1 64 256 --repeats 2 \
        --health-timeout 200 ;;
    radix|radix:*) # the radix cache (ReplaySSM: no_buffer, the slot with its
      # buffer cached): second turns against the cached first turns (16 greedy
      # tokens: 15 in the buffer) vs the same from scratch, per arm, fp32
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b-4layer
      serve --model "$model" --arms stock-triton replayssm --parity --radix-cache --radix-check \
        --dummy-init scaled --fp32-activations --batch-sizes 1 --output-len 16 --warmup-runs 0 \
        --parity-tokens 16 --health-timeout 200 ;;
    radix-extra|radix-extra:*) # the same for ours with extra_buffer (overlap
      # scheduling on): snapshots every 64 tokens, prompts of 500 so that the
      # decode snapshots (at 512 and 576) find the buffer 12 entries full
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b-4layer
      serve --model "$model" --arms replayssm --parity --radix-cache --radix-check \
        --dummy-init scaled --fp32-activations --batch-sizes 1 --output-len 16 --warmup-runs 0 \
        --input-len 500 --parity-tokens 80 --health-timeout 200 \
        --server-args "--mamba-radix-cache-strategy extra_buffer --mamba-track-interval 64" ;;
    spec|spec:*) # speculative decoding served (NGRAM: no draft model, a tree of
      # drafts), stock triton vs ours, bf16, scaled dummy weights: both serve,
      # greedy tokens dumped for the parity record (default M qwen3-next-80b-4layer)
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b-4layer
      serve --model "$model" --arms stock-triton replayssm --parity --dummy-init scaled \
        --batch-sizes 1 16 --output-len 64 --warmup-runs 0 --health-timeout 240 \
        --server-args "$NGRAM --cuda-graph-max-bs-decode 64" ;;
    spec-accept|spec-accept:*) # the same with drafts accepted: echo dummy weights
      # (greedy output repeats the last prompt token, which NGRAM finds), so
      # a verify keeps most of its 8 drafts; bs 1-64, speed only (no parity)
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b-4layer
      serve --model "$model" --arms stock-triton replayssm --dummy-init echo \
        --batch-sizes 1 16 64 --output-len 128 --warmup-runs 0 --health-timeout 240 \
        --server-args "$NGRAM --cuda-graph-max-bs-decode 64" ;;
    spec-nextn|spec-nextn:*) # the same with NEXTN: a draft model (the MTP layer
      # SGLang derives from the config, dummy weights), a chain of 4 (SGLang's
      # deduplicated conv windows, unlike NGRAM's tree)
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b-4layer
      serve --model "$model" --arms stock-triton replayssm --parity --dummy-init scaled \
        --batch-sizes 1 16 --output-len 64 --warmup-runs 0 --health-timeout 300 \
        --server-args "--speculative-algorithm NEXTN --speculative-draft-model-path $ROOT/.model/$model-dummy --speculative-draft-load-format dummy --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --max-running-requests 64 --cuda-graph-max-bs-decode 64" ;;
    spec-fp32|spec-fp32:*) # the same with fp32 activations (greedy parity), but
      # triton attention: torch_native has no speculative verify
      model=${step#*:}; [ "$model" = "$step" ] && model=qwen3-next-80b-4layer
      serve --model "$model" --arms stock-triton replayssm --parity --dummy-init scaled \
        --fp32-activations --batch-sizes 1 --output-len 16 --warmup-runs 0 \
        --health-timeout 200 --server-args "$NGRAM --attention-backend triton" ;;
    nemo|nemo:*|qwen|qwen:*)
      case $step in
        nemo*) model=nemotron-h-8b; arms="stock-flashinfer replayssm stock-triton"; h=280 ;;
        # a cold machine's first 80B arm: 127 s (12-07 twelfth) to over 240 s
        # (12-07 thirteenth: its prefill CUDA graphs took 149 s)
        qwen*) model=qwen3-next-80b; arms="stock-triton replayssm sglang-replay"; h=300 ;;
      esac
      case $step in *:*) arms=${step#*:}; arms=${arms//,/ } ;; esac
      # shellcheck disable=SC2086  # one word per arm
      # shellcheck disable=SC2086  # BATCHES: e.g. "1 256" when device time is short
      serve --model "$model" --arms $arms --batch-sizes ${BATCHES:-1 64 256} --repeats 2 \
        --health-timeout "$h" ;;
    *) echo "[steps] unknown step $step" ;;
  esac
done
echo "[steps] done at $(( $(date +%s) - T0 ))s"
bash scripts/gpu/pack_out.sh
