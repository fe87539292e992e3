"""Kernel-level view of sink attention: forward layout variants and the backward's kernels.

- Each forward kernel (NCP_FWD_VARIANT 1/2/3 portable, 4 Hopper) in its own subprocess, on
  the Flint and gpt-oss shapes, TFLOP/s with the exact visible-pair FLOP count.
- torch.profiler breakdown of one forward + backward: time per kernel (pre-pass, dK/dV, dQ, ...).

    python benchmarks/bench_kernels.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_record, print_table, time_cuda, write_json  # noqa: E402

from bench_sink_attention import CASES as _ALL_CASES  # noqa: E402

CASES = {name: _ALL_CASES[name] for name in ("flint-8k-causal", "flint-8k-w513", "flint-2k-w513", "gptoss-8k-w128")}


def _case(spec):
    import nemo_cp_native as ncp  # noqa: F401
    from nemo_cp_native.testing import attention_flops, doc_lengths, make_attention_case

    total, doc_len, hq, hkv, d, window = spec
    lengths = doc_lengths(total, f"equal:{doc_len}")
    c = make_attention_case(lengths, hq, hkv, d, device="cuda", generator=torch.Generator().manual_seed(0))
    return c, attention_flops(lengths, window, hq, d), window


def child(variant_cases):
    import nemo_cp_native as ncp

    rows = []
    for name in variant_cases:
        c, flops, window = _case(CASES[name])
        args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
        ref = ncp.sink_attention(*args, window=window)
        ms = time_cuda(lambda: ncp.sink_attention(*args, window=window, validate=False), reps=15)
        rows.append({"case": name, "variant": os.environ.get("NCP_FWD_VARIANT", "default"),
                     "fwd_ms": round(ms, 3), "fwd_tflops": round(flops / ms / 1e9, 1),
                     "checksum": float(ref.float().abs().sum())})  # fmt: skip
    print("ROWS" + json.dumps(rows))


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
    ap.add_argument("--child", default=None)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child.split(","))
        return 0
    rows = []
    for variant in ("1", "2", "3", "4"):
        env = dict(os.environ, NCP_FWD_VARIANT=variant)
        res = subprocess.run([sys.executable, __file__, "--child", ",".join(CASES)], env=env, capture_output=True,
                             text=True)  # fmt: skip
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROWS")]
        if not line:
            print(f"variant {variant} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
            continue
        rows += json.loads(line[0][4:])
    print_table(rows, ["case", "variant", "fwd_ms", "fwd_tflops", "checksum"])
    prof = []
    for name in ("flint-8k-causal", "flint-8k-w513"):
        prof += profile_backward(name)
    print_table(prof, ["case", "kernel", "calls", "ms_per_call"])
    write_json(args.json, {"env": env_record(), "variants": rows, "profile": prof})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
