#!/usr/bin/env bash
# Run the test suite on any machine (after scripts/setup_test_env.sh).
# Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1)
# and GPU-marked tests are skipped. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${VENV:-$ROOT/.venv}/bin/python
cd "$ROOT"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export TRITON_INTERPRET=1
fi
# one worker per core (pytest-xdist, from setup_test_env.sh): the interpreted
# kernels are CPU bound, and 2 workers took the suite from ~24 to ~18 min on
# 2 cores (~6.5 min since tests/conftest.py patches the interpreter's
# language once per launch: 393 s at f6d8832). PYTEST_WORKERS=0 runs it in
# one process.
WORKERS=()
if "$PY" -c 'import xdist' 2>/dev/null; then
  WORKERS=(-n "${PYTEST_WORKERS:-auto}")
fi
set +e
"$PY" -m pytest -q -p no:cacheprovider "${WORKERS[@]}" "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
