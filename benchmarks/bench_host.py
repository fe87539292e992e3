"""Host time per call of the hot paths, measured with the GPU kept busy (issue 16).

A long GPU spin is queued first (``torch.cuda._sleep``), then the call is timed on the host clock:
its host work overlaps the spin, so the figure is what the host spends (argument checks,
allocations, DLPack, launches), not GPU time; a call that synced would wait for the spin and show
it. Median over repetitions. Rows: ``ncp.sink_attention`` forward (no grad) and backward
(``out.backward``), Flint 32/4/128 at 64k tokens with 8k documents, window 0 and 513, next to
SDPA's forward and backward; ``FlintMagiPlan.attention`` at cp = 1 (window 513: its checks, the
plan's table mask, the same kernels); the native calls alone (``attn_forward`` / ``attn_backward``, no
autograd: the op's own host cost; and once more by DLPack capsules, the path of a torch without
the C exchange API) and a no-op autograd node over the same four leaves (the
engine's cost around any op: the floor of an autograd backward on this host); the sync count of
each call (``torch.cuda.set_sync_debug_mode``); and the op captured in CUDA graphs, a forward graph and
a forward+backward graph, each replay timed as a call (no autograd engine at replay); and the backward as a step pays it:
``--step-ops`` ops, each on leaves of its own, taken back by one ``torch.autograd.backward``, so the
engine's fixed cost per ``backward()`` is paid once and each op's own cost is the marginal
``(T(ops) - T(1)) / (ops - 1)`` (issue 16's 40 µs bar applies to it: a training step makes one
backward call for all its layers).

Two methods, both on the host clock behind a queued spin:
- **one call**: one call per spin, then a device sync: the host starts each call from idle (cold
  caches, a core that may have slept), so it reads high on a slow or shared host;
- **stream**: ``--stream`` calls back to back behind one long spin, total / count: the host cost per
  call of a training loop whose host runs ahead of the GPU (the figure that decides whether the
  GPU waits for the host). Backward: as many graphs built beforehand, then their ``backward`` calls.

    python benchmarks/bench_host.py [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_record, host_us_stream, print_table, write_json  # noqa: E402

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import attention as A  # noqa: E402
from nemo_cp_native.attention import AttnMask, attn_backward, attn_forward  # noqa: E402
from nemo_cp_native.testing import count_syncs, doc_lengths, make_attention_case  # noqa: E402


class _NoOp(torch.autograd.Function):
    """An autograd node that does no work: out = a fresh tensor shaped like q, gradients fresh
    tensors shaped like the inputs (the engine's and the allocator's cost, nothing else)."""

    @staticmethod
    def forward(ctx, q, k, v, sink):
        ctx.save_for_backward(k, v, sink)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, g):
        k, v, sink = ctx.saved_tensors
        return torch.empty_like(g), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sink)


def host_us(fn, reps: int = 50, spin: int = 20_000_000) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda._sleep(spin)  # ~10 ms of GPU work queued ahead of the call
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    return statistics.median(ts)


def backward_host_us(forward, dout, reps: int = 30, spin: int = 20_000_000) -> float:
    """Host time of ``out.backward(dout)`` with the GPU kept busy; each repetition's graph comes from
    ``forward()``, built outside the timed region. Median after 3 warm repetitions."""
    ts = []
    for _ in range(reps):
        out = forward()
        torch.cuda.synchronize()
        torch.cuda._sleep(spin)
        t0 = time.perf_counter_ns()
        out.backward(dout)
        ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    return statistics.median(ts[3:])


def step_row(op: str, make_leaves, call, dout, ops: int, reps: int = 15, spin: int = 200_000_000) -> dict:
    """The backward as a training step pays it: ``ops`` independent calls (each on its own leaves,
    as a model's layers are) taken back by ONE ``torch.autograd.backward``, with the GPU kept busy.
    The engine's fixed cost per ``backward()`` (its thread hand-offs: the no-op node's row above) is
    paid once a step; what each op adds is the marginal ``(T(ops) - T(1)) / (ops - 1)``."""
    leaves = [make_leaves() for _ in range(ops)]

    def timed(n: int) -> float:
        ts = []
        for _ in range(reps):
            outs = [call(*lv) for lv in leaves[:n]]
            torch.cuda.synchronize()
            torch.cuda._sleep(spin)
            t0 = time.perf_counter_ns()
            torch.autograd.backward(outs, [dout] * n)
            ts.append((time.perf_counter_ns() - t0) / 1e3)
            del outs
            torch.cuda.synchronize()
            for lv in leaves[:n]:
                for t in lv:
                    t.grad = None
        return statistics.median(ts[2:])

    t1, tn = timed(1), timed(ops)
    return {"op": op, "ops": ops, "one_op_us": round(t1, 1), "all_ops_us": round(tn, 1),
            "per_op_us": round((tn - t1) / (ops - 1), 1)}  # fmt: skip


def graph_row(op: str, fwd, graph, dout, n: int) -> dict:
    """A row of the table: ``fwd()`` timed as one call and in a stream of n, the backward of the
    output of ``graph()`` (built outside the timed region) likewise, and the syncs of each."""
    outs = [graph()]

    def bwd():  # for the sync count: one backward of a graph built beforehand
        outs.pop().backward(dout)

    return {"op": op, "fwd_host_us": round(host_us(fwd), 1), "bwd_host_us": round(backward_host_us(graph, dout), 1),
            "fwd_host_us_stream": round(host_us_stream(fwd, n), 1),
            "bwd_host_us_stream": round(host_us_stream(lambda out: out.backward(dout), n, reps=5,
                                                       prepare=lambda: [graph() for _ in range(n)]), 1),
            "fwd_syncs": count_syncs(fwd), "bwd_syncs": count_syncs(bwd)}  # fmt: skip


def graph_row_replay(q, k, v, s, cu, window: int, n: int) -> dict:
    """The same op captured in CUDA graphs (README "CUDA graphs"): a forward-only graph and a
    forward+backward graph (grads into the leaves' .grad), each replay timed like a call. The
    backward column holds the forward+backward replay: the whole step's attention for one
    cudaGraphLaunch, with no autograd engine at replay."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
    dout = torch.randn_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch asks
        for _ in range(2):
            ncp.sink_attention(*leaves, cu, window=window).backward(dout)
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    fwd_graph, step_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(fwd_graph):
        ncp.sink_attention(*(t.detach() for t in leaves), cu, window=window)
    with torch.cuda.graph(step_graph):
        ncp.sink_attention(*leaves, cu, window=window).backward(dout)
    return {"op": f"sink_attention w{window}, CUDA graph replay: forward / forward+backward",
            "fwd_host_us": round(host_us(fwd_graph.replay), 1), "bwd_host_us": round(host_us(step_graph.replay), 1),
            "fwd_host_us_stream": round(host_us_stream(fwd_graph.replay, n), 1),
            "bwd_host_us_stream": round(host_us_stream(step_graph.replay, n), 1),
            "fwd_syncs": count_syncs(fwd_graph.replay), "bwd_syncs": count_syncs(step_graph.replay)}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--stream", type=int, default=8, help="calls per spin of the stream method")
    ap.add_argument("--step-ops", type=int, default=8, help="ops in the one backward of the step method")
    args = ap.parse_args(argv)
    n = args.stream
    T, hq, hkv, d = 65536, 32, 4, 128
    c = make_attention_case(doc_lengths(T, "equal:8192"), hq, hkv, d, device="cuda", requires_grad=True)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    rows = []
    for w in (0, 513):
        def fwd():
            with torch.no_grad():
                ncp.sink_attention(q, k, v, s, cu, window=w)

        rows.append(graph_row(f"sink_attention w{w}", fwd, lambda: ncp.sink_attention(q, k, v, s, cu, window=w),
                              torch.randn_like(q), n))  # fmt: skip
    # The Flint step at cp = 1 (FlintMagiPlan.attention: its checks, the plan's table mask, the same
    # kernels; at cp > 1 the all-to-all adds its own host cost)
    from types import SimpleNamespace

    from nemo_cp_native import flint

    cfg = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, sliding_window=513)
    plan = flint._build_magi_plan(cu.cpu(), cfg, None)
    assert plan.keys[513].num_local_tokens == T

    def plan_fwd():
        with torch.no_grad():
            plan.attention(q, k, v, s, 513, d**-0.5)

    plan.attention(q, k, v, s, 513, d**-0.5)  # the plan's tables written on the GPU once, outside the timing
    rows.append(graph_row("FlintMagiPlan.attention w513, cp = 1", plan_fwd,
                          lambda: plan.attention(q, k, v, s, 513, d**-0.5), torch.randn_like(q), n))  # fmt: skip
    qs, ks, vs = (t.detach().transpose(0, 1).unsqueeze(0) for t in (q[:8192], k[:8192].repeat_interleave(8, 1),
                                                                     v[:8192].repeat_interleave(8, 1)))  # fmt: skip

    def sdpa():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    # SDPA's backward through the same autograd engine
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (qs, ks, vs))
    rows.append(graph_row("SDPA causal (8k, no sink)", sdpa,
                          lambda: torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True),
                          torch.randn_like(qs), n))  # fmt: skip
    # What the op itself costs and what the engine costs around any op, with the same tensors:
    # the native calls alone (attn_forward / attn_backward: allocations, DLPack, the C call), and a
    # no-op autograd node over the same four leaves (the engine, its graph and the leaves' grad
    # accumulation: the floor of any autograd op's backward on this host).
    mask = AttnMask(cu_seqlens=cu, window=513)
    scale = d**-0.5
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = attn_forward(qd, kd, vd, s.detach(), mask, scale)
    dout = torch.randn_like(q)

    def native_fwd():
        attn_forward(qd, kd, vd, s.detach(), mask, scale)

    def native_bwd():
        attn_backward(dout, qd, kd, vd, s.detach(), out, lse, mask, scale)

    rows.append({"op": "sink_attention w513, native calls alone", "fwd_host_us": round(host_us(native_fwd), 1),
                 "bwd_host_us": round(host_us(native_bwd, reps=30), 1),
                 "fwd_host_us_stream": round(host_us_stream(native_fwd, n), 1),
                 "bwd_host_us_stream": round(host_us_stream(native_bwd, n, reps=5), 1),
                 "fwd_syncs": count_syncs(native_fwd), "bwd_syncs": count_syncs(native_bwd)})  # fmt: skip

    if A._X:  # the same calls by DLPack capsules (torch without the C exchange API; the path before it)
        A._X = False
        try:
            rows.append({"op": "sink_attention w513, native calls alone, by capsules",
                         "fwd_host_us": round(host_us(native_fwd), 1), "bwd_host_us": round(host_us(native_bwd, reps=30), 1),
                         "fwd_host_us_stream": round(host_us_stream(native_fwd, n), 1),
                         "bwd_host_us_stream": round(host_us_stream(native_bwd, n, reps=5), 1),
                         "fwd_syncs": count_syncs(native_fwd), "bwd_syncs": count_syncs(native_bwd)})  # fmt: skip
        finally:
            A._X = True
    rows.append(graph_row_replay(q, k, v, s, cu, 513, n))
    noop = lambda: _NoOp.apply(q, k, v, s)  # noqa: E731
    rows.append(graph_row("autograd floor: no-op node, same leaves", noop, noop, dout, n))
    print_table(rows, list(rows[0]))
    # The backward in a step: L ops of one backward() (own leaves each), marginal host cost per op.
    L = args.step_ops

    def own(*ts):  # leaves of their own (no accumulation between ops), no copies of the data
        return lambda: tuple(t.detach().requires_grad_() for t in ts)

    step = [step_row(f"sink_attention w{w}", own(q, k, v, s), lambda *lv, w=w: ncp.sink_attention(*lv, cu, window=w),
                     dout, L) for w in (0, 513)]  # fmt: skip
    step.append(step_row("FlintMagiPlan.attention w513, cp = 1", own(q, k, v, s),
                         lambda *lv: plan.attention(*lv, 513, d**-0.5), dout, L))  # fmt: skip
    step.append(step_row("SDPA causal (8k, no sink)", own(qs, ks, vs),
                         lambda *lv: torch.nn.functional.scaled_dot_product_attention(*lv, is_causal=True),
                         torch.randn_like(qs), L))  # fmt: skip
    step.append(step_row("autograd floor: no-op node", own(q, k, v, s), _NoOp.apply, dout, L))
    print_table(step, list(step[0]))
    write_json(args.json, {"env": env_record(), "method": "queued 20M-cycle spin, host clock, median",
                          "method_stream": f"{n} calls back to back behind one 200M-cycle spin, per call, median",
                          "method_step": f"{L} ops (own leaves each) in one torch.autograd.backward behind a "
                                         "200M-cycle spin, host clock, median; per op = (T(ops) - T(1)) / (ops - 1)",
                          "bar_us": 40, "rows": rows, "step_rows": step})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
