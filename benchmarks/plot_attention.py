"""Bar chart of learned-sink attention TFLOP/s per case (ours, FlexAttention+sink, SDPA), forward
and forward+backward, from a bench_sink_attention.py JSON. Needs matplotlib (the ``bench`` extra:
``pip install -e .[bench]``); the JSON can come from a GPU machine that has none.

    python benchmarks/plot_attention.py [benchmarks/results/<run>_attn.json] [-o docs/attention_tflops.png]
        [--method do_bench|loop|queued]

Without a JSON argument it plots the file that BENCHMARKS.md's ``attn`` block cites.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from render_records import LABELS, PAGE, ROOT, blocks, load_attn  # noqa: E402

SERIES = (("ncp", "#76b900"), ("flex+sink", "#4c72b0"), ("sdpa(no sink)", "#b0b0b0"))
LEGEND = {**LABELS, "sdpa(no sink)": "SDPA, no sink (causal cases only)"}


def plot(path: str, out: str, method: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = load_attn(path)
    m = method or a["methods"][0]
    if m not in a["methods"]:
        raise SystemExit(f"plot_attention: {path} has no {m!r} timing (it has {a['methods']})")
    cases = a["cases"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    width = 0.27
    for ax, (key, title) in zip(axes, (("fwd", "forward"), ("fb", "forward + backward"))):
        for j, (impl, color) in enumerate(SERIES):
            xs, ys = [], []
            for i, c in enumerate(cases):
                t = a["t"].get((c, impl, m))
                if t is not None:
                    xs.append(i + (j - 1) * width)
                    ys.append(t[key])
            bars = ax.bar(xs, ys, width, label=LEGEND[impl], color=color, edgecolor="black", linewidth=0.4)
            if impl == "ncp":
                ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
        ax.set_title(title)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_ylabel("TFLOP/s (exact visible pairs)")
    axes[0].legend(fontsize=8, loc="upper left")
    env = a["env"]
    fig.suptitle(f"Learned-sink attention, bf16, {env.get('gpu', '?')}: {m} timing, commit {env['commit']}, "
                 f"{env['date'][:10]}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="?", default=None)
    ap.add_argument("-o", "--out", default=os.path.join(ROOT, "docs", "attention_tflops.png"))
    ap.add_argument("--method", default=None, help="timing to plot (default: the file's primary one)")
    args = ap.parse_args(argv)
    path = args.json
    if path is None:
        with open(PAGE) as f:
            path = next(paths[0] for kind, paths in blocks(f.read()) if kind == "attn")
    print(f"plot_attention: {plot(path, args.out, args.method)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
