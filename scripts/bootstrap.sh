#!/usr/bin/env bash
# Fresh-machine setup: a virtualenv in .venv with torch, this package (built in place, CUDA when
# nvcc is found) and the test extras. Idempotent: a second run with nothing changed only checks a
# stamp and the import, and says "up to date".
#   bash scripts/bootstrap.sh            # then use .venv/bin/python
# Environment knobs:
#   NCP_TORCH_SPEC   pip spec for torch when it is missing (default torch==2.13.0; on machines
#                    with a GPU, install the CUDA build of torch you want first, or set this)
#   NCP_UPSTREAM=0   skip installing nemo_automodel 0.7.0 (used by the upstream parity tests)
#   NCP_REBUILD=1    ignore the stamp: reinstall and rebuild
#   NCP_BOOTSTRAP_STAMP_ONLY=1  print the stamp of this tree and exit (tests/test_bootstrap.py)
#   PYTHON           interpreter to create the venv with (default python3)
# The stamp ($VENV/.ncp-bootstrap-stamp) hashes what the install depends on: setup.py,
# pyproject.toml, csrc/, the NCP_PATCH hook module, this script, the build knobs and whether nvcc
# is present. Python sources need no reinstall (the install is editable).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${NCP_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.ncp-bootstrap-stamp"
stamp() {
  {
    find setup.py pyproject.toml nemo_cp_native_hook.py scripts/bootstrap.sh csrc -type f 2>/dev/null | LC_ALL=C sort \
      | xargs sha256sum
    for knob in NCP_NO_CUDA NCP_FORCE_CUDA NCP_CUDA_ARCHS NCP_DEBUG NCP_SANITIZE NCP_UPSTREAM NCP_TORCH_SPEC; do
      echo "$knob=${!knob:-}"
    done
    command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || echo "no nvcc"
    "$PY" -c "import sys; print(sys.version)"
  } | sha256sum | cut -d' ' -f1
}
WANT=$(stamp)
if [ "${NCP_BOOTSTRAP_STAMP_ONLY:-0}" = "1" ]; then
  echo "$WANT"
  exit 0
fi
if [ "${NCP_REBUILD:-0}" = "0" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
  && "$PY" -c "import nemo_cp_native._C" >/dev/null 2>&1; then
  echo "bootstrap: up to date (stamp ${WANT:0:12}; NCP_REBUILD=1 forces a reinstall)"
  exit 0
fi
rm -f "$STAMP"
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  pip_q "${NCP_TORCH_SPEC:-torch==2.13.0}"
fi
pip_q "setuptools>=64" wheel pytest hypothesis numpy
if [ "${NCP_UPSTREAM:-1}" != "0" ] && ! "$PY" -c "import nemo_automodel" >/dev/null 2>&1; then
  # Upstream's MiMo module needs only transformers at import time, so nemo-automodel goes in with
  # --no-deps. pip would then print "ERROR: pip's dependency resolver does not currently take into
  # account ..." and list the dependencies we leave out (megatron-fsdp, torchao, ...): expected,
  # nothing is broken, and --no-warn-conflicts keeps that message out of the log.
  "$PY" -c "import transformers" >/dev/null 2>&1 || pip_q --no-warn-conflicts "transformers==5.18.0" \
    || echo "bootstrap: transformers unavailable; upstream tests will skip"
  if pip_q --no-deps --no-warn-conflicts "nemo-automodel==0.7.0"; then
    echo "bootstrap: nemo-automodel 0.7.0 installed without its dependencies (--no-deps; the tests need only its MiMo module)"
  else
    echo "bootstrap: nemo-automodel unavailable; upstream tests will skip"
  fi
fi
# Build in place (no build isolation: setup.py needs nothing but setuptools, no torch headers).
# The editable install also drops nemo_cp_native_hook.pth into site-packages (NCP_PATCH=1).
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-build-isolation --no-deps -e . 2>&1 | tail -3
"$PY" -c "import nemo_cp_native as n; print('bootstrap: nemo_cp_native', n.__version__, n.build_info())"
"$PY" -m nemo_cp_native_hook status | sed 's/^/bootstrap: /'
echo "$WANT" > "$STAMP"
