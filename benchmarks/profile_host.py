"""Where the host time of one ``sink_attention`` call goes (issue 16), on a GPU kept busy.

Times each step of the eager forward and backward on the host clock while a long GPU spin is
queued (so nothing waits for the GPU), then prints torch.profiler's host-side table for one
whole forward and one whole ``out.backward``. A profiling tool, not a benchmark of record.

    python benchmarks/profile_host.py [--window 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # benchmarks/ and the repository root
from bench_host import backward_host_us  # noqa: E402

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import attention as A  # noqa: E402
from nemo_cp_native._ops import _C, dl, dl_named, stream_of  # noqa: E402
from nemo_cp_native.testing import doc_lengths, make_attention_case  # noqa: E402


def under_spin(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda._sleep(20_000_000)
        t0 = time.perf_counter_ns()
        fn()
        ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    return round(statistics.median(ts), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=0)
    args = ap.parse_args()
    T, hq, hkv, d = 65536, 32, 4, 128
    c = make_attention_case(doc_lengths(T, "equal:8192"), hq, hkv, d, device="cuda", requires_grad=True)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    w = args.window
    mask = A.AttnMask(cu_seqlens=cu, window=w)
    scale = d**-0.5
    with torch.no_grad():
        out, lse = A.attn_forward(q, k, v, s, mask, scale)
    dout = torch.randn_like(out)
    qd, kd, vd, sd = (t.detach() for t in (q, k, v, s))
    ws_bytes = _C.sink_attn_bwd_workspace(Tq=T, Tk=T, Hq=hq, D=d, has_sink=1, deterministic=0, device=0)
    ws = torch.empty(((ws_bytes + 3) // 4,), dtype=torch.float32, device="cuda")
    dq, dk, dv, dsk = torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd), torch.empty_like(sd)
    rows = {}
    rows["fwd: empty_like(out) + empty(lse)"] = under_spin(lambda: (torch.empty_like(qd), torch.empty((hq, T), dtype=torch.float32, device="cuda")))
    rows["fwd: 7 DLPack capsules"] = under_spin(lambda: [dl(t) for t in (qd, kd, vd, out, lse, sd, cu)])
    rows["fwd: _C.sink_attn_fwd alone (capsules ready)"] = under_spin(
        lambda: _C.sink_attn_fwd(q=dl(qd), k=dl(kd), v=dl(vd), out=dl(out), lse=dl(lse), sink=dl(sd), scale=scale,
                                 stream=stream_of(qd.device), cu_seqlens=dl(cu), window=w))
    with torch.no_grad():
        rows["fwd: attn_forward"] = under_spin(lambda: A.attn_forward(qd, kd, vd, sd, mask, scale))
        rows["fwd: sink_attention (no grad)"] = under_spin(lambda: ncp.sink_attention(q, k, v, s, cu, window=w))
    rows["fwd: sink_attention (grad)"] = under_spin(lambda: ncp.sink_attention(q, k, v, s, cu, window=w))
    rows["bwd: 4 empty_like + workspace"] = under_spin(lambda: (torch.empty_like(qd), torch.empty_like(kd), torch.empty_like(vd), torch.empty_like(sd), torch.empty(((ws_bytes + 3) // 4,), dtype=torch.float32, device="cuda")))
    rows["bwd: _C.sink_attn_bwd_workspace"] = under_spin(lambda: _C.sink_attn_bwd_workspace(Tq=T, Tk=T, Hq=hq, D=d, has_sink=1, deterministic=0, device=0))
    rows["bwd: backward_is_deterministic"] = under_spin(A.backward_is_deterministic)
    rows["bwd: _C.sink_attn_bwd alone"] = under_spin(
        lambda: _C.sink_attn_bwd(q=dl(qd), k=dl(kd), v=dl(vd), out=dl(out), lse=dl(lse), dout=dl(dout), dq=dl(dq), dk=dl(dk),
                                 dv=dl(dv), sink=dl(sd), dsink=dl(dsk), workspace=dl(ws), scale=scale, deterministic=0,
                                 stream=stream_of(qd.device), cu_seqlens=dl(cu), window=w))
    rows["bwd: attn_backward"] = under_spin(lambda: A.attn_backward(dout, qd, kd, vd, sd, out, lse, mask, scale))
    rows["bwd: out.backward (autograd, grads accumulate)"] = round(
        backward_host_us(lambda: ncp.sink_attention(q, k, v, s, cu, window=w), dout, reps=20), 1)
    for name, us in rows.items():
        print(f"{us:10.1f} us  {name}")
    from torch.profiler import ProfilerActivity, profile

    o = ncp.sink_attention(q, k, v, s, cu, window=w)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(20_000_000)
        o.backward(dout)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
