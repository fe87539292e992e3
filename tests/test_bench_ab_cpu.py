"""The A/B scripts' CPU modes run end to end (``benchmarks/ab_host.py``, ``benchmarks/ab_mimo.py``
with ``--device cpu``; ``benchmarks/bench_mimo_layout.py``): this tree against itself, few
repetitions, in a subprocess. They compare the two trees' outputs before timing (the layout A/B:
compiles both), write the JSON that ``render_records.py`` renders, and that page block renders
from it. Timings are not checked (benchmarks measure, tests do not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))


def _run(script, *args, tmp_path):
    out = tmp_path / "ab.json"
    run = subprocess.run([sys.executable, os.path.join("benchmarks", script), "--a", ".", "--b", ".", "--device", "cpu",
                          "--labels", "A", "B", "--json", str(out), *args],
                         capture_output=True, text=True, timeout=600, cwd=_ROOT)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


def test_ab_host_cpu(tmp_path):
    import render_records

    data = _run("ab_host.py", "--rounds", "2", "--reps", "20", tmp_path=tmp_path)
    assert (data["a"], data["b"], data["device"]) == ("A", "B", "cpu")
    calls = [r["call"] for r in data["rows"]]
    assert calls == ["forward, docs", "backward, docs", "forward, table", "backward, table",
                     "sink_attention, autograd forward", "sink_attention, forward + out.backward()",
                     "FlintMagiPlan.attention, cp = 1, autograd forward"]
    assert all(r["a_us"] > 0 and r["b_us"] > 0 and len(r["runs"]["a"]) == 2 for r in data["rows"])
    page = render_records.render_ab_host([str(tmp_path / "ab.json")])
    assert "| backward, table |" in page and "A = `A`, B = `B`" in page


@pytest.mark.parametrize("seq", [64])
def test_ab_mimo_cpu(tmp_path, seq):
    import render_records

    data = _run("ab_mimo.py", "--seq", str(seq), "--rounds", "2", "--reps", "5", tmp_path=tmp_path)
    assert [r["chunks"] for r in data["rows"]] == [1, 4]
    assert all(r["seq"] == seq and r["device"] == "cpu" and r["ref_fastTE_us"] > 0 for r in data["rows"])
    page = render_records.render_ab_mimo([str(tmp_path / "ab.json")])
    assert f"S = {seq} tokens" in page and "CPU tokens" in page


def test_bench_mimo_layout(tmp_path):
    """The C layout pass's A/B (compiled with the system compiler against each tree's csrc/core)."""
    import render_records

    out = tmp_path / "layout.json"
    run = subprocess.run([sys.executable, os.path.join("benchmarks", "bench_mimo_layout.py"), "--a", ".", "--b", ".",
                          "--labels", "A", "B", "--rounds", "1", "--reps", "50", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=_ROOT)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 3
    assert all(r["a_us"] > 0 and r["kernel_words"]["a"] == r["kernel_words"]["b"] > 0 for r in data["rows"])
    assert "| B 8, S 32768, cp 8, 1 chunk |" in render_records.render_ab_host([str(out)])
