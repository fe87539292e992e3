"""Differential check of the Flint plan build between two trees (a change that must not change a
plan): random packs, cp sizes, chunk sizes and windows, every rank; the runs, counts, offsets and
visible pairs must be byte-identical, and a refused pack must be refused with the same message.

    python benchmarks/diff_plan.py --a .baseline --b . [--trials 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_attention import load  # noqa: E402


def build(pkg, cu, cfg, cp, rank):
    from nemo_cp_native.testing import SimulatedGroup

    try:
        return pkg.flint._build_magi_plan(cu, cfg, SimulatedGroup(cp, rank)), None
    except ValueError as exc:
        return None, str(exc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--trials", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    pkgs = (load(args.a, "nemo_cp_native"), load(args.b, "ncp_b"))
    rng = random.Random(args.seed)
    compared = refused = 0
    for trial in range(args.trials):
        lens = [rng.choice([rng.randint(1, 50), rng.randint(1, 2000), rng.randint(1, 20000)])
                for _ in range(rng.randint(1, 12))]  # fmt: skip
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        cp = rng.choice([1, 2, 3, 4, 5, 8, 16])
        cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              sliding_window=rng.choice([0, 1, 2, 33, 129, 513, 4096]),
                              magi_chunk_size=rng.choice([1, 7, 16, 64, 100, 512, 4096]))  # fmt: skip
        for rank in range(cp):
            (pa, ea), (pb, eb) = (build(p, cu, cfg, cp, rank) for p in pkgs)
            assert ea == eb, (trial, rank, ea, eb)
            if ea is not None:
                refused += 1
                continue
            assert pa.keys.keys() == pb.keys.keys(), (trial, rank)
            for w, ka in pa.keys.items():
                kb = pb.keys[w]
                assert bytes(ka.runs) == bytes(kb.runs) and bytes(ka.local_runs) == bytes(kb.local_runs), (trial, rank, w)
                assert (list(ka.send_counts), list(ka.recv_counts), list(ka.table_off), ka.visible_pairs) == (
                    list(kb.send_counts), list(kb.recv_counts), list(kb.table_off), kb.visible_pairs), (trial, rank, w)
            compared += 1
    print(f"diff_plan: {compared} plans identical, {refused} refused alike ({args.a} against {args.b})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
