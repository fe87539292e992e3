"""Does a backward read shared memory before its loads land? Poison every SM's shared memory with
NaN (benchmarks/probe_stale_smem.cu) right before each backward and count the runs whose gradients
hold a NaN, against the same backward unpoisoned (docs/EXPERIMENTS.md, "Flaky CUDA test failures":
the atomic w513 kernel's skipping warpgroup read dO before waiting for it, fixed in the commit that
added this probe). Needs a GPU, nvcc and an sm_90a build.

    nvcc -shared -Xcompiler -fPIC -o build/probe_stale_smem.so benchmarks/probe_stale_smem.cu
    python benchmarks/probe_stale_smem.py [--runs 200]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native.testing import attn_debug, doc_lengths, make_attention_case  # noqa: E402


def case(lengths, d, window, dtype):
    g = torch.Generator().manual_seed(5)
    c = make_attention_case(lengths, 8, 2, d, dtype=dtype, device="cuda", generator=g)
    leaves = [c[n].detach().requires_grad_() for n in ("q", "k", "v", "sink")]
    out = ncp.sink_attention(*leaves, c["cu_seqlens"], window=window)
    return leaves, out, torch.randn(out.shape, generator=g).to("cuda", dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--lib", default="build/probe_stale_smem.so")
    args = ap.parse_args()
    lib = ctypes.CDLL(os.path.abspath(args.lib))

    def grads(leaves, out, dout, poison):
        if poison and lib.ncp_probe_poison_smem(ctypes.c_uint(0xFFFFFFFF)) != 0:
            raise RuntimeError("the poison kernel did not launch")
        g = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        torch.cuda.synchronize()
        return g

    print(torch.cuda.get_device_name(), flush=True)
    # (b): the default backward, D = 128, window 513, 513-token documents (the failing test's shape)
    os.environ["NCP_DETERMINISTIC"] = "0"
    for dtype in (torch.float16, torch.bfloat16):
        lengths = doc_lengths(2100, "equal:513", window=513, generator=torch.Generator().manual_seed(1))
        c = case(lengths, 128, 513, dtype)
        for poison in (False, True):
            bad = total = 0
            for _ in range(args.runs):
                n = sum(int(torch.isnan(t).sum()) for t in grads(*c, poison))
                bad += n > 0
                total += n
            print(f"w513 D=128 {dtype}: poison={poison}: runs with NaN {bad}/{args.runs}, NaN {total}", flush=True)
    # (a): every kernel family at D = 64 and 128 against the portable kernels, poisoned or not
    for d, window in ((64, 0), (64, 128), (128, 0), (128, 513)):
        c = case([700, 1800], d, window, torch.bfloat16)
        with attn_debug(portable=True):
            ref = grads(*c, False)
        for det in ("1", "0"):
            os.environ["NCP_DETERMINISTIC"] = det
            for poison in (False, True):
                err = [round(float((a.float() - b.float()).abs().max()), 4) for a, b in zip(grads(*c, poison), ref)]
                print(f"D={d} w{window} det={det} poison={poison}: max |ours - portable| dq/dk/dv/dsink {err}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
