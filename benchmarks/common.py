"""Shared benchmark helpers: timing (CUDA events / wall clock), environment record, JSON output.

Timing rule (METHOD.md, llm.c): validate first, warm up, then take the median of many timed
repetitions; on the GPU with CUDA events around the region and an L2 flush between repetitions
when asked.
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

__all__ = ["env_record", "git_commit", "queue_gap", "time_cpu", "time_cuda", "write_json", "print_table"]


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
        "argv": " ".join(sys.argv),
    }
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name()
        rec["cuda"] = torch.version.cuda
    return rec


_FLUSH = None


def _flush_l2():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    _FLUSH.zero_()


# GPU cycles of the spin queued ahead of a timed call (queued=True): about 0.5 ms at the H200's
# 1.98 GHz, longer than the host work of one attention call, so that work overlaps the spin.
QUEUE_GAP_CYCLES = 1_000_000


def queue_gap() -> None:
    """Keeps the GPU busy (torch.cuda._sleep) while the host launches the timed call's kernels."""
    torch.cuda._sleep(QUEUE_GAP_CYCLES)


def time_cuda(fn, *, warmup: int = 3, reps: int = 20, flush_l2: bool = False, queued: bool = False) -> float:
    """Median milliseconds of ``fn()`` on the current stream, timed with CUDA events.

    queued=False: the GPU is idle when the start event is recorded, so the host's work between the
    start event and the first kernel (argument checks, allocations, launch) counts. This is the
    time of a call on an idle GPU. queued=True: a GPU spin is queued first (queue_gap), so the host
    launches while it runs. This is the GPU time of the call, as when a training step keeps the
    queue full."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush_l2:
            _flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            queue_gap()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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
