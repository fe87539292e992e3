"""``python -m nemo_cp_native {info,demo}``.

info: version, build (CUDA, archs, tile sizes), torch, GPU, whether nemo_automodel imports and is
      patched.
demo: the main job. Built-in synthetic packed batches, native against the reference for each
      replaced piece, with parity checks and timings, on the GPU when there is one:
        1. MiMo THD sharder: exact parity with the reference path, ms per call, host syncs.
        2. Learned-sink attention: forward/backward against the float64 oracle (tolerance rule).
        3. Flint Magi CP: plan build (C vs Python solver) and cp=4 simulated ranks against the
           whole-sequence oracle.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from types import SimpleNamespace

import torch

import nemo_cp_native as ncp
from nemo_cp_native import testing


def _ms(fn, reps=5, cuda=False):
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
    return sorted(ts)[len(ts) // 2]


def info() -> int:
    from . import _compat
    from .patch import is_patched

    b = ncp.build_info()
    print(f"nemo_cp_native {ncp.__version__}")
    print(f"  build: CUDA {'on' if b['cuda'] else 'off'}" + (f" (archs {b['cuda_archs']})" if b["cuda"] else ""))
    print("  ops: thd_partition, mimo_layout, mimo_shard, sink_attn_fwd, sink_attn_bwd, magi_dispatch, plan_build "
          f"(CPU{' + CUDA' if b['cuda'] else ''}); attention tiles fwd {b['fwd_bm']}x{b['fwd_bn']}, "
          f"bwd {b['bwd_bm']}x{b['bwd_bn']}")  # fmt: skip
    print(f"  torch {torch.__version__}, python {platform.python_version()}")
    if torch.cuda.is_available():
        print(f"  GPU: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
    else:
        print("  GPU: none")
    if _compat.HAVE_UPSTREAM:
        print(f"  nemo_automodel {_compat.upstream_version()}: importable, patched={is_patched()}")
    else:
        print("  nemo_automodel: not importable (patch() is a no-op; stand-in sharder classes in use)")
    return 0


def _demo_mimo(dev, quick):
    from .testing import fake_mesh
    from .reference import mimo as ref
    from .testing import make_mimo_batch

    B, S, C, cp = (4, 2048, 2, 4) if quick else (8, 8192 if dev.type == "cpu" else 32768, 4, 8)
    g = torch.Generator().manual_seed(0)
    batch = make_mimo_batch(B, S, num_chunks=C, cp_size=cp, docs_per_row=(16, 64), device=dev, image_token_id=7,
                            video_token_id=8, generator=g)  # fmt: skip
    rows = []
    with fake_mesh(cp, cp - 1) as mesh:
        for chunks in (1, C):
            kw = dict(num_chunks=chunks, image_token_id=7, video_token_id=8)
            _, got, _ = ncp.mimo.shard_batch_for_mimo_te(mesh, None, batch, **kw)
            path = ncp.mimo.fast_path_info()["path"]
            _, want, _ = ref.shard_batch_for_mimo_te(mesh, None, batch, **kw)
            same = list(got) == list(want) and all(
                (torch.equal(got[k].cpu(), want[k].cpu()) and got[k].dtype == want[k].dtype)
                if isinstance(got[k], torch.Tensor) else got[k] == want[k] for k in got)  # fmt: skip
            t_nat = _ms(lambda: ncp.mimo.shard_batch_for_mimo_te(mesh, None, batch, **kw), cuda=dev.type == "cuda")
            t_ref = _ms(lambda: ref.shard_batch_for_mimo_te(mesh, None, batch, **kw), reps=1, cuda=dev.type == "cuda")
            rows.append((f"MiMo shard B={B} S={S} cp={cp} chunks={chunks} ({path})", same, t_nat, t_ref))
    return rows


def _demo_attention(dev, quick):
    from .reference.sink_attention import attention_ref
    from .reference.tolerance import assert_close_to_ref
    from .testing import doc_lengths, make_attention_case

    rows = []
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
            ok = True
        except AssertionError as exc:
            print(exc)
            ok = False
        cuda = dev.type == "cuda"
        t_nat = _ms(lambda: ncp.sink_attention(*args, c["cu_seqlens"], window=window), cuda=cuda)
        t_ref = _ms(lambda: attention_ref(*args, c["cu_seqlens"], window=window, upcast=False), reps=2, cuda=cuda)
        rows.append((f"sink attention fwd T={total} {hq}/{hkv}x{d} w={window} {str(dtype)[6:]}", ok, t_nat, t_ref))
    return rows


def _demo_flint(dev, quick):
    from . import flint
    from .reference import cp_attention as rcp
    from .reference import magi as rmagi
    from .testing import doc_lengths, make_attention_case, pack_documents

    rows = []
    cfg = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4, head_dim=128, sliding_window=513,
                          magi_chunk_size=512)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    cu = pack_documents(doc_lengths(32768 if quick else 131072, "random", mean=4096, generator=g))
    grp = testing.SimulatedGroup(8, 0)
    same = flint._build_magi_plan(cu, cfg, grp).keys[0].local_token_global_indices.equal(
        rmagi.dispatch(cu, 8, 512).local_token_global_indices(0))
    rows.append((f"Magi plan T={int(cu[-1])} cp=8 (C plan vs Python solver)", same,
                 _ms(lambda: flint._build_magi_plan(cu, cfg, grp)), _ms(lambda: rmagi.dispatch(cu, 8, 512), reps=2)))  # fmt: skip
    # cp = 4 simulated ranks against the whole-sequence oracle
    small = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=65,
                            magi_chunk_size=64)  # fmt: skip
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lengths = doc_lengths(700 if dev.type == "cpu" else 4000, "random", mean=200, generator=g)
    c = make_attention_case(lengths, 4, 2, 64, dtype=dtype, device=dev, generator=g)
    cuh = c["cu_seqlens"].cpu()
    plans = [flint._build_magi_plan(cuh, small, testing.SimulatedGroup(4, r)) for r in range(4)]
    dsp = rmagi.dispatch(cuh, 4, 64)
    for window in (0, 65):
        dout = torch.randn(c["q"].shape, generator=g).to(dev, dtype)
        ref = rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cuh, dout, dsp, 4, window=window)
        loc = [[rcp.local_rows(t, dsp, r) for r in range(4)] for t in (c["q"], c["k"], c["v"], dout)]
        run = lambda: testing.simulate_cp_attention(plans, loc[0], loc[1], loc[2], c["sink"], window, 0.125, loc[3])  # noqa: E731
        outs, grads = run()
        err = max(float((outs[r].double() - ref.ranks[r].out).abs().max()) for r in range(4))
        tol = 0.05 if dtype == torch.bfloat16 else 1e-4
        dsink = sum(gr[3].double() for gr in grads)
        ok = err < tol and float((dsink - ref.dsink).abs().max()) < tol * float(ref.dsink.abs().max() + 1)
        t_ref = _ms(lambda: rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cuh, dout, dsp, 4, window=window,
                                                upcast=False), reps=1, cuda=dev.type == "cuda")  # fmt: skip
        rows.append((f"Flint CP cp=4 simulated fwd+bwd T={sum(lengths)} w={window} (max err {err:.2g})", ok,
                     _ms(run, reps=3, cuda=dev.type == "cuda"), t_ref))  # fmt: skip
    return rows


def demo(device: str, quick: bool) -> int:
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() and ncp.has_cuda() else
                       ("cpu" if device == "auto" else device))  # fmt: skip
    print(f"nemo_cp_native demo on {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else platform.machine()})")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for part in (_demo_mimo, _demo_attention, _demo_flint):
            rows += part(dev, quick)
    w = max(len(r[0]) for r in rows)
    print(f"\n{'case'.ljust(w)} | parity | native ms | reference ms | speedup")
    print(f"{'-' * w}-|--------|-----------|--------------|--------")
    for name, ok, t_nat, t_ref in rows:
        print(f"{name.ljust(w)} | {'ok' if ok else 'FAIL':6} | {t_nat:9.3f} | {t_ref:12.3f} | {t_ref / t_nat:6.1f}x")
    if dev.type == "cpu":
        print("\n(CPU: the attention and Flint rows run the C double-precision path, the CPU backend and second oracle;"
              "\n the speed of these ops is the CUDA kernels' business: run this on a GPU.)")  # fmt: skip
    bad = [r[0] for r in rows if not r[1]]
    print("\nall parity checks passed" if not bad else f"\nPARITY FAILED: {bad}")
    return 1 if bad else 0


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
