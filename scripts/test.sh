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
set +e
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
