"""Learned-sink attention on the GPU: nemo_cp_native vs FlexAttention(+sink correction) vs SDPA.

FLOPs: 4 x exact visible (query, key) pairs x Hq x D forward; backward 2.5x (fwd+bwd = 3.5x).
FlexAttention is compiled, runs the same document/window mask as a block mask, returns its LSE,
and applies the sink as ``out * sigmoid(lse - sink)`` (``nemo_cp_native.baselines``, what
Automodel's flex path does). SDPA has no sink; it applies where the mask is plain causal per
equal-length document (batched). Every implementation is compared with ours before timing
(``max|x-ncp|`` in the note).

Three timings per row, each with ``baselines.time_gpu`` (L2 flushed before every repetition, CUDA
events, median):
- ``do_bench`` (the ``fwd_*`` / ``fwdbwd_*`` keys): the call as a user makes it, default
  arguments, on an idle GPU (the host waits for each call's end), so the host's work for the call
  counts;
- ``loop`` (the ``*_loop`` keys): the same calls in triton's ``do_bench`` loop, queued back to back
  with one wait after the last: the host runs ahead as in a training loop, and its time counts
  only where it exceeds the GPU's;
- ``queued`` (the ``*_queued`` keys; ``--method all``, ``both`` or ``queued``): a GPU spin is queued before
  each call and our op runs with ``validate=False``, so the host launches while the GPU is busy
  and the events time the GPU work alone, as in a training step that keeps the queue full.
By default every implementation of a case is timed round robin (one call each per round, in the
orders of a balanced Latin square, ``round_order``, over whole squares; medians over rounds), after
``--heat`` seconds of work.

    python benchmarks/bench_sink_attention.py [--quick] [--json out.json] [--cases a,b] [--no-flex]
        [--impls ncp,ncp-nosink,ncp-deterministic,flex+sink,sdpa] [--method all|both|do_bench|loop|queued]
        [--variant NAME:VAR=VAL[,VAR=VAL]] [--no-interleave] [--reps N] [--heat S]
        [--case NAME=TOKENS,DOC,HQ,HKV,D,WINDOW ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, env_record, make_attention_case, print_table, write_json  # noqa: E402

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import baselines as bl  # noqa: E402

from cases import ATTENTION_CASES as CASES  # noqa: E402
QUICK = {"quick-causal": (8192, 2048, 8, 2, 128, 0), "quick-w128": (8192, 2048, 8, 2, 64, 128)}
DEVICE = "cuda"  # the smoke test of this script runs it on the CPU with stand-ins for the GPU timers
METHODS = {"all": ("do_bench", "loop", "queued"), "both": ("do_bench", "queued"), "do_bench": ("do_bench",),
           "loop": ("loop",), "queued": ("queued",)}
LOOP_REPS = 5  # loop method: calls queued back to back per round (their median is the round's figure)
SUFFIX = {"do_bench": "", "loop": "_loop", "queued": "_queued"}


@dataclass
class Impl:
    """One row: the call as a user makes it (``fwd``/``fwdbwd``), the call with the least host work
    (``fwd_fast``/``fwdbwd_fast``, for queued timing), switches, leaves whose grads reset."""

    name: str
    fwd: object
    fwdbwd: object
    fwd_fast: object
    fwdbwd_fast: object
    env: dict = field(default_factory=dict)
    note: str = ""
    leaves: tuple = ()


@contextlib.contextmanager
def _env(env: dict):
    """Sets environment switches for the duration (the native ops read them at each call)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, val in saved.items():
            os.environ.pop(key, None)
            if val is not None:
                os.environ[key] = val


