"""Every script under benchmarks/ starts from any working directory: its imports (the package, and
the folder's own ``common`` and ``cases``) resolve through the script's own path setup, not through
the caller's. ``gpu_run.sh`` runs them as ``python benchmarks/<script>.py`` from the repository
root, where ``sys.path[0]`` is benchmarks/ and the package is found only if the script puts the root
on the path (``probe_sdpa_kernels.py`` once did not, and its GPU run stopped at the import).

Each script runs in a fresh interpreter from a temporary folder: argparse scripts with ``--help``
(imports and argument parsing, nothing timed), the others up to their first CUDA use."""

from __future__ import annotations

import os
import site
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "benchmarks")
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and f not in ("common.py", "cases.py"))

# Scripts without a command line: one step past the imports needs a GPU.
NO_ARGS = {"diag_bwd_flaky.py", "probe_mimo_order.py", "probe_sdpa_kernels.py", "profile_attn.py", "sanitize_kernels.py"}


def _run(args, tmp_path):
    """As on the GPU machine, where the package is built in place and not installed: no site
    initialization (so no editable install's finder), only the site-packages folders on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(site.getsitepackages()))
    return subprocess.run([sys.executable, "-S", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_every_script_is_listed():
    """A new script is either an argparse script or named in NO_ARGS, so it gets one of the checks."""
    for f in SCRIPTS:
        with open(os.path.join(BENCH, f), encoding="utf-8") as fh:
            src = fh.read()
        assert ("argparse" in src) != (f in NO_ARGS), f


@pytest.mark.parametrize("script", [f for f in SCRIPTS if f not in NO_ARGS])
def test_script_help_from_any_folder(script, tmp_path):
    r = _run([os.path.join(BENCH, script), "--help"], tmp_path)
    assert r.returncode == 0, f"{script} --help failed:\n{r.stderr[-2000:]}"
    assert "usage" in r.stdout.lower()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these scripts run for real")
@pytest.mark.parametrize("script", sorted(NO_ARGS))
def test_script_imports_from_any_folder(script, tmp_path):
    r = _run([os.path.join(BENCH, script)], tmp_path)
    assert "ModuleNotFoundError" not in r.stderr and "ImportError" not in r.stderr, r.stderr[-2000:]
