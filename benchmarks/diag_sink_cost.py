"""Where the sink's cost on causal 8k documents comes from (issue 18: the sink costs +3.7% forward+
backward there at bcdf39e, in two runs, and <= 1% on every other case). Times, interleaved in the
orders of a balanced Latin square (bench_sink_attention.round_order, whole squares), forward+backward
and the backward alone of one case with: the benchmark's sink (grad on), no sink, the same sink
without a gradient (no dsink), a sink of -30 (its weight exp(-30 - lse) is 0 in fp32 math: same
code path as the sink, nearly the data of no sink) and a sink of +8 (most of each row's weight on
the sink: P small). If "sink -30" times like "no sink", the cost follows the data
(the values the MMAs see), not the code path. Needs a GPU and an sm_90a build.

    python benchmarks/diag_sink_cost.py [--case 65536,8192] [--rounds 10] [--json PATH] [--profile]

--profile: instead, one torch.profiler trace of three forward+backward calls per variant (each
between synchronizations): per variant the GPU span of a call (first kernel's start to last
kernel's end), the kernels' summed time, the idle time between (span - busy), and each kernel's
time, so a cost outside the kernels (the GPU waiting for the host) shows as idle time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import baselines as bl  # noqa: E402
from nemo_cp_native.testing import doc_lengths, make_attention_case  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sink_attention import design_rounds, round_order  # noqa: E402
from common import env_record, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="65536,8192", help="TOKENS,DOC (32/4 heads, D = 128, causal)")
    ap.add_argument("--window", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10, help="counted rounds, rounded up to whole designs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--order", default="sink,no sink,sink -30", help="--profile: variants in this order")
    a = ap.parse_args()
    total, doc = (int(x) for x in a.case.split(","))
    g = torch.Generator().manual_seed(1234)
    c = make_attention_case(doc_lengths(total, f"equal:{doc}"), 32, 4, 128, dtype=torch.bfloat16, device="cuda",
                            generator=g)  # fmt: skip
    q, k, v, sink, cu = (c[n] for n in ("q", "k", "v", "sink", "cu_seqlens"))
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    variants = {
        "sink": sink.detach().clone().requires_grad_(),
        "no sink": None,
        "sink, no dsink": sink.detach().clone(),
        "sink -30": torch.full_like(sink, -30.0).requires_grad_(),
        "sink +8": torch.full_like(sink, 8.0).requires_grad_(),
    }
    fns = {}
    for name, s in variants.items():
        grads = leaves + ([s] if s is not None and s.requires_grad else [])

        def fwdbwd(s=s):
            ncp.sink_attention(*leaves, s, cu, window=a.window).backward(dout)

        out = ncp.sink_attention(*leaves, s, cu, window=a.window)

        def bwd(out=out, grads=grads):
            torch.autograd.grad(out, grads, dout, retain_graph=True)

        fns[name] = (fwdbwd, bwd, grads)
    if a.profile:
        return profile(fns, a)
    times = {(n, w): [] for n in fns for w in ("fwd+bwd", "bwd")}
    whole = design_rounds(len(fns))
    for r in range(-1, -(-a.rounds // whole) * whole):  # one warm-up round
        for name in round_order(list(fns), r):
            fb, b, grads = fns[name]
            for w, fn in (("fwd+bwd", fb), ("bwd", b)):
                ms = bl.time_gpu(fn, reps=3, warmup=1, grad_to_none=grads)
                if r >= 0:
                    times[name, w].append(ms)
    rows = []
    base = {w: statistics.median(times["no sink", w]) for w in ("fwd+bwd", "bwd")}
    for name in fns:
        row = {"variant": name}
        for w in ("fwd+bwd", "bwd"):
            m = statistics.median(times[name, w])
            row[f"{w}_ms"] = round(m, 3)
            row[f"{w}_vs_nosink"] = round(m / base[w], 4)
        rows.append(row)
        print(row, flush=True)
    write_json(a.json, {"env": env_record(), "case": a.case, "window": a.window, "rows": rows})


def profile(fns, a) -> None:
    """Per variant: GPU span, busy and idle time of a forward+backward call, and its kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    rows = []
    for name in a.order.split(","):
        fb, _, grads = fns[name]

        def call(fb=fb, grads=grads):
            for t in grads:
                t.grad = None
            torch.cuda.synchronize()
            fb()
            torch.cuda.synchronize()

        for _ in range(3):  # warm
            call()
        calls = []
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                call()
        cuda = torch.autograd.DeviceType.CUDA
        evs = sorted((e for e in prof.events() if e.device_type == cuda and e.time_range.elapsed_us() > 0),
                     key=lambda e: e.time_range.start)
        # split into calls: each starts with the forward kernel
        for e in evs:
            if "fwd" in e.name or not calls:
                calls.append([])
            calls[-1].append(e)
        for i, c in enumerate(calls):
            span = (max(e.time_range.end for e in c) - c[0].time_range.start) / 1e3
            busy = sum(e.time_range.elapsed_us() for e in c) / 1e3
            per = {}
            for e in c:
                per[e.name[:60]] = per.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 1e3
            row = {"variant": name, "call": i, "span_ms": round(span, 3), "busy_ms": round(busy, 3),
                   "idle_ms": round(span - busy, 3), "kernels_ms": {k: round(v, 3) for k, v in per.items()}}
            rows.append(row)
            print(row, flush=True)
    write_json(a.json, {"env": env_record(), "case": a.case, "window": a.window, "profile": rows})


if __name__ == "__main__":
    main()
