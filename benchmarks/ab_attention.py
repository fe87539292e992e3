"""A/B timing of ``ncp.sink_attention`` across two builds of the package, in one process.

    python benchmarks/ab_attention.py --a PATH_A --b PATH_B [--cases ...] [--reps 20] [--rounds 3] [--json out]

PATH_A and PATH_B are source trees with the extension built in place (for example the current
tree and ``.baseline/``, a build of an older commit). Both packages are imported side by side
(the second under another module name), the inputs are made once, and every case times A and B
round robin (``--rounds`` rounds, median of ``--reps`` repetitions each; L2 flushed before each
repetition, CUDA events; a queued GPU spin first, so the events time the GPU work and not the
host). Forward with ``torch.no_grad()``, forward+backward with autograd; TFLOP/s from exact
visible pairs x 4 x Hq x D (backward 2.5x). Kept self-contained (no package helpers) so it runs
against any build.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys

import torch

from cases import ATTENTION_CASES as CASES  # noqa: E402


def load(path: str, name: str):
    """The package nemo_cp_native of tree ``path`` as module ``name``; its custom ops register
    under the namespace ``name`` (two builds cannot both own nemo_cp_native::sink_attn_fwd)."""
    spec = importlib.util.spec_from_file_location(name, f"{path}/nemo_cp_native/__init__.py",
                                                  submodule_search_locations=[f"{path}/nemo_cp_native"])  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    real = torch.library.custom_op

    def renamed(qualname, *a, **kw):
        return real(qualname.replace("nemo_cp_native::", f"{name}::"), *a, **kw)

    torch.library.custom_op = renamed
    try:
        spec.loader.exec_module(mod)
    finally:
        torch.library.custom_op = real
    return mod


def pairs(doc: int, n_docs: int, window: int) -> int:
    per = sum(min(i + 1, window) if window else i + 1 for i in range(doc))
    return per * n_docs


_L2 = None


def timed(fn, reps: int) -> float:
    global _L2
    if _L2 is None:
        _L2 = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        _L2.zero_()
        torch.cuda._sleep(1_000_000)  # the host launches while this runs
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    pkgs = {"a": load(args.a, "nemo_cp_native"), "b": load(args.b, "ncp_b")}
    rows = []
    for name in args.cases.split(","):
        total, doc, hq, hkv, d, window = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(total, h, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
                   for h in (hq, hkv, hkv))  # fmt: skip
        sink = (torch.rand(hq, device="cuda", generator=g) * 4 - 2).requires_grad_()
        cu = torch.arange(0, total + 1, doc, device="cuda", dtype=torch.int32)
        dout = torch.randn(total, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
        flops = 4 * pairs(doc, total // doc, window) * hq * d
        res = {k: {"fwd": [], "fwdbwd": []} for k in pkgs}
        for rnd in range(args.rounds):
            for key in (("a", "b") if rnd % 2 == 0 else ("b", "a")):
                ncp = pkgs[key]

                def fwd():
                    with torch.no_grad():
                        ncp.sink_attention(q, k, v, sink, cu, window=window, validate=False)

                def fwdbwd():
                    for t in (q, k, v, sink):
                        t.grad = None
                    ncp.sink_attention(q, k, v, sink, cu, window=window, validate=False).backward(dout)

                for _ in range(3):
                    fwd(), fwdbwd()
                res[key]["fwd"].append(timed(fwd, args.reps))
                res[key]["fwdbwd"].append(timed(fwdbwd, args.reps))
        row = {"case": name}
        for key in pkgs:
            f, fb = statistics.median(res[key]["fwd"]), statistics.median(res[key]["fwdbwd"])
            row[key] = {"fwd_ms": round(f, 4), "fwdbwd_ms": round(fb, 4), "fwd_tflops": round(flops / f / 1e9, 1),
                        "fwdbwd_tflops": round(3.5 * flops / fb / 1e9, 1), "runs_fwd": res[key]["fwd"],
                        "runs_fwdbwd": res[key]["fwdbwd"]}  # fmt: skip
        row["b_over_a_fwd"] = round(row["b"]["fwd_tflops"] / row["a"]["fwd_tflops"], 4)
        row["b_over_a_fwdbwd"] = round(row["b"]["fwdbwd_tflops"] / row["a"]["fwdbwd_tflops"], 4)
        rows.append(row)
        bwd = {key: [fb - f for f, fb in zip(res[key]["fwd"], res[key]["fwdbwd"])] for key in pkgs}
        paired = [b / a for a, b in zip(bwd["a"], bwd["b"])]  # same round: drift between rounds cancels
        print(f"{name:18s} A {row['a']['fwd_tflops']:6.1f} / {row['a']['fwdbwd_tflops']:6.1f}   "
              f"B {row['b']['fwd_tflops']:6.1f} / {row['b']['fwdbwd_tflops']:6.1f}   "
              f"B/A {row['b_over_a_fwd']:.3f} / {row['b_over_a_fwdbwd']:.3f}   "
              f"bwd time B/A {statistics.median(paired):.4f} (B faster in {sum(x < 1 for x in paired)}/{len(paired)})",
              flush=True)  # fmt: skip
        del q, k, v, sink, dout
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": args.a, "b": args.b, "method": "queued spin, L2 flush, CUDA events, median of reps, "
                       "median of rounds (round robin A/B)", "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
