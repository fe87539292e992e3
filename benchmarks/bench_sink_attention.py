"""Learned-sink attention on the GPU: nemo_cp_native vs FlexAttention(+sink correction) vs SDPA.

FLOPs: 4 x exact visible (query, key) pairs x Hq x D forward; backward 2.5x (fwd+bwd = 3.5x).
FlexAttention is compiled, runs the same document/window mask as a block mask, returns its LSE,
and applies the sink as ``out * sigmoid(lse - sink)`` (what Automodel's flex path does). SDPA has
no sink; it applies where the mask is plain causal per equal-length document (batched).
Every implementation is checked against ours (and ours against the float64 oracle on a slice)
before timing.

    python benchmarks/bench_sink_attention.py [--quick] [--json out.json] [--cases a,b] [--no-flex]
        [--impls ncp,ncp-nosink,...] [--interleave] [--queued] [--reps N] [--heat S]

--queued queues a GPU spin before each timed call (common.queue_gap), so the host's work for the
call (checks, allocations, launches) overlaps it and the events time the GPU work alone, as in a
training step that keeps the queue full. Without it the GPU is idle at the start event and the
host's work counts. With --queued the first row's forward is also timed the other way, for the
difference, and that time goes into the note ("idle-GPU fwd").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_record, print_table, queue_gap, time_cuda, write_json  # noqa: E402

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native.testing import attention_flops, doc_lengths, make_attention_case  # noqa: E402

# name: (total tokens, doc length, Hq, Hkv, D, window)
CASES = {
    "flint-2k-w513": (65536, 2048, 32, 4, 128, 513),
    "flint-8k-w513": (65536, 8192, 32, 4, 128, 513),
    "flint-32k-w513": (131072, 32768, 32, 4, 128, 513),
    "flint-2k-causal": (65536, 2048, 32, 4, 128, 0),
    "flint-8k-causal": (65536, 8192, 32, 4, 128, 0),
    "flint-32k-causal": (131072, 32768, 32, 4, 128, 0),
    "gptoss-8k-w128": (65536, 8192, 64, 8, 64, 128),
    "hq32kv8-8k-w128": (65536, 8192, 32, 8, 128, 128),
}
QUICK = {"quick-causal": (8192, 2048, 8, 2, 128, 0), "quick-w128": (8192, 2048, 8, 2, 64, 128)}


def _flex_runner(lengths, window, hq):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # A fresh compile per case: after dynamo's recompile limit (8 per code object) flex_attention
    # would fall back to eager, which materializes the T x T scores and runs out of memory.
    torch._dynamo.reset()
    T = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))

    def mask_mod(b, h, q_idx, kv_idx):
        m = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
        if window > 0:
            m = m & (q_idx - kv_idx < window)
        return m

    if T <= 65536:  # the eager builder materializes the T x T mask: fine up to 64k tokens
        block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda")
    else:  # compiled builder (avoids the T x T mask; on torch 2.11 it still fails for some masks)
        block_mask = create_block_mask(mask_mod, None, None, T, T, device="cuda", _compile=True)
    flex = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, sink):  # q [1, Hq, T, D]
        out, lse = flex(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
        return out * torch.sigmoid(lse - sink[None, :, None]).unsqueeze(-1).to(out.dtype)

    return run


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


def _time_once(fn, queued: bool = False) -> float:
    """Milliseconds of one call of fn on the current stream (CUDA events); queued: after a GPU spin
    (see the module docstring)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        queue_gap()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _to_bhtd(t):
    return t.detach().transpose(0, 1).unsqueeze(0).contiguous()


def _heat(seconds: float, fn) -> None:
    """Runs fn for about `seconds` so every implementation is timed in the same (hot, power- and
    clock-settled) GPU state; without it the first rows of a case run on a cool GPU."""
    if seconds <= 0:
        return
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        torch.cuda.synchronize()


