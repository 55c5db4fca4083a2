#!/usr/bin/env bash
# Source on the H200 from the repo root that holds the carried bundle:
#   . scripts/gpu/device_setup.sh [BUNDLE_DIR] [MODEL_ROOT]
# BUNDLE_DIR (default .whl517) holds site.tar.xz from build_bundle.sh;
# MODEL_ROOT (default .model) holds the output of make_model.py.
# Unpacks the bundle to /tmp/site once per machine, puts it and stubsite/ on
# PYTHONPATH, copies the tokenizer into every *-dummy model dir, and sets the
# offline env vars; defines replayssm_install (this checkout installed in place, no pip).
_H200=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_B=$(cd "${1:-.whl517}" && pwd); _M=$(cd "${2:-.model}" 2>/dev/null && pwd)
if [ ! -f /tmp/site/.unpacked ]; then
  _t=$(date +%s)
  xz -dc -T0 "$_B/site.tar.xz" | tar -x -C /tmp
  # the image's typing_extensions is newer; never shadow it
  rm -rf /tmp/site/typing_extensions.py /tmp/site/typing_extensions-*.dist-info
  touch /tmp/site/.unpacked
  echo "[setup] unpacked site in $(( $(date +%s) - _t ))s: $(du -sh /tmp/site | cut -f1)"
fi
export PYTHONPATH=/tmp/site:$_H200/stubsite${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export SGLANG_DISABLE_REQUEST_LOGGING=1
if [ -n "$_M" ] && [ -f "$_M/tok/tokenizer.json.xz" ]; then
  [ -f "$_M/tok/tokenizer.json" ] || xz -dkc "$_M/tok/tokenizer.json.xz" > "$_M/tok/tokenizer.json"
  for d in "$_M"/*-dummy; do
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
      [ -f "$d/$f" ] || cp "$_M/tok/$f" "$d/"
    done
  done
fi

# Make this package importable and its plugin entry point visible without pip:
# the editable `pip install --no-deps --no-index -e .` took ~70 s a call on the
# H200 (against ~2 s here) out of a 30-minute device budget. The link install
# maps pyproject.toml's layout (kernels/ as sglang_replayssm.kernels) with
# a finder in site-packages and writes a dist-info carrying its entry points,
# which importlib.metadata (SGLang's plugin loader) finds in the launcher and
# in every spawned scheduler process (scripts/gpu/link_install.py).
# REPLAYSSM_PIP_INSTALL=1 uses pip instead.
replayssm_install() {
  local t=$(date +%s)
  if [ "${REPLAYSSM_PIP_INSTALL:-0}" = 1 ]; then
    python3 -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
      --no-index -e . 2>&1 | tail -3
  else
    python3 "$_H200/link_install.py" --bin-dir /tmp/replayssm-bin || return 1
    case ":$PATH:" in *:/tmp/replayssm-bin:*) ;; *) export PATH=/tmp/replayssm-bin:$PATH ;; esac
  fi
  echo "[setup] installed sglang-replayssm in $(( $(date +%s) - t ))s"
}
