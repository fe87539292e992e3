"""The parts of ``python -m nemo_cp_native demo``: each replaced piece checked against its oracle,
then timed against what a user would run instead.

- MiMo THD sharder: exact parity with the reference path (our Python TE oracle); timed against the
  framework's own torch ops with a native TE-style partition (``baselines.mimo_reference_fast_te``),
  wall clock with a device sync, median.
- Learned-sink attention: the forward against the float64 oracle (tolerance rule). On a GPU,
  timed against FlexAttention with the LSE sink correction and, on causal documents, SDPA (no
  sink), forward and forward+backward, with ``baselines.time_gpu`` (L2 flushed, CUDA events,
  median; default arguments): the timing of ``benchmarks/bench_sink_attention.py``. On the CPU,
  against the pure-PyTorch reference.
- Flint Magi CP: the C plan against the Python MinHeap solver, and cp = 4 simulated ranks forward
  and backward against the whole-sequence oracle.

Each part returns ``(checks, timings)``: ``Check(name, ok, detail)`` and ``Timing(case, ours_ms,
baseline, base_ms, flops)``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from types import SimpleNamespace

import torch

import nemo_cp_native as ncp

from . import baselines as bl

@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclasses.dataclass
class Timing:
    case: str
    ours_ms: float
    baseline: str
    base_ms: float
    flops: float | None = None  # work of one call, for TFLOP/s


def wall_ms(fn, reps: int = 5, cuda: bool = False, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of ``fn()`` (with a device sync after each call on CUDA)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _same_batch(got: dict, want: dict) -> bool:
    """Same keys in the same order, same dtypes, equal values (tensors compared on the CPU)."""
    if list(got) != list(want):
        return False
    for key in got:
        a, b = got[key], want[key]
        if isinstance(a, torch.Tensor):
            if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())):
                return False
        elif a != b:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# MiMo THD sharder
# ---------------------------------------------------------------------------------------------


def mimo(dev: torch.device, quick: bool):
    from .reference import mimo as ref

    from .testing import fake_mesh, make_mimo_batch
    cuda = dev.type == "cuda"
    B, S, C, cp = (4, 2048, 2, 4) if quick else (8, 32768 if cuda else 8192, 4, 8)
    g = torch.Generator().manual_seed(0)
    batch = make_mimo_batch(B, S, num_chunks=C, cp_size=cp, docs_per_row=(16, 64), device=dev, image_token_id=7,
                            video_token_id=8, generator=g)  # fmt: skip
    checks, timings = [], []
    with fake_mesh(cp, cp - 1) as mesh:
        for chunks in (1, C):
            kw = dict(num_chunks=chunks, image_token_id=7, video_token_id=8)
            case = f"MiMo shard B={B} S={S} cp={cp} chunks={chunks}"
            _, got, _ = ncp.mimo.shard_batch_for_mimo_te(mesh, None, batch, **kw)
            path = ncp.mimo.fast_path_info()["path"]
            _, want, _ = ref.shard_batch_for_mimo_te(mesh, None, batch, **kw)  # the oracle: Python TE loop
            with bl.mimo_reference_fast_te() as fast:
                _, base, _ = fast.shard_batch_for_mimo_te(mesh, None, batch, **kw)
                base_ms = wall_ms(lambda: fast.shard_batch_for_mimo_te(mesh, None, batch, **kw), reps=5, cuda=cuda)
            ok = _same_batch(got, want) and _same_batch(base, want)
            checks.append(Check(case, ok, f"exact: every key, dtype and value equals the reference path ({path} path)"))
            ours_ms = wall_ms(lambda: ncp.mimo.shard_batch_for_mimo_te(mesh, None, batch, **kw), reps=20, cuda=cuda,
                              warmup=3)  # fmt: skip
            timings.append(Timing(case, ours_ms, "torch ops + native TE partition", base_ms))
    return checks, timings


# ---------------------------------------------------------------------------------------------
# Learned-sink attention
# ---------------------------------------------------------------------------------------------


def attention_parity(dev: torch.device, quick: bool):
    from .reference.sink_attention import attention_ref
    from .reference.tolerance import assert_close_to_ref

    from .testing import doc_lengths, make_attention_case
    checks = []
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    total, hq, hkv, d = (512, 4, 2, 64) if (quick or dev.type == "cpu") else (4096, 32, 4, 128)
    g = torch.Generator().manual_seed(1)
    for window in (0, 129):
        lengths = doc_lengths(total, "random", mean=total // 4, generator=g)
        c = make_attention_case(lengths, hq, hkv, d, dtype=dtype, device=dev, generator=g)
        args = [c["q"], c["k"], c["v"], c["sink"]]
        out = ncp.sink_attention(*args, c["cu_seqlens"], window=window)
        ref, _ = attention_ref(*(t.double() for t in args), c["cu_seqlens"], window=window)
        lp, _ = attention_ref(*args, c["cu_seqlens"], window=window, upcast=False)
        try:
            assert_close_to_ref(out, ref, lp, name="out")
            ok, detail = True, "forward within the tolerance rule of the float64 oracle"
        except AssertionError as exc:
            ok, detail = False, str(exc).splitlines()[0][:200]
        checks.append(Check(f"sink attention T={total} {hq}/{hkv}x{d} w={window} {str(dtype)[6:]}", ok, detail))
    return checks, []


def attention_speed_cpu(quick: bool):
    """Ours (the C path) against the pure-PyTorch reference in the kernel's precision."""
    from .reference.sink_attention import attention_ref

    from .testing import doc_lengths, make_attention_case
    g = torch.Generator().manual_seed(3)
    total, hq, hkv, d = (512, 4, 2, 64) if quick else (2048, 8, 2, 64)
    timings = []
    for window in (0, 129):
        lengths = doc_lengths(total, "equal:512")
        c = make_attention_case(lengths, hq, hkv, d, dtype=torch.float32, generator=g)
        args = [c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]]
        ours = wall_ms(lambda: ncp.sink_attention(*args, window=window), reps=3)
        base = wall_ms(lambda: attention_ref(*args, window=window, upcast=False), reps=3)
        timings.append(Timing(f"attention fwd T={total} {hq}/{hkv}x{d} 512-token docs w={window} fp32", ours,
                              "PyTorch reference (CPU)", base))  # fmt: skip
    return timings


