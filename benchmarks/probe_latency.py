"""Where the do_bench forward loses to the queued one: the host's latency before the kernel starts.

The headline ``do_bench`` timing (``baselines.time_gpu``) records its start event on an idle GPU
(after the L2 flush), then calls the op: whatever the host does before the kernel's launch is GPU
idle time inside the events. This probe times, round robin in one process, per case:

- ``tiny``: a one-element ``add_`` (the floor: one launch right after the start event);
- ``native``: ``attention.attn_forward`` (allocations, DLPack, the C call; no wrapper);
- ``op``: ``ncp.sink_attention`` under ``no_grad``, as the headline forward;
- ``op_queued``: the same behind a queued GPU spin (the kernel's GPU time);
- ``fwdbwd`` / ``fwdbwd_inside``: forward+backward through autograd with the kernel launched before
  the autograd node is built (``sink_attn_autograd``, the default) and inside the node's forward
  (``SinkAttnFunc.apply`` without ``launched``, as before ``sink_attn_autograd``);
- host µs of ``op`` and ``native`` from an idle GPU (host clock, right after a device sync).

``do_bench - queued`` of ``op`` is the latency the headline pays; ``native`` and ``tiny`` split it
into the wrapper, the native call and the launch floor.

    python benchmarks/probe_latency.py [--cases flint-2k-w513,flint-8k-w513] [--rounds 5] [--json out]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import ATTENTION_CASES as CASES  # noqa: E402
from common import doc_lengths, env_record, make_attention_case, write_json  # noqa: E402

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import baselines as bl  # noqa: E402
from nemo_cp_native.attention import AttnMask, SinkAttnFunc, attn_forward  # noqa: E402


def host_idle_us(fn, reps: int = 20) -> float:
    """Host µs of ``fn()`` started right after a device sync (GPU idle), median."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="flint-2k-w513,flint-8k-w513,flint-8k-causal")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    tiny = torch.zeros(1, device="cuda")
    rows = []
    for name in args.cases.split(","):
        total, doc, hq, hkv, d, window = CASES[name]
        c = make_attention_case(doc_lengths(total, f"equal:{doc}"), hq, hkv, d, device="cuda")
        q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
        leaves = [t.detach().requires_grad_() for t in (q, k, v, s)]
        dout = torch.randn_like(q)
        mask, scale = AttnMask(cu_seqlens=cu, window=window), d**-0.5

        def op():
            with torch.no_grad():
                ncp.sink_attention(q, k, v, s, cu, window=window)

        def native():
            attn_forward(q, k, v, s, mask, scale)

        def fwdbwd():
            ncp.sink_attention(*leaves, cu, window=window).backward(dout)

        def fwdbwd_inside():
            SinkAttnFunc.apply(*leaves, mask, scale)[0].backward(dout)

        timers = {
            "tiny": lambda: bl.time_gpu(lambda: tiny.add_(1), reps=args.reps),
            "native": lambda: bl.time_gpu(native, reps=args.reps),
            "op": lambda: bl.time_gpu(op, reps=args.reps),
            "op_queued": lambda: bl.time_gpu(op, reps=args.reps, queued=True),
            "fwdbwd": lambda: bl.time_gpu(fwdbwd, reps=args.reps, grad_to_none=leaves),
            "fwdbwd_inside": lambda: bl.time_gpu(fwdbwd_inside, reps=args.reps, grad_to_none=leaves),
            "host_op_us": lambda: host_idle_us(op),
            "host_native_us": lambda: host_idle_us(native),
        }
        runs = {key: [] for key in timers}
        for r in range(args.rounds):
            keys = list(timers)
            keys = keys[r % len(keys):] + keys[: r % len(keys)]
            for key in keys:
                runs[key].append(timers[key]())
        med = {key: statistics.median(v) for key, v in runs.items()}
        row = {"case": name, **{f"{key}_ms" if "us" not in key else key: round(val, 4) for key, val in med.items()},
               "latency_us": round((med["op"] - med["op_queued"]) * 1e3, 1), "runs": runs}  # fmt: skip
        rows.append(row)
        print(f"{name:18s} op {med['op']:.4f} ms, queued {med['op_queued']:.4f} (latency {row['latency_us']} us), "
              f"native {med['native']:.4f}, tiny {med['tiny'] * 1e3:.1f} us; host idle: op {med['host_op_us']:.1f} us, "
              f"native {med['host_native_us']:.1f} us; fwd+bwd launched first {med['fwdbwd']:.4f} ms, "
              f"inside the node {med['fwdbwd_inside']:.4f} ms ({med['fwdbwd_inside'] / med['fwdbwd']:.4f}x)", flush=True)  # fmt: skip
        del c, q, k, v, s, leaves, dout
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, {"env": env_record(), "rounds": args.rounds, "reps": args.reps, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
