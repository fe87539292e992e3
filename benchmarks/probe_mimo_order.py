"""Diagnostic: does anything the MiMo bench runs before its timings slow the calls timed after it?

Times native (seq_lens on the host) and ref(fastTE) wall per call (call + device sync, median),
fresh, then after the bench's sync count, then after one ref(pyTE) call, then after gc + empty_cache.

    python benchmarks/probe_mimo_order.py
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
from common import host_spin_us, wall_sync_us  # noqa: E402

from nemo_cp_native import mimo as nat  # noqa: E402
from nemo_cp_native.baselines import mimo_reference_fast_te  # noqa: E402
from nemo_cp_native.reference import mimo as ref  # noqa: E402
from nemo_cp_native.testing import count_syncs, fake_mesh, make_mimo_batch  # noqa: E402

IMG, VID = 151655, 151656


def _py_us() -> float:
    t0 = time.perf_counter_ns()
    sum(range(20000))
    return (time.perf_counter_ns() - t0) / 1e3


def _torch_us() -> float:
    t0 = time.perf_counter_ns()
    for _ in range(10):
        torch.empty(8)
    return (time.perf_counter_ns() - t0) / 1e4


def _cpu() -> str:
    try:
        with open("/proc/self/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[36]
    except OSError:
        return "?"


def _throttled() -> str:
    for path in ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat"):
        try:
            with open(path) as f:
                d = dict(line.split() for line in f if line.strip())
            return f"throttled {d.get('nr_throttled', '?')} ({d.get('throttled_usec', d.get('throttled_time', '?'))})"
        except OSError:
            continue
    return "no cgroup cpu.stat"


def main() -> None:
    print(f"affinity {sorted(os.sched_getaffinity(0))}, torch threads {torch.get_num_threads()}", flush=True)
    for C in (1, 4):
        g = torch.Generator().manual_seed(0)
        batch = make_mimo_batch(8, 32768, num_chunks=C, cp_size=8, docs_per_row=(16, 64), image_token_id=IMG,
                                video_token_id=VID, generator=g, device="cuda")  # fmt: skip
        meta = {k: v.cpu() if k in ("seq_lens", "seq_lens_padded") else v for k, v in batch.items()}
        opts = {"num_chunks": C, "image_token_id": IMG, "video_token_id": VID}
        with fake_mesh(8, 3) as mesh:
            nat_fn = lambda: nat.shard_batch_for_mimo_te(mesh, None, dict(meta), **opts)  # noqa: E731
            nat_gpu = lambda: nat.shard_batch_for_mimo_te(mesh, None, dict(batch), **opts)  # noqa: E731
            ref_fn = lambda: ref.shard_batch_for_mimo_te(mesh, None, dict(batch), **opts)  # noqa: E731

            def measure(label):
                py = statistics.median(_py_us() for _ in range(50))
                te = statistics.median(_torch_us() for _ in range(50))
                print(f"C={C} {label:28s} pure-Python loop {py:7.1f} us, torch.empty {te:5.2f} us, threads "
                      f"{len(os.listdir('/proc/self/task'))}, cpu {_cpu()}, {_throttled()}", flush=True)  # fmt: skip
                w = statistics.median(wall_sync_us(nat_fn, 50, warmup=3) for _ in range(3))
                h = host_spin_us(nat_fn, 50, spin=4_000_000)
                with mimo_reference_fast_te():
                    r = statistics.median(wall_sync_us(ref_fn, 5, warmup=1) for _ in range(3))
                print(f"C={C} {label:28s} native wall {w:8.1f} us host {h:8.1f} us | ref(fastTE) {r:8.1f} us"
                      f" | ratio {r / w:5.1f}x", flush=True)  # fmt: skip

            measure("fresh")
            measure("again")
            count_syncs(nat_gpu)
            count_syncs(nat_fn)
            with mimo_reference_fast_te():
                count_syncs(ref_fn)
            measure("after count_syncs")
            ref_fn()  # ref(pyTE): the Python TE oracle, as the bench's validation runs it
            torch.cuda.synchronize()
            measure("after one ref(pyTE)")
            gc.collect()
            torch.cuda.empty_cache()
            measure("after gc + empty_cache")


if __name__ == "__main__":
    main()
