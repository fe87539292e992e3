"""Renders a bench_sink_attention.py JSON file as the Markdown table of BENCHMARKS.md (TFLOP/s),
so recorded figures are copied by the machine, not by hand.

    python benchmarks/render_attn_table.py bench_attn.json
"""

from __future__ import annotations

import json
import sys


def render(path: str) -> str:
    data = json.load(open(path))
    rows, env = data["rows"], data["env"]
    impls = []
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    cases = []
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
    by = {(r["case"], r["impl"]): r for r in rows}
    out = [f"<!-- {env['date']} {env['gpu']} commit {env['commit']} torch {env['torch']}: {env['argv']} -->"]
    out.append("| case | " + " | ".join(f"{i} fwd / fwd+bwd" for i in impls) + " |")
    out.append("|---|" + "---|" * len(impls))
    for c in cases:
        cells = []
        for i in impls:
            r = by.get((c, i))
            if r is None:
                cells.append("n/a")
            elif r.get("fwd_tflops") is None:
                cells.append("failed")
            else:
                cells.append(f"{r['fwd_tflops']} / {r.get('fwdbwd_tflops')}")
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(sys.argv[1]))
