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
