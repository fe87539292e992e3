"""The Hopper backward's tile order, measured: index order against longest first within chunks of
k waves (launch.h, kOrderWaves; the `order_waves` test hook), on whole sequences (document mask)
and on one rank of cp = 8 (table mask), Flint shape 32/4/128, 64k tokens.

Each case times the backward alone (``attn_backward``, the default atomic-dQ kernels, and the
deterministic ones with ``--det``): L2 flushed before each repetition, a queued GPU spin, CUDA
events, median; the orders run round robin (``--rounds`` rounds, the median of the rounds).

    python benchmarks/bench_bwd_order.py [--waves -1,1,2,4,0] [--rounds 3] [--reps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, env_record, make_attention_case, print_table, write_json  # noqa: E402

from nemo_cp_native import flint  # noqa: E402
from nemo_cp_native.attention import AttnMask, attn_backward, attn_forward  # noqa: E402
from nemo_cp_native.baselines import time_gpu  # noqa: E402
from nemo_cp_native.flint import _kv_buffer  # noqa: E402
from nemo_cp_native.testing import SimulatedGroup, attn_debug  # noqa: E402

HQ, HKV, D, T, CP = 32, 4, 128, 65536, 8
CFG = SimpleNamespace(num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, sliding_window=513,
                      magi_chunk_size=512)  # fmt: skip


def problems(doc: int, window: int):
    """(name, q, k, v, sink, mask, dout, visible pairs) for the whole sequence and rank 0."""
    g = torch.Generator().manual_seed(5)
    c = make_attention_case(doc_lengths(T, f"equal:{doc}"), HQ, HKV, D, device="cuda", generator=g)
    dout = torch.randn_like(c["q"])
    cu = c["cu_seqlens"]
    lens = cu.diff().cpu()
    pairs = int(sum(min(window, i + 1) if window > 0 else i + 1 for L in lens.tolist() for i in range(L)))
    wname = "causal" if window == 0 else f"w{window}"
    yield f"whole {doc // 1024}k {wname}", c["q"], c["k"], c["v"], c["sink"], AttnMask(cu_seqlens=cu, window=window), dout, pairs
    mk = flint._build_magi_plan(cu.cpu(), CFG, SimulatedGroup(CP, 0)).keys[window]
    idx = mk.local_token_global_indices.cuda()
    real = idx < T
    q_, k_, v_, do_ = (t.new_zeros((idx.numel(),) + tuple(t.shape[1:])) for t in (c["q"], c["k"], c["v"], dout))
    for x, t in ((q_, c["q"]), (k_, c["k"]), (v_, c["v"]), (do_, dout)):
        x[real] = t[idx[real]]
    recv = torch.randn((sum(mk.recv_counts), HKV, 2 * D), device="cuda", dtype=k_.dtype, generator=None)
    kb, vb = _kv_buffer(mk, k_, v_, recv)
    yield (f"rank0/{CP} {doc // 1024}k {wname}", q_, kb, vb, c["sink"], mk.device_tables(q_.device)["mask"], do_,
           int(mk.visible_pairs))  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waves", default="-1,1,2,4,0", help="order_waves values (-1 index order, 0 the default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--det", action="store_true", help="the deterministic backward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.det:
        os.environ["NCP_DETERMINISTIC"] = "1"
    waves = [int(w) for w in args.waves.split(",")]
    rows = []
    for doc, window in ((2048, 0), (8192, 0), (2048, 513), (8192, 513)):
        for name, q, k, v, s, mask, dout, pairs in problems(doc, window):
            scale = D**-0.5
            out, lse = attn_forward(q, k, v, s, mask, scale)
            ms = {w: [] for w in waves}
            for _ in range(args.rounds):
                for w in waves:
                    with attn_debug(order_waves=w):
                        ms[w].append(time_gpu(lambda: attn_backward(dout, q, k, v, s, out, lse, mask, scale),
                                              reps=args.reps, queued=True))  # fmt: skip
            med = {w: statistics.median(x) for w, x in ms.items()}
            row = {"case": name, "backward": "deterministic" if args.det else "atomic dQ"}
            for w in waves:
                label = {-1: "index", 0: "default"}.get(w, f"{w} waves" if w < 1 << 20 else "whole grid")
                row[f"{label} bwd TFLOP/s"] = round(2.5 * 4 * pairs * HQ * D / med[w] / 1e9, 1)
                if w != waves[0]:
                    row[f"{label} / {waves[0]}"] = round(med[waves[0]] / med[w], 3)
            rows.append(row)
            print_table(rows[-1:], list(rows[-1]))
    write_json(args.json, {"env": env_record(), "command": "python benchmarks/bench_bwd_order.py " + " ".join(argv or sys.argv[1:]),
                           "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