def _heat(seconds: float, fn) -> None:
    """Runs fn for about ``seconds``, so every row is timed in the same hot, clock-settled state."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        torch.cuda.synchronize()


def _kernel_note(D: int, window: int) -> str:
    """Which kernels run (the dispatcher's choice on this device for this head dim and window)."""
    from nemo_cp_native.testing import kernels

    fwd, bwd = kernels(D=D, window=window)
    return f"{fwd} fwd + {bwd} bwd"


def _ours(q, k, v, sink, cu, window, dout, ref, variants) -> list[Impl]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sink)]
    rows = [("ncp", leaves[3], {}, _kernel_note(q.shape[-1], window)), ("ncp-nosink", None, {}, "no sink"),
            ("ncp-deterministic", leaves[3], {"NCP_DETERMINISTIC": "1"}, "deterministic backward")]  # fmt: skip
    rows += [(name, leaves[3], env, " ".join(f"{k}={v}" for k, v in env.items())) for name, env in variants]
    impls = []
    for name, s, env, note in rows:

        def fwd(s=s, fast=False):
            with torch.no_grad():
                return ncp.sink_attention(*leaves[:3], s, cu, window=window, **({"validate": False} if fast else {}))

        def fwdbwd(s=s, fast=False):
            out = ncp.sink_attention(*leaves[:3], s, cu, window=window, **({"validate": False} if fast else {}))
            out.backward(dout)

        if s is not None:
            with _env(env):
                note += f"; max|x-ncp|={(fwd().float() - ref.float()).abs().max().item():.3g}"
        impls.append(Impl(name, fwd, fwdbwd, lambda f=fwd: f(fast=True), lambda f=fwdbwd: f(fast=True), env,
                          note.lstrip("; "), tuple(leaves)))  # fmt: skip
    return impls


def _flex(q, k, v, sink, lengths, window, dout, ref) -> Impl:
    run = bl.flex_sink_attention(lengths, window)
    fq, fk, fv = (bl.to_bhtd(t).requires_grad_() for t in (q, k, v))
    fs = sink.detach().clone().requires_grad_()
    fdout = bl.to_bhtd(dout)
    err = (bl.from_bhtd(run(fq, fk, fv, fs)).float() - ref.float()).abs().max().item()

    def fwd():
        with torch.no_grad():
            return run(fq, fk, fv, fs)

    def fwdbwd():
        run(fq, fk, fv, fs).backward(fdout)

    return Impl("flex+sink", fwd, fwdbwd, fwd, fwdbwd, note=f"max|x-ncp|={err:.3g}", leaves=(fq, fk, fv, fs))


def _sdpa(q, k, v, doc_len, dout) -> Impl:
    sq, sk, sv = (bl.to_documents(t, doc_len).requires_grad_() for t in (q, k, v))
    sdout = bl.to_documents(dout, doc_len)

    def fwd():
        with torch.no_grad():
            return bl.sdpa_causal(sq, sk, sv)

    def fwdbwd():
        bl.sdpa_causal(sq, sk, sv).backward(sdout)

    return Impl("sdpa(no sink)", fwd, fwdbwd, fwd, fwdbwd, note="no sink", leaves=(sq, sk, sv))


def design_rounds(n_items: int) -> int:
    """Rounds of one full balanced design for ``n_items`` rows (``round_order``)."""
    return n_items if n_items % 2 == 0 else 2 * n_items


def round_order(items: list, r: int) -> list:
    """The order of round r: row r mod L of a balanced Latin square (Williams' design, L =
    ``design_rounds``), so over any L consecutive rounds every row runs at every position, and
    right after every other row, equally often. The per-call timing of a row depends on what ran
    before it and when: the host's caches after a compiled FlexAttention call (the first row,
    ours, read 1-5% slower than the deterministic row with the same forward at 95cdcb6 and
    7b9b231), and the GPU's clock under its power limit after a heavy call (the same dK/dV kernel
    drifted 19.97 -> 23.73 ms with call order in one process at ff1365a, docs/EXPERIMENTS.md). A
    fixed cyclic order gives every row one predecessor for ever; orders drawn from seeded
    generators (before 2026-12-06) gave each row the same uneven mix of positions and
    predecessors in every run (on causal 8k documents the sink row followed SDPA in 4 of 10
    rounds, the no-sink row the deterministic one in 5), so a bias repeated from run to run."""
    n = len(items)
    first, lo, hi = [0], 1, n - 1  # 0, 1, n - 1, 2, n - 2, ...: consecutive differences all distinct mod n
    for k in range(1, n):
        if k % 2:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(j + i) % n for j in first] for i in range(n)]
    if n % 2:  # odd n: the mirrored rows balance the predecessors
        rows += [row[::-1] for row in rows]
    return [items[j] for j in rows[r % len(rows)]]


