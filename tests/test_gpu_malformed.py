"""CUDA kernels on malformed inputs that pass validation or skip it (``tests/gpu_malformed_inputs.py``):
they run without a crash, and compute-sanitizer memcheck finds no error (issue 17). GPU only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "gpu_malformed_inputs.py")


@pytest.mark.cuda
def test_malformed_inputs_run_on_the_gpu():
    res = subprocess.run([sys.executable, "-X", "faulthandler", SCRIPT], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)  # fmt: skip
    assert res.returncode == 0 and res.stdout.rstrip().endswith("done"), res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.cuda
def test_malformed_inputs_memcheck_clean():
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        pytest.skip("compute-sanitizer not found")
    cmd = [tool, "--tool", "memcheck", "--kernel-regex", "kns=ncp", "--error-exitcode", "99", sys.executable, SCRIPT]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "ERROR SUMMARY: 0 errors" in out, out[-6000:]