def attention_speed_gpu(quick: bool, reps: int = 10, device="cuda", shape=None):
    """Ours against FlexAttention + sink and SDPA, bf16, Flint's 32/4/128, forward and
    forward+backward, default arguments, timed as the benchmark times them. ``shape``: (tokens,
    document length, Hq, Hkv, D) instead of the defaults."""
    from .testing import doc_lengths, make_attention_case
    total, doc, hq, hkv, d = shape or ((8192, 2048) if quick else (32768, 8192)) + (32, 4, 128)
    g = torch.Generator().manual_seed(4)
    checks, timings = [], []
    for window in (0, 513):
        lengths = doc_lengths(total, f"equal:{doc}")
        c = make_attention_case(lengths, hq, hkv, d, dtype=torch.bfloat16, device=device, generator=g)
        q, k, v, sink, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
        dout = torch.randn(q.shape, generator=g).to(device, torch.bfloat16)
        flops = bl.attention_flops(lengths, window, hq, d)
        docs = f"{doc // 1024}k" if doc % 1024 == 0 else str(doc)
        tag = f"T={total} {docs} docs " + ("causal" if window == 0 else f"w={window}")
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sink)]

        def ours_fwd():
            with torch.no_grad():
                return ncp.sink_attention(*leaves, cu, window=window)

        def ours_fb():
            ncp.sink_attention(*leaves, cu, window=window).backward(dout)

        ours = (bl.time_gpu(ours_fwd, reps=reps), bl.time_gpu(ours_fb, reps=reps, grad_to_none=leaves))
        ref = ours_fwd()
        base = {}
        run = bl.flex_sink_attention(lengths, window)
        fl = [bl.to_bhtd(t).requires_grad_() for t in (q, k, v)] + [sink.detach().clone().requires_grad_()]
        fdout = bl.to_bhtd(dout)
        err = (bl.from_bhtd(run(*fl)).float() - ref.float()).abs().max().item()
        checks.append(Check(f"FlexAttention+sink agrees with ours, {tag}", err < 0.1, f"max|flex - ours| = {err:.3g}"))

        def flex_fwd():
            with torch.no_grad():
                return run(*fl)

        base["FlexAttention + sink"] = (bl.time_gpu(flex_fwd, reps=reps),
                                        bl.time_gpu(lambda: run(*fl).backward(fdout), reps=reps, grad_to_none=fl))
        if window == 0:
            sd = [bl.to_documents(t, doc).requires_grad_() for t in (q, k, v)]
            sdout = bl.to_documents(dout, doc)

            def sdpa_fwd():
                with torch.no_grad():
                    return bl.sdpa_causal(*sd)

            base["SDPA (no sink)"] = (bl.time_gpu(sdpa_fwd, reps=reps),
                                      bl.time_gpu(lambda: bl.sdpa_causal(*sd).backward(sdout), reps=reps,
                                                  grad_to_none=sd))  # fmt: skip
        for which, mult in ((0, 1.0), (1, 3.5)):
            for name, ms in base.items():
                timings.append(Timing(f"attention {'fwd' if which == 0 else 'fwd+bwd'} {tag}", ours[which], name,
                                      ms[which], mult * flops))  # fmt: skip
    return checks, timings


