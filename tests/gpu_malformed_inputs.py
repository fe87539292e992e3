"""The CUDA kernels on malformed inputs that pass validation or skip it, for compute-sanitizer.

    compute-sanitizer --tool memcheck --kernel-regex kns=ncp --error-exitcode 99 \\
        python tests/gpu_malformed_inputs.py            # on a GPU machine (issue 17); also
    python -m pytest -q -m cuda tests/test_gpu_malformed.py   # the same, run by pytest
    python tests/gpu_malformed_inputs.py --device cpu   # dry run of the script on the CPU

Every call goes through the public API: ``thd_partition_indices(..., validate=False)`` on garbage
boundaries (negative, decreasing, past the end, near the int32 limits), the MiMo sharder on odd but
accepted tables (sentinels, absorption, zero-length documents, int32 tokens, strided inputs),
``sink_attention(..., validate=False)`` with ``cu_seqlens`` that do not start at 0, decrease, end
before or after T or point far outside (also with the deterministic backward), non-finite
q/k/v/sink, and the Flint CP attention with NaN inputs. A call may raise (a clear error is fine);
what must not happen is an out-of-bounds access, which memcheck reports. Prints one line per group and "done" at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import flint, testing  # noqa: E402
from nemo_cp_native.testing import fake_mesh  # noqa: E402
from nemo_cp_native.testing import make_mimo_batch  # noqa: E402

I32_MAX = 2**31 - 1
outcomes = {"ok": 0, "raised": 0}


def attempt(fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize()
        outcomes["ok"] += 1
    except (ValueError, TypeError, NotImplementedError, RuntimeError):
        outcomes["raised"] += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # a launch error must not leak into the next call


def thd(dev):
    garbage = [[0, -8, 16], [0, 16, 8, 32], [16, 8], [0, 8], [-(2**31), 0, 8], [0, I32_MAX], [0, I32_MAX - 7, 8],
               [0, 0, 0, 8], [I32_MAX, I32_MAX], [5, 13, 2, 40, 40, 1]]  # fmt: skip
    for cu in garbage:
        for cp in (1, 2, 3, 4, 8):
            for total in (2 * cp, 16 * cp, 64 * cp):
                for rank in {0, cp - 1}:
                    t = torch.tensor(cu, dtype=torch.int32, device=dev)
                    attempt(ncp.thd_partition_indices, t, total, cp, rank, validate=False)
                    attempt(ncp.thd_partition_indices, torch.flip(t, (0,)), total, cp, rank, validate=False)


def mimo(dev):
    g = torch.Generator().manual_seed(1)
    for cp in (1, 2, 4):
        for chunks, B in ((1, 2), (2, 4)):
            for opts in (dict(absorption=True), dict(min_doc=True), dict(dtype=torch.int32, lens_dtype=torch.int32),
                         dict(docs_per_row=(1, 6))):  # fmt: skip
                batch = make_mimo_batch(B, 8 * cp, num_chunks=chunks, cp_size=cp, device=dev, generator=g,
                                        image_token_id=7, **opts)  # fmt: skip
                odd = dict(batch)
                odd["seq_lens"] = odd["seq_lens"].clone()
                odd["seq_lens"][0, 0] = 0  # an empty real document
                strided = {k: (v.repeat_interleave(2, dim=-1)[..., ::2] if isinstance(v, torch.Tensor) and v.ndim == 2
                               else v) for k, v in batch.items()}  # fmt: skip
                for b in (batch, odd, strided):
                    for rank in range(cp):
                        with fake_mesh(cp, rank) as mesh:
                            attempt(_shard, mesh, dict(b), chunks)


def _shard(mesh, batch, chunks):
    return ncp.mimo.shard_batch_for_mimo_te(mesh, None, batch, num_chunks=chunks, image_token_id=7, video_token_id=9)[1]


def attention(dev):
    g = torch.Generator().manual_seed(2)
    dtypes = (torch.bfloat16, torch.float16) if dev == "cuda" else (torch.float32,)
    for d in (64, 128):
        for dtype in dtypes:
            T, hq, hkv = 197, 4, 2
            q, k, v = (torch.randn(T, h, d, generator=g).to(dev, dtype) for h in (hq, hkv, hkv))
            sink = torch.randn(hq, generator=g).to(dev)
            bad_cu = [[5, 100, T], [0, 150, 40, T], [0, 100], [0, 100, T + 300], [0, -50, T], [0, I32_MAX],
                      [-(2**31), T], [0, 0, 0, T], [T, T]]  # fmt: skip
            for cu in bad_cu:
                for window in (0, 1, 70):
                    c = torch.tensor(cu, dtype=torch.int32, device=dev)
                    attempt(_fwd_bwd, q, k, v, sink, c, window)
                    attempt(_fwd_bwd, q, k, v, None, c, window)
                    if dev == "cuda" and dtype == torch.bfloat16 and window != 1:  # the deterministic backward too
                        with mock.patch.dict(os.environ, {"NCP_DETERMINISTIC": "1"}):
                            attempt(_fwd_bwd, q, k, v, sink, c, window)
            good = torch.tensor([0, 60, 61, T], dtype=torch.int32, device=dev)
            for poison in (float("nan"), float("inf"), -float("inf")):
                for which in range(4):
                    xs = [t.clone() for t in (q, k, v, sink)]
                    xs[which].view(-1)[7 % xs[which].numel()] = poison
                    attempt(_fwd_bwd, *xs, good, 0)


def _fwd_bwd(q, k, v, sink, cu, window):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (q, k, v, sink)]
    out = ncp.sink_attention(*leaves, cu, window=window, validate=False)
    out.backward(torch.ones_like(out))
    return out


def flint_cp(dev):
    g = torch.Generator().manual_seed(3)
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=33,
                          magi_chunk_size=16)  # fmt: skip
    cu = torch.tensor([0, 50, 51, 130, 200], dtype=torch.int32)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    for window in (0, 33):
        plans = [flint._build_magi_plan(cu, cfg, testing.SimulatedGroup(2, r)) for r in range(2)]
        L = plans[0].keys[0].num_local_tokens
        loc = [[torch.randn(L, h, 64, generator=g).to(dev, dtype) for _ in range(2)] for h in (4, 2, 2)]
        loc[0][1][3, 0, 0] = float("nan")
        sink = torch.randn(4, generator=g).to(dev)
        attempt(testing.simulate_cp_attention, plans, *loc, sink, window, 0.125, [torch.ones_like(x) for x in loc[0]])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("parts", nargs="*", default=["thd", "mimo", "attention", "flint"])
    args = ap.parse_args()
    parts = {"thd": thd, "mimo": mimo, "attention": attention, "flint": flint_cp}
    for name in args.parts:
        before = dict(outcomes)
        parts[name](args.device)
        print(f"{name}: {outcomes['ok'] - before['ok']} calls ran, {outcomes['raised'] - before['raised']} raised",
              flush=True)  # fmt: skip
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
