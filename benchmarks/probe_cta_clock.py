"""Per-CTA timeline of the Hopper dK/dV kernel: where a backward's dK/dV time goes, CTA by CTA.

Needs a probe build (``NCP_CTA_CLOCK=1 python setup.py build_ext --inplace``): the kernel then
records, for each CTA, its SM, its item count (query heads x q tiles of 64 rows), and %globaltimer
at entry, once K and V are in (the consumers' first wait), at the end of its item loop and after
its dK/dV store, and the time consumer warpgroup 0 waited for its items' stage (Q, lse, Delta, key
bounds; the wait for the next item runs beside the current item's MMAs), the time the dQ writers
spun on another CTA's claim, and the time the TMA thread waited for free stages
(sm90_bwd_parts.cuh, ``g_cta_clock``); ``ncp_cta_clock_read`` copies them out. The probe runs one
backward per round (L2 flushed first) and reports, per case:

- the span of the kernel and the SMs' busy share (CTA time / (SMs x span)), the idle time per SM
  between CTAs, before its first and after its last;
- a least-squares fit of CTA time = fixed + per-item x items, and per q-tile class (n_q) the CTA
  count, time, time per item, ramp (entry to K/V in) and drain (loop end to end);
- the same per-item time for the CTAs of each class in each half of the kernel's span;
- for CTAs of the most common class, the time per item by the key tile's place in its document.

Variants: ``--orders default,-1`` runs each case in the default tile order and in index order
(``attn_debug(order_waves=...)``); a case name ``<case>+cuN`` pads cu_seqlens with leading zeros
to N entries (empty documents: the same mask, a deeper binary search for the key bounds).

Timings from a probe build are for comparison inside one run: the records add a few stores per CTA.

    NCP_CTA_CLOCK=1 python setup.py build_ext --inplace
    python benchmarks/probe_cta_clock.py [--cases flint-2k-w513,flint-8k-w513] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, env_record, make_attention_case, write_json  # noqa: E402

from bench_sink_attention import CASES  # noqa: E402

REC_WORDS = 8  # uint64 per CTA (sm90_bwd.cu)


def _reader():
    import nemo_cp_native as ncp

    lib = ctypes.CDLL(ncp._C.__file__)
    try:
        fn = lib.ncp_cta_clock_read
    except AttributeError:
        raise SystemExit("not a probe build: rebuild with NCP_CTA_CLOCK=1 (setup.py)") from None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def _read(fn, n_cta: int) -> list[list[int]]:
    buf = (ctypes.c_uint64 * (n_cta * REC_WORDS))()
    rc = fn(ctypes.cast(buf, ctypes.c_void_p), ctypes.sizeof(buf))
    if rc != 0:
        raise RuntimeError(f"ncp_cta_clock_read failed ({rc})")
    return [list(buf[i * REC_WORDS:(i + 1) * REC_WORDS]) for i in range(n_cta)]


def analyse(recs: list[list[int]], tiles_per_doc: int) -> dict:
    ctas = []
    for r in recs:
        if r[0] == 0 or r[1] == 0:
            continue
        meta = r[4]
        ctas.append({"start": r[0], "end": r[1], "kv_in": r[5], "loop_end": r[6], "sm": meta & 255,
                     "n_q": (meta >> 8) & 255, "n_it": (meta >> 16) & 65535, "kt": (meta >> 32) & 65535,
                     "stage_wait": r[2], "claim_spin": r[3], "free_wait": r[7]})
    t0, t1 = min(c["start"] for c in ctas), max(c["end"] for c in ctas)
    span = t1 - t0
    by_sm: dict[int, list[dict]] = {}
    for c in ctas:
        by_sm.setdefault(c["sm"], []).append(c)
    gaps, head, tail, overlap = [], [], [], 0
    for lst in by_sm.values():
        lst.sort(key=lambda c: c["start"])
        head.append(lst[0]["start"] - t0)
        tail.append(t1 - lst[-1]["end"])
        for a, b in zip(lst, lst[1:]):
            g = b["start"] - a["end"]
            overlap += g < 0
            gaps.append(g)
    busy = sum(c["end"] - c["start"] for c in ctas)
    n = len(ctas)
    xs = [c["n_it"] for c in ctas]
    ys = [c["end"] - c["start"] for c in ctas]
    mx, my = sum(xs) / n, sum(ys) / n
    vx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / vx if vx else float("nan")
    classes = {}
    for nq in sorted({c["n_q"] for c in ctas}):
        cs = [c for c in ctas if c["n_q"] == nq]
        first = [c for c in cs if c["start"] - t0 < span / 2]
        second = [c for c in cs if c["start"] - t0 >= span / 2]

        def per_item(group):
            return statistics.median((c["end"] - c["start"]) / max(c["n_it"], 1) for c in group) / 1e3 if group else None

        classes[nq] = {
            "ctas": len(cs),
            "items": cs[0]["n_it"],
            "cta_us": statistics.median(c["end"] - c["start"] for c in cs) / 1e3,
            "per_item_us": per_item(cs),
            "per_item_us_first_half": per_item(first),
            "per_item_us_second_half": per_item(second),
            "loop_per_item_us": statistics.median((c["loop_end"] - c["kv_in"]) / max(c["n_it"], 1) for c in cs) / 1e3,
            "ramp_us": statistics.median(c["kv_in"] - c["start"] for c in cs) / 1e3,
            "stage_wait_us_per_item": statistics.mean(c["stage_wait"] / max(c["n_it"], 1) for c in cs) / 1e3,
            "claim_spin_us_per_item": statistics.mean(c["claim_spin"] / max(c["n_it"], 1) for c in cs) / 1e3,
            "free_wait_us_per_item": statistics.mean(c["free_wait"] / max(c["n_it"], 1) for c in cs) / 1e3,
            "drain_us": statistics.median(c["end"] - c["loop_end"] for c in cs) / 1e3,
        }
    common = max(classes, key=lambda k: classes[k]["ctas"])
    by_pos: dict[int, list[float]] = {}
    for c in ctas:
        if c["n_q"] == common:
            by_pos.setdefault(c["kt"] % tiles_per_doc, []).append((c["end"] - c["start"]) / max(c["n_it"], 1) / 1e3)
    if len(by_pos) > 16:  # long documents: the first and last 8 places
        keep = sorted(by_pos)[:8] + sorted(by_pos)[-8:]
        by_pos = {k: by_pos[k] for k in keep}
    return {
        "per_item_us_by_place": {k: round(statistics.median(v), 3) for k, v in sorted(by_pos.items())},
        "ctas": n, "sms": len(by_sm), "items": sum(xs),
        "span_us": span / 1e3,
        "busy_share": busy / (len(by_sm) * span),
        "gap_us_mean": statistics.mean(gaps) / 1e3 if gaps else 0.0,
        "gap_us_median": statistics.median(gaps) / 1e3 if gaps else 0.0,
        "gap_us_sum_per_sm": sum(gaps) / len(by_sm) / 1e3,
        "head_idle_us_mean": statistics.mean(head) / 1e3,
        "tail_idle_us_mean": statistics.mean(tail) / 1e3,
        "overlapping_ctas": overlap,
        "fit_fixed_us": (my - slope * mx) / 1e3,
        "fit_per_item_us": slope / 1e3,
        "classes": classes,
    }


def run_case(name: str, rounds: int, read, order: str) -> dict:
    import contextlib

    import nemo_cp_native as ncp
    from nemo_cp_native.baselines import attention_flops
    from nemo_cp_native.testing import attn_debug

    base, _, pad = name.partition("+cu")
    total, doc_len, hq, hkv, d, window = CASES[base]
    lengths = doc_lengths(total, f"equal:{doc_len}")
    c = make_attention_case(lengths, hq, hkv, d, device="cuda", generator=torch.Generator().manual_seed(0))
    cu = c["cu_seqlens"]
    if pad:
        n_pad = int(pad) - cu.numel()
        if n_pad < 0:
            raise SystemExit(f"{name}: cu_seqlens has {cu.numel()} entries already")
        cu = torch.cat([torch.zeros(n_pad, dtype=cu.dtype, device=cu.device), cu])
    ctx = contextlib.nullcontext() if order == "default" else attn_debug(order_waves=int(order))

    leaves = [t.detach().requires_grad_() for t in (c["q"], c["k"], c["v"], c["sink"])]
    dout = torch.randn_like(c["q"])
    n_cta = hkv * ((total + 127) // 128)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out_rounds = []
    with ctx:
        for r in range(rounds + 2):
            out = ncp.sink_attention(*leaves, cu, window=window, validate=False)
            flush.zero_()
            torch.cuda.synchronize()
            read(n_cta)  # clears the records of earlier launches
            out.backward(dout)
            torch.cuda.synchronize()
            recs = read(n_cta)
            for t in leaves:
                t.grad = None
            if r >= 2:  # two warm-up rounds
                out_rounds.append(analyse(recs, max(1, doc_len // 128)))
    best = sorted(out_rounds, key=lambda a: a["span_us"])[len(out_rounds) // 2]  # the median round by span
    return {"case": name, "order": order, "flops_fwd": attention_flops(lengths, window, hq, d), "median_round": best,
            "spans_us": [round(a["span_us"], 1) for a in out_rounds]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="flint-2k-w513,flint-8k-w513")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--orders", default="default", help="tile orders: default and/or order_waves values (-1: index)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (Hopper, sm_90a probe build)")
    fn = _reader()
    read = lambda n: _read(fn, n)  # noqa: E731
    results = []
    for name, order in [(n, o) for n in args.cases.split(",") for o in args.orders.split(",")]:
        res = run_case(name, args.rounds, read, order)
        results.append(res)
        a = res["median_round"]
        print(f"\n== {name} (order {order}): dK/dV span {a['span_us']:.1f} us (rounds {res['spans_us']}), {a['ctas']} CTAs on "
              f"{a['sms']} SMs, {a['items']} items; busy {100 * a['busy_share']:.1f}%; per SM: gaps "
              f"{a['gap_us_sum_per_sm']:.1f} us (median gap {a['gap_us_median']:.2f}), idle before first "
              f"{a['head_idle_us_mean']:.1f}, after last {a['tail_idle_us_mean']:.1f}; overlapping {a['overlapping_ctas']}")
        print(f"   fit: CTA us = {a['fit_fixed_us']:.2f} + {a['fit_per_item_us']:.3f} x items")
        print("   n_q  ctas items  cta_us  us/item  (1st half / 2nd half)  loop us/item  ramp_us  drain_us"
              "  per item: stage wait, claim spin, TMA free wait (us)")
        for nq, k in a["classes"].items():
            f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            print(f"   {nq:3d} {k['ctas']:5d} {k['items']:5d} {k['cta_us']:7.1f} {k['per_item_us']:8.3f}  "
                  f"({f(k['per_item_us_first_half'])} / {f(k['per_item_us_second_half'])})  "
                  f"{k['loop_per_item_us']:8.3f}  {k['ramp_us']:7.2f} {k['drain_us']:8.2f}  "
                  f"{k['stage_wait_us_per_item']:.3f} {k['claim_spin_us_per_item']:.3f} {k['free_wait_us_per_item']:.3f}")
        print("   us/item by the key tile's place in its document (most common class):",
              " ".join(f"{p}:{v}" for p, v in a["per_item_us_by_place"].items()))
    write_json(args.json, {"env": env_record(), "results": results})


if __name__ == "__main__":
    main()
