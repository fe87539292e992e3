"""``baselines.time_gpu``'s two host disciplines, checked on any machine with a stand-in for CUDA
events: per-call (the host waits for every repetition's end event, so the GPU is idle at the next
start) and ``loop`` (triton's ``do_bench`` loop: no wait inside the loop, one sync after it)."""

from __future__ import annotations

import pytest
import torch

from nemo_cp_native import baselines as bl


class _Clock:
    def __init__(self):
        self.t, self.event_waits, self.syncs, self.calls = 0.0, 0, 0, 0


@pytest.fixture()
def clock(monkeypatch):
    c = _Clock()

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = c.t

        def synchronize(self):
            c.event_waits += 1

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: setattr(c, "syncs", c.syncs + 1))
    monkeypatch.setattr(bl, "_flush_l2", lambda: None)
    return c


def _fn(clock, durations):
    def fn():
        clock.t += durations[clock.calls % len(durations)]
        clock.calls += 1

    return fn


@pytest.mark.parametrize("loop", [False, True])
def test_time_gpu_waits_per_call_or_once_after_the_loop(clock, loop):
    ms = bl.time_gpu(_fn(clock, [1.0, 5.0, 2.0]), reps=5, warmup=1, loop=loop)
    assert clock.calls == 6
    assert clock.event_waits == (0 if loop else 5)  # per call: one wait per repetition; loop: none
    assert clock.syncs == (2 if loop else 1)  # after the warm-up, and (loop) once after the last call
    # repetitions 1..5 take 5, 2, 1, 5, 2 ms: the median is 2
    assert ms == 2.0


def test_time_gpu_resets_the_gradients_each_repetition(clock):
    leaf = torch.zeros(2, requires_grad=True)
    seen = []

    def fn():
        seen.append(leaf.grad is None)
        leaf.grad = torch.ones(2)

    bl.time_gpu(fn, reps=3, warmup=1, loop=True, grad_to_none=[leaf])
    assert seen == [True, True, True, True]


def _bench_sink_attention():
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_sink_attention.py")
    spec = importlib.util.spec_from_file_location("bench_sink_attention_t", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_round_order_is_balanced(n):
    """bench_sink_attention's rounds: every round is a permutation of the rows, the same for the
    same round index, and over any whole design of consecutive rounds (any start, warm-up rounds
    have negative indices) every row runs at every position, and right after every other row,
    equally often (a fixed cyclic order gives a row one predecessor for ever; seeded random
    orders repeat the same uneven mix in every run)."""
    from collections import Counter

    mod = _bench_sink_attention()
    rows = [f"row{i}" for i in range(n)]
    L = mod.design_rounds(n)
    assert L % n == 0
    for start in (-2, 0, 3):
        orders = [mod.round_order(rows, r) for r in range(start, start + L)]
        assert all(sorted(o) == rows for o in orders)
        assert orders[0] == mod.round_order(rows, start) == mod.round_order(rows, start + L)
        pos = Counter((row, k) for o in orders for k, row in enumerate(o))
        assert set(pos.values()) == {L // n} and len(pos) == n * n
        pairs = Counter((o[k - 1], o[k]) for o in orders for k in range(1, n))
        if n > 1:
            assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1, pairs


def test_paired_ratio_takes_round_by_round_ratios():
    mod = _bench_sink_attention()
    # a slow stretch (rounds 2-3) moves both rows; the per-round ratio stays 1.02
    a = [10.0, 10.0, 14.0, 14.0, 10.0, 10.0]
    b = [x * 1.02 for x in a]
    r = mod.paired_ratio(a, b)
    assert r["rounds"] == 6 and r["median"] == r["q1"] == r["q3"] == 1.02
    assert mod.paired_ratio(a, b[:-1]) == {} and mod.paired_ratio([], []) == {}
    assert mod.paired_ratio([2.0], [3.0]) == {"median": 1.5, "q1": 1.5, "q3": 1.5, "rounds": 1}


def test_interleaved_rounds_are_kept_per_row(clock):
    """_time's per-round samples: every row gets one sample per counted round (forward and
    forward+backward), in the same rounds, so rows can be paired round by round."""
    mod = _bench_sink_attention()

    def impl(name, ms):
        fn = _fn(clock, [ms])
        return mod.Impl(name, fn, fn, fn, fn)

    impls = [impl("ncp", 2.0), impl("ncp-nosink", 3.0), impl("other", 4.0)]
    out, samples = mod._time(impls, ("do_bench",), reps=5, heat=0.0, interleave=True)
    whole = mod.design_rounds(3)
    for name, ms in (("ncp", 2.0), ("ncp-nosink", 3.0), ("other", 4.0)):
        fwd, fwdbwd = samples[name, "do_bench"]
        assert len(fwd) == -(-5 // whole) * whole and len(fwdbwd) == -(-3 // whole) * whole
        assert set(fwd) == set(fwdbwd) == {ms} and out[name, "do_bench"] == (ms, ms)
    r = mod.paired_ratio(samples["ncp", "do_bench"][1], samples["ncp-nosink", "do_bench"][1])
    assert r["median"] == 1.5


def test_sink_pair_block_renders_the_paired_ratios(tmp_path):
    """render_records' sink-pair block: one line per run and case, the no-sink and null rows'
    paired medians and quartiles against ``ncp``; a row that did not run reads "–"."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import render_records

    env = {"commit": "abc1234", "torch": "2.11", "python": "3.12", "gpu": "GPU X", "cuda": "13.0",
           "date": "2026-12-07T23:38:59+00:00", "argv": "benchmarks/bench_sink_attention.py --impls ncp,ncp-nosink"}
    ratio = {"median": 0.9961, "q1": 0.9912, "q3": 1.0, "rounds": 24}
    rows = [{"case": "c32k", "impl": "ncp"},
            {"case": "c32k", "impl": "ncp-nosink", "fwd_vs_ncp": ratio, "fwdbwd_vs_ncp": ratio},
            {"case": "w2k", "impl": "ncp"},
            {"case": "w2k", "impl": "ncp-null", "fwd_vs_ncp": ratio, "fwdbwd_vs_ncp": dict(ratio, median=1.0031)}]
    paths = []
    for i in (1, 2):
        p = tmp_path / f"sink_pair_{i}.json"
        p.write_text(json.dumps({"env": env, "rows": rows}))
        paths.append(str(p))
    page = render_records.render_sink_pair(paths)
    lines = page.splitlines()
    assert "| 1 | c32k | 0.9961 [0.9912, 1.0000] | 0.9961 [0.9912, 1.0000] | – | – |" in lines
    assert "| 2 | w2k | – | – | 0.9961 [0.9912, 1.0000] | 1.0031 [0.9912, 1.0000] |" in lines
    assert sum(line.startswith("Source: ") for line in lines) == 2 and "commit `abc1234`" in page
