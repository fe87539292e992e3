"""Flint Magi CP: plan build time, K/V exchange volume, and simulated-rank attention throughput.

1. Plan build per microbatch (T = 128k, cp = 8, Flint config): the native C plan (partition,
   exchange tables and tile schedules for both windows) against the Python oracle solver
   (``reference.magi.dispatch``: chunk workloads + MinHeap only), in microseconds.
2. K/V bytes each rank receives per layer (bf16, Hkv = 4, D = 128) against an all-gather.
3. On a GPU: every simulated rank's attention kernels on its local queries and
   [local + received] keys (forward, and forward + backward), TFLOP/s per rank with the exact
   visible pairs of that rank, next to ``ncp.sink_attention`` on the whole sequence.

    python benchmarks/bench_flint.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (doc_lengths, env_record, make_attention_case, pack_documents, print_table,  # noqa: E402
                    time_cuda, write_json)  # fmt: skip

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import flint  # noqa: E402
from nemo_cp_native.testing import SimulatedGroup  # noqa: E402
from nemo_cp_native.attention import attn_backward, attn_forward  # noqa: E402
from nemo_cp_native.reference import magi as rmagi  # noqa: E402



def _median_us(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return ts[len(ts) // 2]


def plan_rows(T, cp, cfg, doc_mode, reps):
    g = torch.Generator().manual_seed(7)
    lengths = doc_lengths(T, doc_mode, mean=4096, generator=g)
    cu = pack_documents(lengths)
    grp = SimulatedGroup(cp, 0)
    c_us = _median_us(lambda: flint._build_magi_plan(cu, cfg, grp), reps)
    py_us = _median_us(lambda: rmagi.dispatch(cu, cp, cfg.magi_chunk_size), max(3, reps // 5))
    plan = flint._build_magi_plan(cu, cfg, grp)
    assert plan.keys[0].local_token_global_indices.equal(rmagi.dispatch(cu, cp, cfg.magi_chunk_size)
                                                         .local_token_global_indices(0))  # fmt: skip
    return {"T": T, "cp": cp, "docs": doc_mode, "n_docs": len(lengths), "c_plan_us": round(c_us, 1),
            "py_solver_us": round(py_us, 1), "speedup": round(py_us / c_us, 1)}  # fmt: skip


def volume_rows(T, cp, cfg, doc_mode):
    g = torch.Generator().manual_seed(7)
    cu = pack_documents(doc_lengths(T, doc_mode, mean=4096, generator=g))
    plans = [flint._build_magi_plan(cu, cfg, SimulatedGroup(cp, r)) for r in range(cp)]
    per_tok = cfg.num_key_value_heads * 2 * cfg.head_dim * 2  # K and V, bf16
    rows = []
    for w in sorted(plans[0].keys):
        recv = [sum(p.keys[w].recv_counts) for p in plans]
        Tp = plans[0].keys[w].total_seqlen_q
        allgather = (Tp - Tp // cp) * per_tok
        rows.append({"T": T, "cp": cp, "docs": doc_mode, "window": w, "max_recv_MB": round(max(recv) * per_tok / 2**20, 2),
                     "mean_recv_MB": round(sum(recv) / cp * per_tok / 2**20, 2),
                     "allgather_MB": round(allgather / 2**20, 2),
                     "fraction_of_allgather": round(sum(recv) / cp * per_tok / allgather, 4)})  # fmt: skip
    return rows


def sim_rows(T, cp, cfg, doc_len, reps):
    lengths = doc_lengths(T, f"equal:{doc_len}")
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    c = make_attention_case(lengths, hq, hkv, d, device="cuda", generator=g)
    cu = c["cu_seqlens"]
    plans = [flint._build_magi_plan(cu.cpu(), cfg, SimulatedGroup(cp, r)) for r in range(cp)]
    rows = []
    for w in sorted(plans[0].keys):
        whole_fwd = time_cuda(lambda: ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], cu, window=w,
                                                          validate=False), reps=reps)  # fmt: skip
        pairs_total = 0
        per_rank = []
        for r, p in enumerate(plans):
            mk = p.keys[w]
            idx = mk.local_token_global_indices.cuda()
            real = idx < T

            def local(t):
                rows_ = t.new_zeros((idx.numel(),) + tuple(t.shape[1:]))
                rows_[real] = t[idx[real]]
                return rows_

            q = local(c["q"])
            kvpos = mk.kv_pos.long().cuda()
            kreal = kvpos < T
            kb = c["k"].new_zeros((kvpos.numel(), hkv, d))
            vb = c["v"].new_zeros((kvpos.numel(), hkv, d))
            kb[kreal], vb[kreal] = c["k"][kvpos[kreal]], c["v"][kvpos[kreal]]
            mask = mk.device_tables(q.device)["mask"]
            scale = d**-0.5
            out, lse = attn_forward(q, kb, vb, c["sink"], mask, scale)
            dout = torch.randn_like(out)
            f_ms = time_cuda(lambda: attn_forward(q, kb, vb, c["sink"], mask, scale), reps=reps)
            b_ms = time_cuda(lambda: attn_backward(dout, q, kb, vb, c["sink"], out, lse, mask, scale), reps=reps)
            pairs_total += mk.visible_pairs
            per_rank.append((mk.visible_pairs, f_ms, b_ms))
        flops = [4 * pr * hq * d for pr, _, _ in per_rank]
        fwd_tf = [f / ms / 1e9 for f, (_, ms, _) in zip(flops, per_rank)]
        fb_tf = [3.5 * f / (fm + bm) / 1e9 for f, (_, fm, bm) in zip(flops, per_rank)]
        whole_tf = 4 * pairs_total * hq * d / whole_fwd / 1e9
        rows.append({"T": T, "cp": cp, "doc": doc_len, "window": w,
                     "rank_fwd_tflops_min/mean": f"{min(fwd_tf):.0f}/{sum(fwd_tf) / cp:.0f}",
                     "rank_fwdbwd_tflops_min/mean": f"{min(fb_tf):.0f}/{sum(fb_tf) / cp:.0f}",
                     "max_rank_fwd_ms": round(max(ms for _, ms, _ in per_rank), 3),
                     "whole_seq_fwd_ms": round(whole_fwd, 3), "whole_seq_fwd_tflops": round(whole_tf, 1),
                     "cp_load_balance": round(max(pr for pr, _, _ in per_rank) / (pairs_total / cp), 3)})  # fmt: skip
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4, head_dim=128, sliding_window=513,
                          magi_chunk_size=512)  # fmt: skip
    T = 16384 if args.quick else 131072
    reps = 5 if args.quick else 30
    out = {"env": env_record()}
    out["plan"] = [plan_rows(T, 8, cfg, m, reps) for m in ("equal:8192", "random")]
    print_table(out["plan"], list(out["plan"][0]))
    out["volume"] = [r for m in ("random", "one") for r in volume_rows(T, 8, cfg, m)]
    print_table(out["volume"], list(out["volume"][0]))
    if torch.cuda.is_available() and ncp.has_cuda():
        simT = 16384 if args.quick else 65536
        out["simulated"] = sim_rows(simT, 4 if args.quick else 8, cfg, 4096 if args.quick else 8192, 10)
        print_table(out["simulated"], list(out["simulated"][0]))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
