"""Summary of Nsight Compute's per-instruction stall sampling (the SASS page of ``gpu_run.sh srcprof``).

For each CSV (``ncu -i REPORT --page source --csv --print-source sass``): the warp-stall samples by
reason, the samples by kind of instruction (wgmma issue, wgmma waits, named barriers, mbarrier
waits, the descriptor moves R2UR, math), and the instructions with the most samples. The CSVs
(2 MB each) are not kept; their summaries are (benchmarks/results/*_srcprof.txt).

    python benchmarks/srcprof_summary.py A.csv [B.csv ...] [--top 15] [--context 0]

``--context N``: the N instructions before each of the top ones (which wait a stalled branch
closes, for example the mbarrier try-wait that a ``@!P0 BRA`` loops on).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re

KINDS = (  # first match wins
    ("wgmma issue (HGMMA)", re.compile(r"\bHGMMA\b")),
    ("wgmma wait (WARPGROUP.DEPBAR)", re.compile(r"WARPGROUP\.DEPBAR")),
    ("wgmma fence (WARPGROUP.ARRIVE)", re.compile(r"WARPGROUP\.ARRIVE")),
    ("named barrier (BAR)", re.compile(r"\bBAR\.")),
    ("mbarrier (SYNCS)", re.compile(r"\bSYNCS\.")),
    ("register to uniform (R2UR)", re.compile(r"\bR2UR\b")),
    ("exp2 (MUFU)", re.compile(r"\bMUFU\.")),
    ("float math (FFMA/FADD/FMUL/FMNMX/FSEL/F2FP)", re.compile(r"\b(FFMA|FADD|FMUL|FMNMX|FSEL|F2FP)\b")),
    ("branch (BRA/BSSY/BSYNC)", re.compile(r"\b(BRA|BSSY|BSYNC)\b")),
)


def summarize(path: str, top: int, context: int = 0) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total, by_reason, by_kind, recs = 0, collections.Counter(), collections.Counter(), []
    base = None
    for r in rows[2:]:
        if len(r) < len(hdr):
            continue
        addr = int(r[ix["Address"]], 16)
        base = addr if base is None else base
        src = r[ix["Source"]].strip()
        n = int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        total += n
        per = {h[6:]: int(r[ix[h]] or 0) for h in reasons}
        by_reason.update(per)
        kind = next((k for k, pat in KINDS if pat.search(src)), "other")
        by_kind[kind] += n
        recs.append((n, addr - base, src, per))
    out = [f"== {os.path.basename(path)}: {len(recs)} instructions, {total} samples", "stall reasons:"]
    out += [f"  {k:20s} {v / total:6.1%}" for k, v in by_reason.most_common() if v]
    out.append("samples by instruction kind:")
    out += [f"  {k:45s} {v / total:6.1%}" for k, v in by_kind.most_common() if v]
    out.append(f"top {top} instructions (offset from the kernel start, top reasons):")
    at = {off: i for i, (_, off, _, _) in enumerate(recs)}
    for n, off, src, per in sorted(recs, key=lambda x: -x[0])[:top]:
        why = ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:2] if v)
        out.append(f"  {n / total:5.1%} +{off:05x} {src[:64]:64s} {why}")
        i = at[off]
        for m, o, s, _ in recs[max(0, i - context):i]:
            out.append(f"        +{o:05x} {s[:64]:64s} {m / total:5.1%}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--context", type=int, default=0, help="instructions shown before each top one")
    args = ap.parse_args()
    print("\n\n".join(summarize(p, args.top, args.context) for p in args.csv))


if __name__ == "__main__":
    main()
