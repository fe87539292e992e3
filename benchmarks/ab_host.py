"""A/B of the host path of the attention entry points: two trees in one process, round robin.

What a change to the Python around the native calls moves (``nemo_cp_native/attention.py``):
the host time of ``attn_forward`` and ``attn_backward`` (the calls ``SinkAttnFunc`` and the Flint
CP step make), with a document mask (``cu_seqlens``) and with a table mask (``row_lo`` /
``row_hi``, as Flint CP passes), of ``sink_attention`` as a user calls it (an autograd
forward; a forward then ``out.backward()``) and of ``FlintMagiPlan.attention`` at cp = 1 (its
checks, then the same kernels). Tiny shapes, so that the call's time is its host path:

- ``--device cpu`` (no GPU needed): the CPU kernels on 4 tokens, each call timed whole; the
  kernel's own part is the same in both trees;
- ``--device cuda``: each call behind a queued GPU spin (the host clock, as ``bench_host.py``).

Median of the per-round medians (single calls), rounds alternating A/B. Both trees' outputs are
compared for equality first.

    python benchmarks/ab_host.py --a .baseline --b . [--labels A B] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE]
from ab_attention import load  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--labels", nargs=2, metavar=("A", "B"),
                    help="names of the two trees in the JSON (default: the paths)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rounds", type=int, help="rounds, A and B alternating (default 30 on cpu, 8 on cuda)")
    ap.add_argument("--reps", type=int, help="single calls timed per round (default 500 on cpu, 60 on cuda)")
    ap.add_argument("--json")
    args = ap.parse_args()
    pkgs = {"a": load(args.a, "nemo_cp_native"), "b": load(args.b, "ncp_b")}
    from common import env_record

    cuda = args.device == "cuda"
    args.rounds = args.rounds or (8 if cuda else 30)  # on cuda every call waits behind a queued spin
    args.reps = args.reps or (60 if cuda else 500)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    T, Hq, Hkv, D = 4, 2, 1, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, Hq, D, generator=g).to(dev, dtype)
    k = torch.randn(T, Hkv, D, generator=g).to(dev, dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dev, dtype)
    sink = torch.zeros(Hq, device=dev)
    cu = torch.tensor([0, 2, T], dtype=torch.int32, device=dev)
    lo = torch.tensor([0, 0, 2, 2], dtype=torch.int32, device=dev)
    hi = torch.arange(T, dtype=torch.int32, device=dev)

    def calls(pkg):
        A = pkg.attention
        masks = {"docs": A.AttnMask(cu, 0, None, None), "table": A.AttnMask(None, 0, lo, hi)}
        fns = {}
        for name, mask in masks.items():
            out, lse = A.attn_forward(q, k, v, sink, mask, 0.125)
            dout = torch.ones_like(out)
            fns[f"forward, {name}"] = lambda A=A, m=mask: A.attn_forward(q, k, v, sink, m, 0.125)
            fns[f"backward, {name}"] = lambda A=A, m=mask, o=out, s=lse, d=dout: A.attn_backward(d, q, k, v, sink, o, s,
                                                                                                m, 0.125)  # fmt: skip
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sink)]
        fns["sink_attention, autograd forward"] = lambda p=pkg: p.sink_attention(*leaves, cu)

        def fwd_bwd(p=pkg):  # forward, then out.backward(): the node's backward through the engine
            out = p.sink_attention(*leaves, cu)
            out.backward(torch.ones_like(out))
            return out

        fns["sink_attention, forward + out.backward()"] = fwd_bwd
        from types import SimpleNamespace

        cfg = SimpleNamespace(num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D, sliding_window=3,
                              magi_chunk_size=T)  # fmt: skip
        plan = pkg.flint._build_magi_plan(torch.tensor([0, T], dtype=torch.int32), cfg, None)
        fns["FlintMagiPlan.attention, cp = 1, autograd forward"] = lambda pl=plan: pl.attention(*leaves, 3, 0.125)
        return fns

    fns = {key: calls(pkg) for key, pkg in pkgs.items()}
    for name in fns["a"]:
        x, y = fns["a"][name](), fns["b"][name]()
        x, y = (x, y) if isinstance(x, tuple) else ((x,), (y,))
        assert all((s is None and t is None) or torch.equal(s, t) for s, t in zip(x, y)), name

    def one(fn):
        if cuda:
            torch.cuda._sleep(2_000_000)
        t0 = time.perf_counter_ns()
        fn()
        dt = (time.perf_counter_ns() - t0) / 1e3
        if cuda:
            torch.cuda.synchronize()
        return dt

    rows = []
    for name in fns["a"]:
        res = {"a": [], "b": []}
        for rnd in range(args.rounds):
            for key in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
                fn = fns[key][name]
                for _ in range(20):
                    fn()
                res[key].append(round(statistics.median(one(fn) for _ in range(args.reps)), 2))
        a, b = statistics.median(res["a"]), statistics.median(res["b"])
        rows.append({"call": name, "a_us": round(a, 2), "b_us": round(b, 2), "b_over_a": round(b / a, 4), "runs": res})
        print(f"{name:20s} A {a:7.2f} us | B {b:7.2f} us | B/A {b / a:.4f}", flush=True)
    if args.json:
        a_name, b_name = args.labels or (args.a, args.b)
        method = ("host clock, one call behind a queued GPU spin, median of reps" if cuda else
                  "host clock, one call on CPU tensors (T = 4, Hq = 2, Hkv = 1, D = 64), median of reps")  # fmt: skip
        rec = {"env": env_record(), "a": a_name, "b": b_name, "device": args.device,
               "method": method + "; median of rounds (round robin A/B)", "rows": rows}
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
