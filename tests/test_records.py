"""BENCHMARKS.md is generated: every block matches the raw JSON it names, every file under
benchmarks/results/ is cited, and the page stays one page."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def records():
    return _module("render_records")


def test_page_matches_its_sources(records):
    assert records.main(["--check"]) == 0


def test_every_result_file_is_cited_and_the_page_is_short(records):
    with open(records.PAGE) as f:
        page = f.read()
    with open(records.EXPERIMENTS) as f:
        experiments = f.read()
    assert len(page.splitlines()) <= 200  # the figures of record on one page: prune superseded runs
    assert {"attn", "attn-extra", "mimo", "flint", "host"} <= {kind for kind, _ in records.blocks(page)}
    assert {"tried", "ab", "order"} <= {kind for kind, _ in records.blocks(experiments)}
    for name in os.listdir(os.path.join(_ROOT, "benchmarks", "results")):
        path = f"benchmarks/results/{name}"
        assert path in page or path in experiments, f"{name} is cited by neither BENCHMARKS.md nor docs/EXPERIMENTS.md"


def test_import_of_a_new_run_rerenders_the_page(records, tmp_path, monkeypatch):
    """A gpu_run.sh output folder in the current JSON format (both timings, a GPU MiMo run)."""
    attn = {"env": {"date": "2030-01-02T03:04:05+00:00", "commit": "abc1234", "gpu": "NVIDIA H200", "torch": "2.11",
                    "cuda": "13.0", "python": "3.12", "argv": "benchmarks/bench_sink_attention.py --json x",
                    "methods": ["do_bench", "queued"]},
            "rows": [{"case": "c", "impl": impl, "tokens": 65536, "doc": 8192, "heads": "32/4", "D": 128, "window": 0,
                      **{f"{k}{s}": v for s in ("", "_queued") for k, v in
                         (("fwd_ms", 1.0), ("fwd_tflops", tf), ("fwdbwd_ms", 3.0), ("fwdbwd_tflops", tf / 2))}}
                     for impl, tf in (("ncp", 500.0), ("ncp-nosink", 501.0), ("flex+sink", 400.0))]}  # fmt: skip
    mimo = {"env": {**attn["env"], "argv": "bench_mimo_shard.py"}, "device": "cuda",
            "rows": [{"case": "B8", "impl": "native", "ms": 0.3, "syncs": 1, "pass_ms": 0.01, "pass_GB/s": 400.0},
                     {"case": "B8", "impl": "ref(fastTE)", "ms": 1.5, "syncs": 18}]}  # fmt: skip
    run = tmp_path / "out"
    run.mkdir()
    (run / "bench_attn.json").write_text(json.dumps(attn))
    (run / "bench_mimo.json").write_text(json.dumps(mimo))
    root = tmp_path / "repo"
    shutil.copytree(os.path.join(_ROOT, "benchmarks", "results"), root / "benchmarks" / "results")
    shutil.copy(records.PAGE, root / "BENCHMARKS.md")
    monkeypatch.setattr(records, "ROOT", str(root))
    page = str(root / "BENCHMARKS.md")
    assert records.main(["--import", str(run), "--page", page]) == 0
    text = (root / "BENCHMARKS.md").read_text()
    assert "2030-01-02_abc1234_attn.json" in text and "| c | 64k, 8k docs, 32/4/128, causal | 500.0 / 250.0 |" in text
    assert "ours, queued" in text and "**do_bench**" in text
    assert "2030-01-02_abc1234_mimo.json" in text and "0065101_mimo_cpu.json" in text  # the CPU run stays
    assert "| NVIDIA H200 | B8 | 0.300 (1 sync) |" in text
    assert records.main(["--check", "--page", page]) == 0


def test_srcprof_summary_counts_samples_by_reason_kind_and_instruction(tmp_path):
    """benchmarks/srcprof_summary.py on a small SASS page in Nsight Compute's CSV layout."""
    summary = _module("srcprof_summary")
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_barrier",
            "stall_wait (Not Issued)"]  # fmt: skip
    body = [["0x1000", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "10", "10", "0", "9"],
            ["0x1010", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "30", "0", "30", "0"],
            ["0x1020", "MUFU.EX2 R5, R5", "60", "60", "0", "50"]]  # fmt: skip
    path = tmp_path / "page.csv"
    path.write_text("\n".join(",".join(f'"{c}"' for c in row) for row in [["Kernel Name", "k"], head, *body]) + "\n")
    text = summary.summarize(str(path), top=2)
    assert "3 instructions, 100 samples" in text
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "wait 70.0%" in lines and "barrier 30.0%" in lines  # the Not Issued columns kept apart
    assert "wgmma wait (WARPGROUP.DEPBAR) 30.0%" in lines and "exp2 (MUFU) 60.0%" in lines
    top = text.split("top 2 instructions")[1].splitlines()[1:]
    assert len(top) == 2 and "+00020 MUFU.EX2" in top[0] and "+00010 WARPGROUP.DEPBAR" in top[1]
