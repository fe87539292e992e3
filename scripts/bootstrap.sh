#!/usr/bin/env bash
# Fresh-machine setup: a virtualenv in .venv with torch, this package (built in place, CUDA when
# nvcc is found) and the test extras. Idempotent and quiet on a second run.
#   bash scripts/bootstrap.sh            # then use .venv/bin/python
# Environment knobs:
#   NCP_TORCH_SPEC   pip spec for torch when it is missing (default torch==2.13.0; on machines
#                    with a GPU, install the CUDA build of torch you want first, or set this)
#   NCP_UPSTREAM=0   skip installing nemo_automodel 0.7.0 (used by the upstream parity tests)
#   PYTHON           interpreter to create the venv with (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${NCP_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  pip_q "${NCP_TORCH_SPEC:-torch==2.13.0}"
fi
pip_q "setuptools>=64" wheel pytest hypothesis numpy
if [ "${NCP_UPSTREAM:-1}" != "0" ] && ! "$PY" -c "import nemo_automodel" >/dev/null 2>&1; then
  # upstream's MiMo module needs only transformers at import time; --no-deps keeps the rest out
  pip_q --no-deps "nemo-automodel==0.7.0" || echo "bootstrap: nemo-automodel unavailable; upstream tests will skip"
  "$PY" -c "import transformers" >/dev/null 2>&1 || pip_q "transformers==5.18.0" \
    || echo "bootstrap: transformers unavailable; upstream tests will skip"
fi
# Build in place (no build isolation: setup.py needs nothing but setuptools, no torch headers).
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . 2>&1 | tail -3
"$PY" -c "import nemo_cp_native as n; print('bootstrap: nemo_cp_native', n.__version__, n.build_info())"
