"""Shared benchmark helpers: timing (CUDA events / wall clock), environment record, JSON output,
and the test/bench case builders (looked up wherever this version of the package keeps them).

Timing rule (llm.c, triton's do_bench): validate first, warm up, then take the median of many timed
repetitions; on the GPU ``nemo_cp_native.baselines.time_gpu``: CUDA events around the call and
the L2 cache flushed before each repetition.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

# Benchmarks run from a source checkout with the extension built in place.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from nemo_cp_native.testing import doc_lengths, fake_mesh, make_attention_case, make_mimo_batch, pack_documents  # noqa: E402
from nemo_cp_native.baselines import queue_gap, time_gpu  # noqa: E402

__all__ = ["doc_lengths", "env_record", "fake_mesh", "git_commit", "host_spin_us", "make_attention_case",
           "make_mimo_batch", "pack_documents", "print_table", "queue_gap", "time_cpu", "time_cuda", "wall_sync_us",
           "write_json"]  # fmt: skip



def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)))  # fmt: skip
        sha = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()  # fmt: skip
        return (sha or os.environ.get("NCP_COMMIT", "unknown")) + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return os.environ.get("NCP_COMMIT", "unknown")


def env_record() -> dict:
    import nemo_cp_native as ncp

    rec = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("NCP_COMMIT") or git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "build": ncp.build_info(),
        "cpu": platform.processor() or platform.machine(),
        "host_cpus": os.cpu_count(),
        "argv": " ".join(sys.argv),
    }
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name()
        rec["cuda"] = torch.version.cuda
    return rec


def time_cuda(fn, *, warmup: int = 3, reps: int = 20, flush_l2: bool = True, queued: bool = False) -> float:
    """Median milliseconds of ``fn()`` on the current stream: ``nemo_cp_native.baselines.time_gpu``
    (CUDA events, L2 flushed before each repetition; ``queued``: a GPU spin queued ahead of it)."""
    return time_gpu(fn, warmup=warmup, reps=reps, flush_l2=flush_l2, queued=queued)


def time_cpu(fn, *, warmup: int = 2, reps: int = 10, sync_cuda: bool = False) -> float:
    """Median wall-clock milliseconds of ``fn()`` (synchronizing CUDA after each call if asked)."""
    for _ in range(warmup):
        fn()
        if sync_cuda:
            torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def wall_sync_us(fn, reps: int, *, warmup: int = 3, warm_gpu: bool = False) -> float:
    """Median microseconds of ``fn()`` plus a device sync, on the host clock (the MiMo benchmarks'
    wall time). ``warm_gpu``: a 50 ms GPU spin before the repetitions (clocks up, as in training)."""
    for _ in range(warmup):
        fn()
    if warm_gpu:
        torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(ts)


def host_spin_us(fn, reps: int, *, spin: int, warmup: int = 1) -> float:
    """Median host microseconds of one ``fn()`` queued behind a ``spin``-cycle GPU spin, a device
    sync after each (the call starts from idle: the bench's one-call method)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda._sleep(spin)
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    return statistics.median(ts)


def host_us_stream(fn, n: int = 8, *, reps: int = 7, spin: int = 200_000_000, prepare=None) -> float:
    """Host microseconds per call of ``n`` calls made back to back behind one long GPU spin (the
    host cost per call of a loop whose host runs ahead of the GPU), median over ``reps``.
    ``prepare()``, if given, runs before each repetition, untimed, and returns the n arguments of
    the calls (``fn(arg)``); otherwise ``fn()`` is called n times."""
    fn(*(prepare()[:1] if prepare else ()))
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        args = prepare() if prepare else [None] * n
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        t0 = time.perf_counter_ns()
        for a in args:
            fn(*(() if prepare is None else (a,)))
        times.append((time.perf_counter_ns() - t0) / 1e3 / len(args))
        del args
        torch.cuda.synchronize()
    return statistics.median(times)


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))
