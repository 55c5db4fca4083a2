#!/usr/bin/env bash
# Pack everything loose under $OUT into one $OUT/results-<time>.tgz: the
# device tool brings back at most 8 files from $OUT, so a run that leaves
# logs, records and plots loose loses some of them. Archives of earlier packs
# in the same $OUT (several scripts chained in one call) are kept as they are.
#   bash scripts/gpu/pack_out.sh            (PACK_OUT=0 leaves $OUT as it is)
# Here: tar xzf .../results-*.tgz -C somewhere, then copy the records into
# benchmarks/results/.
set -uo pipefail
[ "${PACK_OUT:-1}" = 1 ] || exit 0
[ -n "${OUT:-}" ] && [ -d "$OUT" ] || { echo "[pack] no \$OUT"; exit 0; }
name=results-$(date +%H%M%S).tgz
loose=$(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name 'results-*.tgz' -printf '%P\n')
[ -n "$loose" ] || exit 0
tmp=$(mktemp /tmp/results.XXXXXX.tgz)
( cd "$OUT" && printf '%s\n' "$loose" | tar czf "$tmp" -T - ) \
  || { echo "[pack] tar failed; $OUT left as it is"; rm -f "$tmp"; exit 1; }
( cd "$OUT" && printf '%s\n' "$loose" | xargs -d '\n' rm -rf )
mv "$tmp" "$OUT/$name"
echo "[pack] $OUT/$name: $(du -h "$OUT/$name" | cut -f1)"