# ---------------------------------------------------------------------------------------------
# Flint Magi CP
# ---------------------------------------------------------------------------------------------


def flint(dev: torch.device, quick: bool):
    from . import flint as fl
    from .reference import cp_attention as rcp
    from .reference import magi as rmagi

    from .testing import doc_lengths, make_attention_case
    from .testing import SimulatedGroup, pack_documents, simulate_cp_attention
    checks, timings = [], []
    cfg = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4, head_dim=128, sliding_window=513,
                          magi_chunk_size=512)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    cu = pack_documents(doc_lengths(32768 if quick else 131072, "random", mean=4096, generator=g))
    grp = SimulatedGroup(8, 0)
    case = f"Magi plan T={int(cu[-1])} cp=8"
    same = fl._build_magi_plan(cu, cfg, grp).keys[0].local_token_global_indices.equal(
        rmagi.dispatch(cu, 8, 512).local_token_global_indices(0))
    checks.append(Check(case, same, "exact: rank 0's tokens equal the Python MinHeap solver's"))
    timings.append(Timing(case, wall_ms(lambda: fl._build_magi_plan(cu, cfg, grp)), "Python MinHeap solver",
                          wall_ms(lambda: rmagi.dispatch(cu, 8, 512), reps=2)))  # fmt: skip
    # cp = 4 simulated ranks against the whole-sequence oracle
    small = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=65,
                            magi_chunk_size=64)  # fmt: skip
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    lengths = doc_lengths(4000 if cuda else 700, "random", mean=200, generator=g)
    c = make_attention_case(lengths, 4, 2, 64, dtype=dtype, device=dev, generator=g)
    cuh = c["cu_seqlens"].cpu()
    plans = [fl._build_magi_plan(cuh, small, SimulatedGroup(4, r)) for r in range(4)]
    dsp = rmagi.dispatch(cuh, 4, 64)
    for window in (0, 65):
        dout = torch.randn(c["q"].shape, generator=g).to(dev, dtype)
        ref = rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cuh, dout, dsp, 4, window=window)
        loc = [[rcp.local_rows(t, dsp, r) for r in range(4)] for t in (c["q"], c["k"], c["v"], dout)]
        run = lambda: simulate_cp_attention(plans, loc[0], loc[1], loc[2], c["sink"], window, 0.125, loc[3])  # noqa: E731
        outs, grads = run()
        err = max(float((outs[r].double() - ref.ranks[r].out).abs().max()) for r in range(4))
        tol = 0.05 if dtype == torch.bfloat16 else 1e-4
        dsink = sum(gr[3].double() for gr in grads)
        ok = err < tol and float((dsink - ref.dsink).abs().max()) < tol * float(ref.dsink.abs().max() + 1)
        case = f"Flint CP cp=4 simulated fwd+bwd T={sum(lengths)} w={window}"
        checks.append(Check(case, ok, f"every rank's out and the summed dsink match the whole-sequence oracle "
                                      f"(max err {err:.2g})"))  # fmt: skip
        base = wall_ms(lambda: rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cuh, dout, dsp, 4,
                                                    window=window, upcast=False), reps=1, cuda=cuda)  # fmt: skip
        timings.append(Timing(case, wall_ms(run, reps=3, cuda=cuda), "PyTorch whole-sequence reference", base))
    return checks, timings