def paired_ratio(a: list, b: list) -> dict:
    """Row b against row a from the same rounds: per round the ratio b / a of their times, then
    the median and quartiles of those ratios. A slow stretch of the GPU (its clock, a neighbour's
    heat) touches both calls of a round, so the paired ratio's spread is the method's own noise
    floor for a difference between two rows; the ratio of two rows' medians carries the noise of
    each."""
    if not a or len(a) != len(b):
        return {}
    r = sorted(y / x for x, y in zip(a, b))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
    return {"median": round(statistics.median(r), 4), "q1": round(q[0], 4), "q3": round(q[2], 4), "rounds": len(r)}


def _time(impls: list[Impl], methods, reps: int, heat: float, interleave: bool) -> tuple[dict, dict]:
    """{(impl, method): (fwd ms, fwd+bwd ms)} and, interleaved, {(impl, method): (fwd rounds,
    fwd+bwd rounds)}: the ms of every counted round, in round order (the same rounds for every row)."""
    out, samples = {}, {}
    for method in methods:
        queued, loop = method == "queued", method == "loop"
        fns = {i.name: ((i.fwd_fast, i.fwdbwd_fast) if queued else (i.fwd, i.fwdbwd)) for i in impls}
        if not interleave:
            for i in impls:
                with _env(i.env):
                    _heat(heat, fns[i.name][1])
                    out[i.name, method] = tuple(
                        bl.time_gpu(fns[i.name][w], reps=n, queued=queued, loop=loop, grad_to_none=i.leaves)
                        for w, n in ((0, reps), (1, max(3, reps // 2))))  # fmt: skip
            continue
        with _env(impls[0].env):
            _heat(heat, fns[impls[0].name][1])
        times = {(i.name, w): [] for i in impls for w in (0, 1)}
        whole = design_rounds(len(impls))  # counted rounds: whole designs
        for which, n in ((0, reps), (1, max(3, reps // 2))):
            n = -(-n // whole) * whole
            for r in range(-2, n):  # 2 warm-up rounds
                for i in round_order(impls, r):
                    with _env(i.env):
                        ms = bl.time_gpu(fns[i.name][which], reps=LOOP_REPS if loop else 1, warmup=1 if loop else 0,
                                         queued=queued, loop=loop, grad_to_none=i.leaves)  # fmt: skip
                    if r >= 0:
                        times[i.name, which].append(ms)
        for i in impls:
            out[i.name, method] = (statistics.median(times[i.name, 0]), statistics.median(times[i.name, 1]))
            samples[i.name, method] = (times[i.name, 0], times[i.name, 1])
    return out, samples


def bench_case(name, spec, *, flex: bool, reps: int, heat: float, only: frozenset, methods, interleave: bool,
               variants=()) -> list[dict]:  # fmt: skip
    total, doc_len, hq, hkv, d, window = spec
    lengths = doc_lengths(total, f"equal:{doc_len}")
    g = torch.Generator().manual_seed(1234)
    c = make_attention_case(lengths, hq, hkv, d, dtype=torch.bfloat16, device=DEVICE, generator=g)
    q, k, v, sink, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    dout = torch.randn(q.shape, generator=g).to(DEVICE, torch.bfloat16)
    fwd_flops = bl.attention_flops(lengths, window, hq, d)
    base = {"case": name, "tokens": total, "doc": doc_len, "heads": f"{hq}/{hkv}", "D": d, "window": window}
    keep = lambda n: not only or n in only or n.split("(")[0] in only  # noqa: E731
    ref = ncp.sink_attention(q, k, v, sink, cu, window=window)
    impls = [i for i in _ours(q, k, v, sink, cu, window, dout, ref, variants) if keep(i.name)]
    rows = []
    if flex and keep("flex+sink"):
        try:
            impls.append(_flex(q, k, v, sink, lengths, window, dout, ref))
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            rows.append({**base, "impl": "flex+sink", "note": f"failed: {type(exc).__name__}: {exc}"[:200]})
    if window == 0 and total % doc_len == 0 and keep("sdpa(no sink)"):
        impls.append(_sdpa(q, k, v, doc_len, dout))
    times, samples = _time(impls, methods, reps, heat, interleave)
    for i in impls:
        row = {**base, "impl": i.name}
        for method in methods:
            f_ms, fb_ms = times[i.name, method]
            sfx = SUFFIX[method]
            row.update({f"fwd_ms{sfx}": round(f_ms, 3), f"fwd_tflops{sfx}": round(bl.tflops(fwd_flops, f_ms), 1),
                        f"fwdbwd_ms{sfx}": round(fb_ms, 3),
                        f"fwdbwd_tflops{sfx}": round(bl.tflops(3.5 * fwd_flops, fb_ms), 1)})  # fmt: skip
            if (i.name, method) in samples:  # per-round ms, and (our other rows) the paired ratio to ncp
                fr, fbr = samples[i.name, method]
                row[f"fwd_rounds_ms{sfx}"] = [round(x, 4) for x in fr]
                row[f"fwdbwd_rounds_ms{sfx}"] = [round(x, 4) for x in fbr]
                if i.name != "ncp" and ("ncp", method) in samples:
                    base_f, base_fb = samples["ncp", method]
                    row[f"fwd_vs_ncp{sfx}"] = paired_ratio(base_f, fr)
                    row[f"fwdbwd_vs_ncp{sfx}"] = paired_ratio(base_fb, fbr)
        row["note"] = i.note
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke)")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--reps", type=int, default=20,
                    help="forward rounds (forward+backward: half, at least 3), rounded up to whole designs")
    ap.add_argument("--heat", type=float, default=1.0, help="seconds of fwd+bwd before timing")
    ap.add_argument("--impls", default="", help="comma list of rows (default: all; sdpa for sdpa(no sink))")
    ap.add_argument("--method", choices=tuple(METHODS), default="all")
    ap.add_argument("--variant", action="append", default=[],
                    help="an extra row of ours under environment switches, NAME:VAR=VAL[,VAR=VAL] (A/B runs)")
    ap.add_argument("--case", action="append", default=[], metavar="NAME=TOKENS,DOC,HQ,HKV,D,WINDOW",
                    help="an extra case (window 0: causal); with --case only these and --cases run")
    ap.add_argument("--no-interleave", action="store_true", help="time the rows one after the other")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not ncp.has_cuda():
        print("bench_sink_attention: needs a GPU and a CUDA build; skipping")
        return 0
    variants = []
    for spec in args.variant:
        vname, _, assigns = spec.partition(":")
        variants.append((vname, dict(a.split("=", 1) for a in assigns.split(",") if a)))
    cases = QUICK if args.quick else CASES
    extra = {}
    for spec in args.case:
        cname, eq, dims = spec.partition("=")
        vals = dims.split(",")
        if not cname or not eq or len(vals) != 6 or not all(x.strip().isdigit() for x in vals):
            ap.error(f"--case {spec!r}: expected NAME=TOKENS,DOC,HQ,HKV,D,WINDOW (non-negative integers)")
        extra[cname] = tuple(int(x) for x in vals)
    if args.cases or extra:
        chosen = set(args.cases.split(",")) if args.cases else set()
        cases = {k: v for k, v in {**CASES, **QUICK}.items() if k in chosen} | extra
    only = frozenset(args.impls.split(",")) | {n for n, _ in variants} if args.impls else frozenset()
    methods = METHODS[args.method]
    env = {**env_record(), "methods": list(methods), "reps": args.reps, "interleave": not args.no_interleave,
           "round_order": "balanced Latin square"}
    rows, cols = [], ["case", "impl"] + [f"{w}_tflops{SUFFIX[m]}" for m in methods for w in ("fwd", "fwdbwd")]
    for name, spec in cases.items():
        new = bench_case(name, spec, flex=not args.no_flex, reps=args.reps, heat=args.heat, only=only,
                         methods=methods, interleave=not args.no_interleave, variants=variants)  # fmt: skip
        rows += new
        print_table(new, cols + ["fwd_ms", "fwdbwd_ms", "note"])
        for row in new:
            for method in methods:
                sfx = SUFFIX[method]
                f, fb = row.get(f"fwd_vs_ncp{sfx}"), row.get(f"fwdbwd_vs_ncp{sfx}")
                if f and fb:
                    print(f"  {row['impl']} / ncp, time ratio per round ({method}), median [quartiles]: "
                          f"fwd {f['median']:.4f} [{f['q1']:.4f}, {f['q3']:.4f}] ({f['rounds']} rounds), "
                          f"fwd+bwd {fb['median']:.4f} [{fb['q1']:.4f}, {fb['q3']:.4f}] ({fb['rounds']} rounds)")
        sys.stdout.flush()
        write_json(args.json, {"env": env, "rows": rows})  # after every case: a cut-off run keeps its results
    print()
    print_table(rows, cols)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
