"""compute-sanitizer synccheck over every attention kernel the dispatcher can pick
(``benchmarks/sanitize_kernels.py attention``: documents with and without a window, both head dims,
the table mask of Flint CP; default, deterministic and portable kernels). Barrier misuse (a named
barrier reached at two ``bar.sync`` instructions, threads of a warp divergent at a barrier) hangs or
corrupts only on some schedules, so it is checked here on every GPU run of the suite; synccheck found
one in the windowed backward (fixed in fdc63704). GPU only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "sanitize_kernels.py")


@pytest.mark.cuda
def test_attention_kernels_synccheck_clean():
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        pytest.skip("compute-sanitizer not found")
    # the package beside these tests, not an install elsewhere
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [tool, "--tool", "synccheck", "--kernel-regex", "kns=ncp", "--error-exitcode", "99", sys.executable, SCRIPT,
           "attention"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "ERROR SUMMARY: 0 errors" in out and "all kernels ran" in out, out[-6000:]
