"""A/B of the native MiMo sharder: two builds in one process, round robin (issue 16).

Loads ``nemo_cp_native`` of two trees side by side (as ``ab_attention.py`` does) and times the
bench's case (B = 8 rows of S = 32768 tokens, cp = 8, rank 3, ``seq_lens*`` on the host, 1 and 4
chunks) with each: wall time per call with a device sync after it (the bench's ``ms``), and host
time per call behind a queued GPU spin (the bench's ``host_us``), medians per round, median of the
rounds. The reference path with the native TE partition (the bench's fair baseline, ``ref(fastTE)``)
is timed in the same process on the batch with ``seq_lens*`` on the GPU (as in the bench), so both
builds' ratios to it come from one run. Both builds' outputs
are compared for exact equality first.

``--device cpu`` times the same calls with CPU tokens (no GPU needed) on rows of ``--seq`` tokens
(default 256 there): the gather is then small and the call's time is its host path, the Python
around the one C call, which is what a change to ``nemo_cp_native/mimo.py`` moves. There wall is
the median of single calls and host the mean per call over blocks of 200 calls.

    python benchmarks/ab_mimo.py --a .baseline --b . [--rounds 5] [--json out.json]
    python benchmarks/ab_mimo.py --a .baseline --b . --device cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE]
from ab_attention import load  # noqa: E402


def _plain(obj):
    """Dataclasses (each build's own ShardLayout class) as dicts of their fields, for _same."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--seq", type=int, help="tokens per row (default 32768 on cuda, 256 on cpu)")
    ap.add_argument("--labels", nargs=2, metavar=("A", "B"),
                    help="names of the two trees in the JSON (default: the paths)")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    S = args.seq or (32768 if cuda else 256)
    pkgs = {"a": load(args.a, "nemo_cp_native"), "b": load(args.b, "ncp_b")}
    from bench_mimo_shard import IMG, VID, _cpu, _same  # imports nemo_cp_native: A's, loaded above
    from common import env_record, host_spin_us, wall_sync_us

    def wall_us(fn, reps):
        if not cuda:
            for _ in range(3):
                fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter_ns()
                fn()
                ts.append((time.perf_counter_ns() - t0) / 1e3)
            return statistics.median(ts)
        return wall_sync_us(fn, reps, warmup=3)

    def host_us(fn, reps):
        if not cuda:  # mean per call over blocks of 200 calls, median of the blocks
            blocks = []
            for _ in range(max(reps // 50, 3)):
                t0 = time.perf_counter_ns()
                for _ in range(200):
                    fn()
                blocks.append((time.perf_counter_ns() - t0) / 200e3)
            return statistics.median(blocks)
        return host_spin_us(fn, reps, spin=4_000_000, warmup=1)

    from nemo_cp_native.baselines import mimo_reference_fast_te
    from nemo_cp_native.testing import fake_mesh, make_mimo_batch

    rows = []
    for C in (1, 4):
        g = torch.Generator().manual_seed(0)
        batch = make_mimo_batch(8, S, num_chunks=C, cp_size=8, docs_per_row=(16, 64), image_token_id=IMG,
                                video_token_id=VID, generator=g, device=args.device)  # fmt: skip
        gpu_batch = batch  # the reference path's input, as in the bench (seq_lens* on the tokens' device)
        batch = {k: v.cpu() if k in ("seq_lens", "seq_lens_padded") else v for k, v in batch.items()}
        opts = {"num_chunks": C, "image_token_id": IMG, "video_token_id": VID}
        with fake_mesh(8, 3) as mesh:
            fns = {key: (lambda m=pkg.mimo: m.shard_batch_for_mimo_te(mesh, None, dict(batch), **opts))
                   for key, pkg in pkgs.items()}  # fmt: skip
            _same(_plain(_cpu(fns["a"]())), _plain(_cpu(fns["b"]())), f"C={C}")
            for key, pkg in pkgs.items():
                assert pkg.mimo.fast_path_info()["path"] == "native", (key, pkg.mimo.fast_path_info())
            with mimo_reference_fast_te() as ref:
                ref_fn = lambda: ref.shard_batch_for_mimo_te(mesh, None, dict(gpu_batch), **opts)  # noqa: E731
                ref_us = statistics.median(wall_us(ref_fn, 5) for _ in range(3))
            res = {key: {"wall": [], "host": []} for key in pkgs}
            for rnd in range(args.rounds):
                for key in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
                    res[key]["wall"].append(round(wall_us(fns[key], args.reps), 1))
                    res[key]["host"].append(round(host_us(fns[key], args.reps), 1))
        row = {"chunks": C, "seq": S, "device": args.device, "ref_fastTE_us": round(ref_us, 1)}
        for key in pkgs:
            w, h = round(statistics.median(res[key]["wall"]), 1), round(statistics.median(res[key]["host"]), 1)
            row[key] = {"wall_us": w, "host_us": h, "x_fastTE": round(ref_us / w, 1), "runs": res[key]}
        row["b_over_a_wall"] = round(row["b"]["wall_us"] / row["a"]["wall_us"], 4)
        rows.append(row)
        print(f"C={C}: ref(fastTE) {ref_us:.1f} us | A wall {row['a']['wall_us']} us ({row['a']['x_fastTE']}x), "
              f"host {row['a']['host_us']} | B wall {row['b']['wall_us']} us ({row['b']['x_fastTE']}x), "
              f"host {row['b']['host_us']} | B/A wall {row['b_over_a_wall']}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            method = ("wall: call + device sync, median of reps; host: behind a queued 4M-cycle spin, median; "
                      "median of rounds (round robin A/B)") if cuda else (
                      "CPU tokens: wall: one call, median of reps; host: mean per call over blocks of 200 calls, "
                      "median of blocks; median of rounds (round robin A/B)")  # fmt: skip
            a_name, b_name = args.labels or (args.a, args.b)
            json.dump({"env": env_record(), "a": a_name, "b": b_name, "method": method, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
