"""``python -m nemo_cp_native {info,demo}``.

info: version, build (CUDA, archs, tile sizes), torch, GPU, whether nemo_automodel imports and is
      patched.
demo: the main job. Built-in synthetic packed batches; each replaced piece is checked against its
      oracle, then timed against what a user would run instead (``nemo_cp_native/_demo.py``):
        1. MiMo THD sharder: exact parity with the reference path; timed against the framework's
           torch ops with a native TE-style partition.
        2. Learned-sink attention: the forward against the float64 oracle (tolerance rule); on a
           GPU timed against FlexAttention with the LSE sink correction and SDPA (causal, no
           sink), forward and forward+backward, TFLOP/s; on the CPU against the PyTorch reference.
        3. Flint Magi CP: plan build (C vs the Python solver) and cp=4 simulated ranks against the
           whole-sequence oracle.
      ``--quick``: smaller shapes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings

import torch

import nemo_cp_native as ncp


def info() -> int:
    from . import _compat
    from .patch import is_patched

    b = ncp.build_info()
    print(f"nemo_cp_native {ncp.__version__}")
    print(f"  build: CUDA {'on' if b['cuda'] else 'off'}" + (f" (archs {b['cuda_archs']})" if b["cuda"] else ""))
    print("  ops: thd_partition, mimo_layout, mimo_shard, sink_attn_fwd, sink_attn_bwd, magi_dispatch, plan_build "
          f"(CPU{' + CUDA' if b['cuda'] else ''})")  # fmt: skip
    print(f"  torch {torch.__version__}, python {platform.python_version()}")
    if torch.cuda.is_available():
        print(f"  GPU: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
    else:
        print("  GPU: none")
        if b["cuda"]:
            print("  note: the CUDA kernels are built but cannot run on this machine (torch sees no GPU);"
                  " the CPU kernels run instead")  # fmt: skip
    if _compat.HAVE_UPSTREAM:
        print(f"  nemo_automodel {_compat.upstream_version()}: importable, patched={is_patched()}")
    else:
        print("  nemo_automodel: not importable (patch() is a no-op; stand-in sharder classes in use)")
    return 0


def demo(device: str, quick: bool) -> int:
    from . import _demo

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() and ncp.has_cuda() else
                       ("cpu" if device == "auto" else device))  # fmt: skip
    gpu = dev.type == "cuda"
    print(f"nemo_cp_native demo on {dev} ({torch.cuda.get_device_name() if gpu else platform.machine()}), "
          f"torch {torch.__version__}{', quick' if quick else ''}")  # fmt: skip
    checks, timings = [], []
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for part in (_demo.mimo, _demo.attention_parity, _demo.flint):
            c, t = part(dev, quick)
            checks += c
            timings += t
        if gpu:
            c, t = _demo.attention_speed_gpu(quick)
            checks += c
            timings += t
        else:
            timings += _demo.attention_speed_cpu(quick)
    print("\nParity (native against its oracle)")
    for c in checks:
        print(f"  parity {'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    _print_timings(timings)
    print("\nTiming: " + ("attention rows: L2 flushed before each call, CUDA events, median, default arguments "
                           "(the benchmark's do_bench method); other rows: " if gpu else "")
          + "wall clock, median" + (", device synced after each call." if gpu else "."))  # fmt: skip
    if not gpu:
        why = ("this build has no CUDA kernels (build with nvcc present)" if torch.cuda.is_available() and
               not ncp.has_cuda() else "run this on one")  # fmt: skip
        print(f"GPU baselines (FlexAttention with the sink correction, SDPA) need a GPU: {why}. On the CPU,\n"
              "attention and Flint run the C double-precision path (the CPU backend and second oracle).")  # fmt: skip
    bad = [c.name for c in checks if not c.ok]
    print(f"\ndemo took {time.perf_counter() - t0:.0f} s")
    print("all parity checks passed" if not bad else f"PARITY FAILED: {bad}")
    return 1 if bad else 0


def _print_timings(rows) -> None:
    head = ["case", "ours ms", "baseline", "baseline ms", "speedup"]
    flops = any(r.flops for r in rows)
    head += ["ours TFLOP/s", "baseline TFLOP/s"] if flops else []
    table = []
    for r in rows:
        row = [r.case, f"{r.ours_ms:.3f}", r.baseline, f"{r.base_ms:.3f}", f"{r.base_ms / r.ours_ms:.2f}x"]
        if flops:
            row += [f"{r.flops / r.ours_ms / 1e9:.1f}", f"{r.flops / r.base_ms / 1e9:.1f}"] if r.flops else ["", ""]
        table.append(row)
    width = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
    print("\nSpeed (speedup = baseline time / our time)")
    print(" | ".join(h.ljust(w) for h, w in zip(head, width)).rstrip())
    print("-|-".join("-" * w for w in width))
    for row in table:
        print(" | ".join(c.ljust(w) if i in (0, 2) else c.rjust(w) for i, (c, w) in enumerate(zip(row, width))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_cp_native", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="version, build, torch, GPU, upstream")
    d = sub.add_parser("demo", help="native vs reference on synthetic packed batches")
    d.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    d.add_argument("--quick", action="store_true", help="smaller shapes")
    args = ap.parse_args(argv)
    return info() if args.cmd == "info" else demo(args.device, args.quick)


if __name__ == "__main__":
    sys.exit(main())
