"""Where the wall time of one native MiMo sharder call goes (issue 16), on the GPU machine.

The bench's headline (``bench_mimo_shard.py``) times a call plus a device sync on an idle GPU.
This splits that figure, B = 8 rows of S = 32768 tokens, cp = 8, rank 3, ``seq_lens*`` on the host:

- floors of this host: ``torch.cuda.synchronize()`` on an idle GPU, an empty-kernel launch + sync;
- the whole call: wall time with the sync, and host time behind a queued GPU spin;
- the one ``_C.mimo_run`` alone on prepared arguments: host time behind a spin, and wall with sync;
- pieces of the Python around it (``torch.empty`` of the output buffer, DLPack capsules).

``--meta gpu`` leaves ``seq_lens*`` on the GPU (the batch as a training loop that moves every
tensor to the device hands it over; the bench's first column): the call then copies them to the host
(its one sync) and stages the kernel table, and the steps add ``_host_metadata``.

A profiling tool, not a benchmark of record.

    python benchmarks/profile_mimo.py [--chunks 1] [--meta gpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
from bench_mimo_shard import IMG, VID, _pass_fn  # noqa: E402
from common import host_spin_us, wall_sync_us  # noqa: E402

from nemo_cp_native import mimo as nat  # noqa: E402
from nemo_cp_native.testing import fake_mesh, make_mimo_batch  # noqa: E402


def wall_us(fn, reps=200, warm_gpu=False):
    return round(wall_sync_us(fn, reps, warmup=5, warm_gpu=warm_gpu), 1)


def host_us(fn, reps=100):
    return round(host_spin_us(fn, reps, spin=2_000_000, warmup=5), 1)


def steps(call, reps=100, spin=True):
    """Host microseconds of the steps of one call (medians behind a queued GPU spin; ``spin=False``:
    from an idle GPU, a sync after each call, for calls that sync themselves): the module's helpers
    and the C call, timed by wrappers swapped in for this measurement only."""
    from nemo_cp_native import _compat

    acc = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                acc.setdefault(name, []).append((time.perf_counter_ns() - t0) / 1e3)
        return wrapper

    class CProxy:
        def __getattr__(self, name):
            return getattr(real_c, name)

    real_c, saved = nat._C, {n: getattr(nat, n) for n in ("_run", "_sharded_view", "_resolve_rank", "_fallback_reason",
                                                          "_host_metadata")}  # fmt: skip
    real_layout = _compat.ShardLayout
    proxy = CProxy()
    proxy.mimo_run = timed("_C.mimo_run", real_c.mimo_run)
    try:
        nat._C = proxy
        for n, fn in saved.items():
            setattr(nat, n, timed(n, fn))
        _compat.ShardLayout = timed("ShardLayout(...)", real_layout)
        total = (host_us if spin else wall_us)(timed("whole call", call), reps)
    finally:
        nat._C = real_c
        for n, fn in saved.items():
            setattr(nat, n, fn)
        _compat.ShardLayout = real_layout
    out = {name: round(statistics.median(v[-reps:]), 1) for name, v in acc.items()}
    out["whole call (median of host_us)" if spin else "whole call (median of wall_us)"] = total
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--meta", choices=("cpu", "gpu"), default="cpu", help="where seq_lens* live (default: cpu)")
    args = ap.parse_args()
    print(f"seq_lens* on the {args.meta.upper()}")
    empty = torch.empty(1, device="cuda")
    print(f"floor: torch.cuda.synchronize() idle {wall_us(lambda: None)} us; "
          f"empty_like launch + sync {wall_us(lambda: empty.zero_())} us")  # fmt: skip
    for C in args.chunks:
        g = torch.Generator().manual_seed(0)
        batch = make_mimo_batch(8, 32768, num_chunks=C, cp_size=8, docs_per_row=(16, 64), image_token_id=IMG,
                                video_token_id=VID, generator=g, device="cuda")  # fmt: skip
        if args.meta == "cpu":
            batch = {k: v.cpu() if k in ("seq_lens", "seq_lens_padded") else v for k, v in batch.items()}
        with fake_mesh(8, 3) as mesh:
            def call():
                return nat.shard_batch_for_mimo_te(mesh, None, dict(batch), num_chunks=C, image_token_id=IMG,
                                                   video_token_id=VID)  # fmt: skip

            run = _pass_fn(batch, C, 8, 3, host_block=args.meta == "cpu")
            ids = batch["input_ids"]
            rows = {
                "call: wall with sync": wall_us(call),
                "call: wall with sync, after a 50 ms GPU spin": wall_us(call, warm_gpu=True),
                "call: wall with sync, again": wall_us(call),
                # a call that syncs (seq_lens* on the GPU) would wait for the spin: timed from idle instead
                "call: host behind spin": host_us(call) if args.meta == "cpu" else float("nan"),
                "_C.mimo_run alone: wall with sync": wall_us(run),
                "_C.mimo_run alone: wall with sync, after a 50 ms GPU spin": wall_us(run, warm_gpu=True),
                "_C.mimo_run alone: host behind spin": host_us(run),
                "torch.empty(out, cuda)": host_us(lambda: torch.empty(300_000, dtype=torch.int64, device="cuda")),
                "6 to_dlpack (cuda tensors)": host_us(lambda: [torch.utils.dlpack.to_dlpack(ids) for _ in range(6)]),
            }
            for name, us in rows.items():
                print(f"C={C} {name:58s} {us:8.1f} us")
            for name, us in steps(call, spin=args.meta == "cpu").items():
                print(f"C={C} step {name:53s} {us:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
