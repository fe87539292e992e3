"""Kernel-level view of sink attention: the forward alone and the kernels of forward + backward.

- The forward on the Flint and gpt-oss shapes, TFLOP/s with the exact visible-pair FLOP count
  (``validate=False``, CUDA events, L2 flushed).
- torch.profiler breakdown of forward + backward: time per kernel (forward, pre-pass, dK/dV, dQ).

    python benchmarks/bench_kernels.py [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, env_record, make_attention_case, print_table, time_cuda, write_json  # noqa: E402

from bench_sink_attention import CASES as _ALL_CASES  # noqa: E402

CASES = {name: _ALL_CASES[name] for name in ("flint-8k-causal", "flint-8k-w513", "flint-2k-w513", "gptoss-8k-w128")}


def _case(spec):
    from nemo_cp_native.baselines import attention_flops

    total, doc_len, hq, hkv, d, window = spec
    lengths = doc_lengths(total, f"equal:{doc_len}")
    c = make_attention_case(lengths, hq, hkv, d, device="cuda", generator=torch.Generator().manual_seed(0))
    return c, attention_flops(lengths, window, hq, d), window


def forward_rows():
    import nemo_cp_native as ncp

    rows = []
    for name in CASES:
        c, flops, window = _case(CASES[name])
        args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
        ms = time_cuda(lambda: ncp.sink_attention(*args, window=window, validate=False), reps=15)
        rows.append({"case": name, "fwd_ms": round(ms, 3), "fwd_tflops": round(flops / ms / 1e9, 1)})
    return rows


def profile_backward(name):
    import nemo_cp_native as ncp
    from torch.profiler import ProfilerActivity, profile

    c, flops, window = _case(CASES[name])
    leaves = [t.detach().requires_grad_() for t in (c["q"], c["k"], c["v"], c["sink"])]
    dout = torch.randn_like(c["q"])

    def step():
        out = ncp.sink_attention(*leaves, c["cu_seqlens"], window=window, validate=False)
        out.backward(dout)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" and not hasattr(e, "cuda_time"):
            continue
        t = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
        if t and t > 0:
            rows.append({"case": name, "kernel": e.key[:90], "calls": e.count, "ms_per_call": round(t / 1e3, 3)})
    rows.sort(key=lambda r: -r["ms_per_call"] * r["calls"])
    return rows[:8]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a GPU; skipping")
        return 0
    rows = forward_rows()
    print_table(rows, ["case", "fwd_ms", "fwd_tflops"])
    prof = []
    for name in ("flint-8k-causal", "flint-8k-w513", "flint-2k-w513"):
        prof += profile_backward(name)
    print_table(prof, ["case", "kernel", "calls", "ms_per_call"])
    write_json(args.json, {"env": env_record(), "forward": rows, "profile": prof})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
