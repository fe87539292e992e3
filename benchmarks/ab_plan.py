"""A/B of the Flint plan build: two builds in one process, round robin (issue 16).

Loads ``nemo_cp_native`` of two trees side by side (as ``ab_attention.py`` does) and times
``flint._build_magi_plan`` for one rank (cp = 8, rank 3, windows 0 and 513, chunk 512) at T = 128k
with 8k documents and with one document: per round, the median of ``--reps`` calls of each build
(A then B, B then A in alternate rounds); the median of the rounds, and the fastest round (on a
shared machine some rounds run during bursts of other work). Both builds' plans are checked equal
first (every table of both windows).

    python benchmarks/ab_plan.py --a .baseline --b . [--rounds 7] [--reps 500] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE]
from ab_attention import load  # noqa: E402

CFG = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4, head_dim=128, sliding_window=513,
                      magi_chunk_size=512)  # fmt: skip


def median_us(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--json")
    args = ap.parse_args()
    pkgs = {"a": load(args.a, "nemo_cp_native"), "b": load(args.b, "ncp_b")}
    from common import env_record
    from nemo_cp_native.testing import SimulatedGroup

    rows = []
    for name, doc in (("128k, 8k docs", 8192), ("128k, one doc", 131072)):
        cu = torch.arange(0, 131073, doc, dtype=torch.int32)
        fns = {k: (lambda m=p.flint: m._build_magi_plan(cu, CFG, SimulatedGroup(8, 3))) for k, p in pkgs.items()}
        plans = {k: fn() for k, fn in fns.items()}
        for w in (0, 513):
            ka, kb = plans["a"].keys[w], plans["b"].keys[w]
            ha, hb = ka._host(), kb._host()  # every table of the window, written out from the runs
            assert ha.keys() == hb.keys() and all(torch.equal(ha[t], hb[t]) for t in ha), (name, w)
            assert torch.equal(ka._local(), kb._local()), (name, w)
            assert list(ka.send_counts) == list(kb.send_counts) and list(ka.recv_counts) == list(kb.recv_counts)
        runs = {k: [] for k in pkgs}
        for rnd in range(args.rounds):
            for k in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
                fns[k]()
                runs[k].append(round(median_us(fns[k], args.reps), 1))
        a, b = statistics.median(runs["a"]), statistics.median(runs["b"])
        a_min, b_min = min(runs["a"]), min(runs["b"])  # the round least disturbed by other work
        rows.append({"case": name, "a_us": a, "b_us": b, "b_over_a": round(b / a, 4), "a_min_us": a_min,
                     "b_min_us": b_min, "b_over_a_min": round(b_min / a_min, 4), "runs": runs})  # fmt: skip
        print(f"{name}: median of rounds A {a:.1f} us  B {b:.1f} us  B/A {b / a:.3f} | fastest round A {a_min:.1f} "
              f"B {b_min:.1f} B/A {b_min / a_min:.3f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env_record(), "a": args.a, "b": args.b, "rows": rows,
                       "method": f"median of {args.reps} calls per round; median and fastest of {args.rounds} rounds (round robin)"},
                      f, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