def bench_case(name, spec, *, flex: bool, reps: int, heat: float = 0.0, only: frozenset = frozenset(),
               interleave: bool = False, queued: bool = False) -> list[dict]:  # fmt: skip
    total, doc_len, hq, hkv, d, window = spec
    lengths = doc_lengths(total, f"equal:{doc_len}")
    g = torch.Generator().manual_seed(1234)
    c = make_attention_case(lengths, hq, hkv, d, dtype=torch.bfloat16, device="cuda", generator=g)
    q, k, v, sink, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    fwd_flops = attention_flops(lengths, window, hq, d)
    qtag = "; queued" if queued else ""  # appended to every row's note
    rows = []

    def record(impl, fwd_ms, fb_ms, note=""):
        rows.append({
            "case": name, "impl": impl, "tokens": total, "doc": doc_len, "heads": f"{hq}/{hkv}", "D": d,
            "window": window, "fwd_ms": round(fwd_ms, 3), "fwd_tflops": round(fwd_flops / fwd_ms / 1e9, 1),
            "fwdbwd_ms": round(fb_ms, 3) if fb_ms else None,
            "fwdbwd_tflops": round(3.5 * fwd_flops / fb_ms / 1e9, 1) if fb_ms else None, "note": note,
        })  # fmt: skip

    # ---- ours (with and without sink) ---------------------------------------------------
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sink)]
    from nemo_cp_native._ops import _C

    kernel = {4: "sm90 fwd"}.get(_C.sink_attn_fwd_variant(), f"mma.sync fwd v{_C.sink_attn_fwd_variant()}")
    kernel += {4: " + sm90 bwd (atomic dQ)"}.get(_C.sink_attn_bwd_variant(), " + mma.sync bwd")
    ref_out = ncp.sink_attention(q, k, v, sink, cu, window=window)
    impls = [("ncp", leaves[3], {}, kernel), ("ncp-nosink", None, {}, kernel)]
    if _C.sink_attn_fwd_variant() == 4:  # the other forward kernels on the same card, for comparison
        impls.append(("ncp-fwd-serial", leaves[3], {"NCP_SM90_FWD_SCHED": "serial"}, "sm90 fwd, serial schedule"))
        impls.append(("ncp-fwd-pingpong", leaves[3], {"NCP_SM90_FWD_SCHED": "pingpong"}, "sm90 fwd, ping-pong schedule"))
        impls.append(("ncp-fwd-persistent", leaves[3], {"NCP_SM90_FWD_PERSIST": "1"}, "sm90 fwd, persistent grid"))
        impls.append(("ncp-fwd-per-item", leaves[3], {"NCP_SM90_FWD_PERSIST": "0"}, "sm90 fwd, one CTA per work item"))
        impls.append(("ncp-fwd-3stages", leaves[3], {"NCP_SM90_FWD_STAGES": "3"}, "sm90 fwd, 3-stage K/V ring"))
        impls.append(("ncp-fwd-nofold", leaves[3], {"NCP_SM90_FWD_FOLD": "0"}, "sm90 fwd, scale not folded into exp"))
        impls.append(("ncp-fwd-eager-rescale", leaves[3], {"NCP_SM90_FWD_LAZY": "0"},
                      "sm90 fwd, O rescaled on every tile"))
        impls.append(("ncp-fwd-late-store", leaves[3], {"NCP_SM90_FWD_EAGER_STORE": "0"},
                      "sm90 fwd, O's TMA store issued only when its Q buffer is needed again"))
        impls.append(("ncp-fwd-thread-store", leaves[3], {"NCP_SM90_FWD_OSTORE": "0"},
                      "sm90 fwd, O copied out by the consumer threads (no TMA store)"))
        impls.append(("ncp-fwd-nohalf", leaves[3], {"NCP_SM90_FWD_HALF": "0"},
                      "sm90 fwd, every warpgroup computes whole edge tiles (no half tiles)"))
        impls.append(("ncp-fwd-early", leaves[3], {"NCP_SM90_FWD_EARLY": "1"},
                      "sm90 fwd, next item's S(0) with the last P V when its Q and K are loaded"))
    if _C.sink_attn_bwd_variant() == 4:
        impls.append(("ncp-sm90-dq-red", leaves[3], {"NCP_SM90_DQ": "red"}, "sm90 atomic-dQ bwd, per-thread reductions"))
        impls.append(("ncp-deterministic", leaves[3], {"NCP_DETERMINISTIC": "1"}, "sm90 deterministic bwd (dQ kernel)"))
        impls.append(("ncp-sm90-bwd-overlap", leaves[3], {"NCP_SM90_BWD_OVERLAP": "1", "NCP_DETERMINISTIC": "1"},
                      "sm90 deterministic dK/dV with MMA overlap"))
    if _C.sink_attn_fwd_variant() == 4:
        impls.append(("ncp-portable", leaves[3], {"NCP_FWD_VARIANT": "3", "NCP_BWD_VARIANT": "1"}, "mma.sync fwd+bwd"))
    if only:  # --impls: keep the named rows
        impls = [row for row in impls if row[0] in only]
    runs = []
    for impl, s, env, note in impls:

        def fwd(s=s):
            with torch.no_grad():
                return ncp.sink_attention(leaves[0], leaves[1], leaves[2], s, cu, window=window, validate=False)

        def fwdbwd(s=s):
            out = ncp.sink_attention(leaves[0], leaves[1], leaves[2], s, cu, window=window, validate=False)
            out.backward(dout)

        if env:  # same answer as the default kernel before timing
            with _env(env):
                note += f"; max|x-ncp|={(fwd().float() - ref_out.float()).abs().max().item():.3g}"
        runs.append((impl, env, note, fwd, fwdbwd))
    if interleave and runs:
        # Round robin: call i of every implementation runs back to back, so drifts of clock and
        # power state fall on all of them alike, and round r starts at implementation r (no row
        # always follows the same one); medians over the rounds.
        with _env(runs[0][1]):
            _heat(heat, runs[0][4])
        times = {impl: ([], []) for impl, *_ in runs}
        for which, n in ((0, reps), (1, max(3, reps // 2))):
            for r in range(n + 2):  # 2 warm-up rounds
                for impl, env, _note, *fns in runs[r % len(runs) :] + runs[: r % len(runs)]:
                    with _env(env):
                        ms = _time_once(fns[which], queued)
                    if r >= 2:
                        times[impl][which].append(ms)
        if queued:  # the first row's forward on an idle GPU too: the host's share of a call
            with _env(runs[0][1]):
                cold = time_cuda(runs[0][3], reps=reps)
            runs[0] = (runs[0][0], runs[0][1], runs[0][2] + f"; idle-GPU fwd {cold:.3f} ms") + runs[0][3:]
        for impl, _env_, note, *_ in runs:
            f, b = times[impl]
            record(impl, statistics.median(f), statistics.median(b),
                   note + f"; interleaved x{len(f)}" + qtag)  # fmt: skip
    else:
        for impl, env, note, fwd, fwdbwd in runs:
            with _env(env):
                _heat(heat, fwdbwd)
                record(impl, time_cuda(fwd, reps=reps, queued=queued),
                       time_cuda(fwdbwd, reps=max(3, reps // 2), queued=queued), note + qtag)

    # ---- FlexAttention + sink correction -------------------------------------------------
    if flex and (not only or "flex+sink" in only):
        try:
            run = _flex_runner(lengths, window, hq)
            fq, fk, fv = (_to_bhtd(t).requires_grad_() for t in (q, k, v))
            fs = sink.detach().clone().requires_grad_()
            got = run(fq, fk, fv, fs)[0].transpose(0, 1)
            err = (got.float() - ref_out.float()).abs().max().item()
            fdout = _to_bhtd(dout)

            def ffwd():
                with torch.no_grad():
                    return run(fq, fk, fv, fs)

            def ffb():
                run(fq, fk, fv, fs).backward(fdout)

            _heat(heat, ffb)

            record("flex+sink", time_cuda(ffwd, reps=reps, queued=queued),
                   time_cuda(ffb, reps=max(3, reps // 2), queued=queued),
                   f"max|flex-ncp|={err:.3g}" + qtag)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            rows.append({"case": name, "impl": "flex+sink", "note": f"failed: {type(exc).__name__}: {exc}"[:200]})

    # ---- SDPA (no sink), equal documents as a batch --------------------------------------
    if window == 0 and total % doc_len == 0 and (not only or "sdpa" in only or "sdpa(no sink)" in only):
        B = total // doc_len
        sq, sk, sv = (t.detach().reshape(B, doc_len, t.shape[1], d).transpose(1, 2).contiguous().requires_grad_()
                      for t in (q, k, v))  # fmt: skip
        sdout = dout.reshape(B, doc_len, hq, d).transpose(1, 2).contiguous()

        def sfwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True)

        def sfb():
            F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True).backward(sdout)

        try:
            _heat(heat, sfb)
            record("sdpa(no sink)", time_cuda(sfwd, reps=reps, queued=queued),
                   time_cuda(sfb, reps=max(3, reps // 2), queued=queued), qtag[2:])
        except Exception as exc:  # noqa: BLE001
            rows.append({"case": name, "impl": "sdpa(no sink)", "note": f"failed: {exc}"[:200]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke)")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--heat", type=float, default=0.0, help="seconds of fwd+bwd before timing each implementation")
    ap.add_argument("--impls", default="", help="comma list of implementation rows (default: all; sdpa for sdpa(no sink))")
    ap.add_argument("--interleave", action="store_true",
                    help="time our implementations round robin (one call each per round), medians over rounds")
    ap.add_argument("--queued", action="store_true",
                    help="queue a GPU spin before each timed call so the host's launch work is not timed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not ncp.has_cuda():
        print("bench_sink_attention: needs a GPU and a CUDA build; skipping")
        return 0
    cases = QUICK if args.quick else CASES
    if args.cases:
        cases = {k: v for k, v in {**CASES, **QUICK}.items() if k in args.cases.split(",")}
    rows = []
    env = env_record()
    for name, spec in cases.items():
        only = frozenset(args.impls.split(",")) if args.impls else frozenset()
        new = bench_case(name, spec, flex=not args.no_flex, reps=args.reps, heat=args.heat, only=only,
                         interleave=args.interleave, queued=args.queued)  # fmt: skip
        rows += new
        print_table(new, ["case", "impl", "fwd_ms", "fwd_tflops", "fwdbwd_ms", "fwdbwd_tflops", "note"])
        sys.stdout.flush()
        write_json(args.json, {"env": env, "rows": rows})  # after every case: a cut-off run keeps its results
    print()
    print_table(rows, ["case", "impl", "window", "fwd_tflops", "fwdbwd_tflops", "fwd_ms", "fwdbwd_ms", "note"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
