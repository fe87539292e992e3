"""Host time of the MiMo sharder's C layout pass (``ncp_mimo_layout``) alone, in two trees.

Every sharder call runs this pass on the host (validation, cu_seqlens, the kernel table) before
its one launch, on any device. ``bench_mimo_layout.c`` is compiled against each tree's
``csrc/core`` with the system C compiler (the extension's C flags) and the two binaries run
alternately, ``--rounds`` times each; each run prints the median of 15 batches of ``--reps`` calls.
Cases: B = 8 rows of S = 32768 tokens (16-64 documents a row, the bench's batches), cp = 8, one
and four chunks, and cp = 6 (S = 32760: a cp size that is not a power of two). No GPU needed.

    python benchmarks/bench_mimo_layout.py --a <older tree> --b . [--labels A B] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE]

CASES = [  # (name, B, S, cp, docs lo, docs hi, chunks)
    ("B 8, S 32768, cp 8, 1 chunk", 8, 32768, 8, 16, 64, 1),
    ("B 8, S 32768, cp 8, 4 chunks", 8, 32768, 8, 16, 64, 4),
    ("B 8, S 32760, cp 6, 1 chunk", 8, 32760, 6, 16, 64, 1),
]


def build(tree: str, out: str) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    core = os.path.join(tree, "csrc", "core")
    srcs = [os.path.join(_HERE, "bench_mimo_layout.c")] + [os.path.join(core, f) for f in
                                                         ("mimo_layout.c", "status.c", "common.c")]  # fmt: skip
    inc = ["-I" + os.path.join(tree, "csrc", "include"), "-I" + core]
    cmd = [cc, "-O3", "-fwrapv", "-std=c11", *inc, *srcs, "-o", out]
    subprocess.run(cmd, check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--labels", nargs=2, metavar=("A", "B"),
                    help="names of the two trees in the JSON (default: the paths)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--json")
    args = ap.parse_args()
    from common import env_record

    with tempfile.TemporaryDirectory() as tmp:
        bins = {k: build(t, os.path.join(tmp, k)) for k, t in (("a", args.a), ("b", args.b))}
        rows = []
        for name, B, S, cp, lo, hi, C in CASES:
            res, words = {"a": [], "b": []}, {}
            for rnd in range(args.rounds):
                for key in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
                    run = subprocess.run([bins[key], str(B), str(S), str(cp), str(lo), str(hi), str(C), str(args.reps),
                                          "1"], capture_output=True, text=True, check=True)  # fmt: skip
                    us, kw, tw = run.stdout.split()
                    res[key].append(float(us))
                    words[key] = (int(kw), int(tw))  # the same tables every run
            a, b = statistics.median(res["a"]), statistics.median(res["b"])
            rows.append({"call": name, "a_us": round(a, 3), "b_us": round(b, 3), "b_over_a": round(b / a, 4),
                         "kernel_words": {k: w[0] for k, w in words.items()},
                         "total_words": {k: w[1] for k, w in words.items()}, "runs": res})  # fmt: skip
            print(f"{name:32s} A {a:7.3f} us | B {b:7.3f} us | B/A {b / a:.4f} (kernel table: A {words['a'][0]}, "
                  f"B {words['b'][0]} words)", flush=True)  # fmt: skip
    if args.json:
        a_name, b_name = args.labels or (args.a, args.b)
        method = (f"ncp_mimo_layout alone, host clock, median of 15 batches of {args.reps} calls per run, "
                  f"median of {args.rounds} runs per tree, runs alternating A/B")  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"env": env_record(), "a": a_name, "b": b_name, "method": method, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
