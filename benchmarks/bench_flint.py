"""Flint Magi CP: plan build, K/V exchange volume, and CP attention against the whole sequence.

1. Plan build of one rank (cp = 8, windows 0 and 513 together): T = 128k with 8k documents and
   with one document, and one 1M-token document (time, and the peak memory of the build measured
   in a fresh subprocess), next to the Python oracle of the partition alone
   (``reference.magi.dispatch``: chunk workloads + MinHeap).
2. K/V bytes each rank receives per layer (bf16, Hkv = 4, D = 128) against an all-gather.
3. On a GPU, Flint shape (32/4/128), 64k tokens at cp = 8, causal and window 513, 8k and 2k
   documents:
   - ``whole``: ``ncp.sink_attention`` on the whole sequence (contiguous mode), fwd and fwd+bwd;
   - ``rank kernels``: every rank's attention kernels on its local queries and sorted K/V buffer
     (the table mask), TFLOP/s of each rank from its exact visible pairs (min and mean over ranks),
     and its ratio to the whole-sequence figure;
   - ``rank step``: the rank's work beyond the kernels (pack the rows to send, assemble the K/V
     buffer; backward: pack the returned gradients, sum what came back), as a fraction of its
     kernel time (max over ranks);
   - ``all ranks``: ``testing.simulate_cp_attention`` (every rank, the exchange routed in-process),
     and the efficiency whole-sequence time / all-ranks time.
   Timing: L2 flushed before each repetition, CUDA events, median (a queued GPU spin before the
   start event, so host work overlaps it and the events time GPU work).

    python benchmarks/bench_flint.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, env_record, make_attention_case, pack_documents, print_table, write_json  # noqa: E402

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import flint  # noqa: E402
from nemo_cp_native.attention import attn_backward, attn_forward  # noqa: E402
from nemo_cp_native.baselines import time_gpu  # noqa: E402
from nemo_cp_native.flint import _kv_buffer, _local_grads, _returned_rows, _send_rows  # noqa: E402
from nemo_cp_native.reference import magi as rmagi  # noqa: E402
from nemo_cp_native.testing import SimulatedGroup, simulate_cp_attention  # noqa: E402

CFG = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4, head_dim=128, sliding_window=513,
                      magi_chunk_size=512)  # fmt: skip


def _median_us(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return ts[len(ts) // 2]


_PEAK = """
import resource, sys
import numpy as np
from nemo_cp_native import _C
T = int(sys.argv[1])
cu = np.array([0, T], dtype=np.int32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
plan = _C.plan_build(cu.__dlpack__(), 8, 3, 512, 8, (0, 513))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""  # the C build and its output arrays, without torch's import in the high-water mark


def plan_rows(reps):
    rows = []
    for name, T, doc in (("128k, 8k docs", 131072, 8192), ("128k, one doc", 131072, 131072), ("1M, one doc", 1 << 20, 1 << 20)):
        cu = torch.arange(0, T + 1, doc, dtype=torch.int32)
        grp = SimulatedGroup(8, 3)
        # a build takes tens of microseconds: many repetitions after a warm-up, so that the median
        # is not one of a cold process's first calls
        us = _median_us(lambda: flint._build_magi_plan(cu, CFG, grp), 10 * reps if T < 1 << 20 else 5, warmup=10)
        py = _median_us(lambda: rmagi.dispatch(cu, 8, 512), 3) if T < 1 << 20 else float("nan")
        peak = subprocess.run([sys.executable, "-c", _PEAK, str(T)], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fmt: skip
        rows.append({"case": name, "T": T, "cp": 8, "windows": "0,513", "plan_us": round(us, 1),
                     "py_partition_only_us": round(py, 1),
                     "peak_MB_beyond_import": round(float(peak.stdout.strip() or "nan"), 1)})  # fmt: skip
    return rows


def volume_rows(T, cp, doc_mode):
    g = torch.Generator().manual_seed(7)
    cu = pack_documents(doc_lengths(T, doc_mode, mean=4096, generator=g))
    plans = [flint._build_magi_plan(cu, CFG, SimulatedGroup(cp, r)) for r in range(cp)]
    per_tok = CFG.num_key_value_heads * 2 * CFG.head_dim * 2  # K and V, bf16
    rows = []
    for w in sorted(plans[0].keys):
        recv = [sum(p.keys[w].recv_counts) for p in plans]
        Tp = plans[0].keys[w].total_seqlen_q
        allgather = (Tp - Tp // cp) * per_tok
        rows.append({"T": T, "cp": cp, "docs": doc_mode, "window": w, "max_recv_MB": round(max(recv) * per_tok / 2**20, 2),
                     "fraction_of_allgather": round(sum(recv) / cp * per_tok / allgather, 4)})  # fmt: skip
    return rows


def _t(fn, reps):
    return time_gpu(fn, reps=reps, queued=True)


def cp_rows(T, cp, doc_len, reps):
    """Per window: whole sequence, every rank's kernels and rank step, and all ranks simulated."""
    hq, hkv, d = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
    g = torch.Generator().manual_seed(3)
    c = make_attention_case(doc_lengths(T, f"equal:{doc_len}"), hq, hkv, d, device="cuda", generator=g)
    cu, scale = c["cu_seqlens"], d**-0.5
    plans = [flint._build_magi_plan(cu.cpu(), CFG, SimulatedGroup(cp, r)) for r in range(cp)]
    leaves = [c[n].detach().requires_grad_() for n in ("q", "k", "v", "sink")]
    dout_whole = torch.randn_like(c["q"])
    rows = []
    for w in sorted(plans[0].keys):
        def whole_fwd():
            with torch.no_grad():
                ncp.sink_attention(*leaves, cu, window=w)

        def whole_fb():
            ncp.sink_attention(*leaves, cu, window=w).backward(dout_whole)

        wf, wfb = _t(whole_fwd, reps), _t(whole_fb, reps)
        pairs = sum(p.keys[w].visible_pairs for p in plans)
        flops = 4 * pairs * hq * d
        loc = []
        for p in plans:
            idx = p.keys[w].local_token_global_indices.cuda()
            real = idx < T
            rows_ = []
            for t in (c["q"], c["k"], c["v"], dout_whole):
                x = t.new_zeros((idx.numel(),) + tuple(t.shape[1:]))
                x[real] = t[idx[real]]
                rows_.append(x)
            loc.append(rows_)
        rank = []
        for r, p in enumerate(plans):
            mk = p.keys[w]
            q, k, v, do = loc[r]
            mask = mk.device_tables(q.device)["mask"]
            recv = torch.randn((sum(mk.recv_counts), hkv, 2 * d), device="cuda", dtype=k.dtype)
            kb, vb = _kv_buffer(mk, k, v, recv)
            out, lse = attn_forward(q, kb, vb, c["sink"], mask, scale)
            kf = _t(lambda: attn_forward(q, kb, vb, c["sink"], mask, scale), reps)
            kb_ms = _t(lambda: attn_backward(do, q, kb, vb, c["sink"], out, lse, mask, scale), reps)
            g_ = attn_backward(do, q, kb, vb, c["sink"], out, lse, mask, scale)
            back = torch.randn((sum(mk.send_counts), hkv, 2 * d), device="cuda", dtype=k.dtype)
            sf = _t(lambda: (_send_rows(mk, k, v), _kv_buffer(mk, k, v, recv)), reps)
            sb = _t(lambda: (_returned_rows(mk, g_[1], g_[2]), _local_grads(mk, g_[1], g_[2], back)), reps)
            f = 4 * mk.visible_pairs * hq * d
            rank.append({"fwd_tf": f / kf / 1e9, "fb_tf": 3.5 * f / (kf + kb_ms) / 1e9, "step_f": sf / kf,
                         "step_fb": (sf + sb) / (kf + kb_ms)})  # fmt: skip
        qs, ks, vs, dos = ([x[i] for x in loc] for i in range(4))
        sim_f = _t(lambda: simulate_cp_attention(plans, qs, ks, vs, c["sink"], w, scale), max(3, reps // 3))
        sim_fb = _t(lambda: simulate_cp_attention(plans, qs, ks, vs, c["sink"], w, scale, dos), max(3, reps // 3))
        whole_tf, whole_fb_tf = flops / wf / 1e9, 3.5 * flops / wfb / 1e9
        fwd_tf, fb_tf = [x["fwd_tf"] for x in rank], [x["fb_tf"] for x in rank]
        rows.append({"T": T, "cp": cp, "doc": doc_len, "window": w,
                     "whole_fwd_tflops": round(whole_tf, 1), "whole_fwdbwd_tflops": round(whole_fb_tf, 1),
                     "rank_fwd_tflops_min": round(min(fwd_tf), 1), "rank_fwd_tflops_mean": round(sum(fwd_tf) / cp, 1),
                     "rank_fwdbwd_tflops_min": round(min(fb_tf), 1), "rank_fwdbwd_tflops_mean": round(sum(fb_tf) / cp, 1),
                     "rank_over_whole_fwd": round(sum(fwd_tf) / cp / whole_tf, 3),
                     "rank_over_whole_fwdbwd": round(sum(fb_tf) / cp / whole_fb_tf, 3),
                     "step_over_kernels_fwd_max": round(max(x["step_f"] for x in rank), 3),
                     "step_over_kernels_fwdbwd_max": round(max(x["step_fb"] for x in rank), 3),
                     "all_ranks_efficiency_fwd": round(wf / sim_f, 3), "all_ranks_efficiency_fwdbwd": round(wfb / sim_fb, 3),
                     "whole_fwd_ms": round(wf, 3), "all_ranks_fwd_ms": round(sim_f, 3),
                     "whole_fwdbwd_ms": round(wfb, 3), "all_ranks_fwdbwd_ms": round(sim_fb, 3)})  # fmt: skip
        print_table(rows[-1:], list(rows[-1]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    reps = 5 if args.quick else 20
    out = {"env": env_record()}
    out["plan"] = plan_rows(reps)
    print_table(out["plan"], list(out["plan"][0]))
    T = 16384 if args.quick else 131072
    out["volume"] = [r for m in ("random", "one") for r in volume_rows(T, 8, m)]
    print_table(out["volume"], list(out["volume"][0]))
    if torch.cuda.is_available() and ncp.has_cuda():
        simT = 16384 if args.quick else 65536
        out["cp"] = [r for doc in ((4096,) if args.quick else (8192, 2048)) for r in cp_rows(simT, 8, doc, reps)]
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
