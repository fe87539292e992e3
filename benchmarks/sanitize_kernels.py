"""Runs every CUDA kernel once at small sizes, for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck --kernel-regex kns=ncp python benchmarks/sanitize_kernels.py \
        [attention] [malformed] [mimo] [initprobe] [tmaprobe:sm90|portable|clone]
Every launch goes through the public Python API, so argument plumbing is exercised as well.
Odd sizes on purpose: partial tiles, rows past the end, documents shorter than a tile. The
attention part runs on every kernel the dispatcher can pick (its test hooks); "malformed" feeds
the kernels tables that skip validation (validate=False, and tables straight to the native op).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, fake_mesh, make_attention_case, make_mimo_batch  # noqa: E402

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import flint  # noqa: E402
from nemo_cp_native.attention import AttnMask, attn_backward, attn_forward  # noqa: E402
from nemo_cp_native.testing import SimulatedGroup, attn_debug, simulate_cp_attention  # noqa: E402


def attention():
    g = torch.Generator().manual_seed(0)
    for d, dtype, hq, hkv, window, total in ((64, torch.bfloat16, 4, 2, 0, 333), (64, torch.bfloat16, 4, 2, 45, 333),
                                             (128, torch.float16, 8, 1, 100, 517), (128, torch.bfloat16, 2, 2, 1, 190)):  # fmt: skip
        lengths = doc_lengths(total, "random", mean=90, generator=g)
        c = make_attention_case(lengths, hq, hkv, d, dtype=dtype, device="cuda", generator=g, requires_grad=True)
        out = ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"], window=window)
        out.backward(torch.randn_like(out))
        out = ncp.sink_attention(c["q"], c["k"], c["v"], None, c["cu_seqlens"], window=window)
        out.backward(torch.randn_like(out))
    # D = 128 with documents long enough for the deferred dQ loops: causal, and window 513 (key
    # tiles that 8 or more q tiles see take the deferred loop of the skipping kernel, the others
    # its per-item barrier loop)
    for window in (0, 513):
        c = make_attention_case([1100, 300, 77], 4, 2, 128, dtype=torch.bfloat16, device="cuda", generator=g,
                                requires_grad=True)  # fmt: skip
        out = ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"], window=window)
        out.backward(torch.randn_like(out))
    # the table mask (Flint CP, simulated ranks)
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=70,
                          magi_chunk_size=40)  # fmt: skip
    lengths = doc_lengths(700, "random", mean=150, generator=g)
    c = make_attention_case(lengths, 4, 2, 64, device="cuda", generator=g)
    cu = c["cu_seqlens"].cpu()
    for window in (0, 70):
        plans = [flint._build_magi_plan(cu, cfg, SimulatedGroup(3, r)) for r in range(3)]
        idx = [p.keys[0].local_token_global_indices for p in plans]
        T = c["q"].shape[0]

        def local(t, i):
            rows = t.new_zeros((i.numel(),) + tuple(t.shape[1:]))
            real = i < T
            rows[real] = t[i[real].cuda()]
            return rows

        loc = [[local(t, i) for i in idx] for t in (c["q"], c["k"], c["v"])]
        douts = [torch.randn_like(x) for x in loc[0]]
        simulate_cp_attention(plans, *loc, c["sink"], window, 64**-0.5, douts)


def malformed():
    """Document tables and row-bound tables that would fail validation, straight to the kernels:
    decreasing, past T, negative, huge, and bounds outside the key range. The kernels must stay in
    bounds (any output values are allowed)."""
    g = torch.Generator().manual_seed(3)
    T = 700
    c = make_attention_case([T], 8, 2, 128, device="cuda", generator=g, requires_grad=True)
    big = 2**31 - 1
    tables = ([0, 500, 200, T], [0, 300, 5000, T], [0, -50, 400, T], [0, big, T], [-big, 100, big],
              [0, T + 900], [0, 100], [5, 3, 1])  # fmt: skip
    for cu in tables:
        cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
        for window in (0, 77):
            out = ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], cu, window=window, validate=False)
            out.backward(torch.randn_like(out))
    q, k, v, s = (t.detach() for t in (c["q"], c["k"], c["v"], c["sink"]))
    for hint in (0, 77):  # a window hint: the skipping backward kernels on the same tables
        for lo, hi in ((-5, T + 40), (T + 3, -7), (big, -big), (-big, big)):
            rows = torch.arange(T, device="cuda", dtype=torch.int64)
            mask = AttnMask(row_lo=(rows * 0 + lo).clamp(-big, big).to(torch.int32),
                            row_hi=(rows * 0 + hi).clamp(-big, big).to(torch.int32), window=hint)  # fmt: skip
            out, lse = attn_forward(q, k, v, s, mask, 0.1)
            attn_backward(torch.randn_like(out), q, k, v, s, out, lse, mask, 0.1)
        bad = AttnMask(row_lo=torch.randint(-1000, 2000, (T,), device="cuda", dtype=torch.int32),
                       row_hi=torch.randint(-1000, 2000, (T,), device="cuda", dtype=torch.int32),
                       window=hint)  # not monotone  # fmt: skip
        out, lse = attn_forward(q, k, v, s, bad, 0.1)
        attn_backward(torch.randn_like(out), q, k, v, s, out, lse, bad, 0.1)
    # a plan's runs: the device copy disagrees with the checked host runs (writes past the table)
    from nemo_cp_native._ops import _C, dl

    runs = torch.tensor([[0, 3, 1, 5, 1], [3, 2, 2, 9, 0]], dtype=torch.int32)
    stray = torch.tensor([[0, 3, 1, 1, 1], [2, 100000, 3, 0, 0]], dtype=torch.int32, device="cuda")
    _C.runs_expand(runs=dl(runs), runs_dev=dl(stray), out=dl(torch.empty(6, dtype=torch.int32, device="cuda")),
                   stream=torch.cuda.current_stream().cuda_stream)  # fmt: skip


def initcheck_probe():
    """One small backward twice: dout made by a torch kernel on the GPU, then dout copied from the
    host. compute-sanitizer --kernel-regex kns=ncp only instruments our kernels; if initcheck flags
    the first dout but not the second, its reports come from untracked torch writes, not from
    reads of uninitialized memory."""
    g = torch.Generator().manual_seed(2)
    lengths = doc_lengths(333, "random", mean=90, generator=g)
    c = make_attention_case(lengths, 4, 2, 64, dtype=torch.bfloat16, device="cuda", generator=g, requires_grad=True)
    for label in ("gpu-made dout", "host-made dout"):
        print(f"initcheck_probe: {label} begin", flush=True)
        out = ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"], window=0)
        dout = torch.randn_like(out) if label.startswith("gpu") else torch.randn(out.shape).to("cuda", out.dtype)
        out.backward(dout)
        torch.cuda.synchronize()
        print(f"initcheck_probe: {label} end", flush=True)


def tma_probe(phase: str):
    """Does initcheck see the Hopper forward's TMA stores of O? One small forward and the backward's
    pre-pass (which reads O and dO), dO copied from the host (a tracked write), in one of three
    phases, each its own process: "sm90" (O stored by TMA), "portable" (O stored by plain stores:
    the portable forward), "clone" (O stored by TMA, then cloned by a torch kernel, and the clone
    handed to the backward). Run without --kernel-name so torch's kernels are instrumented too: if
    only the phases that read TMA-stored O draw reports (in "clone": in torch's copy kernel, not
    ours), initcheck does not track TMA stores and the reports are not uninitialized memory."""
    g = torch.Generator().manual_seed(2)
    lengths = doc_lengths(333, "random", mean=90, generator=g)
    c = make_attention_case(lengths, 4, 2, 64, dtype=torch.bfloat16, device="cuda", generator=g)
    q, k, v, s = (c[n].detach() for n in ("q", "k", "v", "sink"))
    mask = AttnMask(cu_seqlens=c["cu_seqlens"], window=0)
    with attn_debug(portable=phase == "portable"):
        out, lse = attn_forward(q, k, v, s, mask, 64**-0.5)
        if phase == "clone":
            out = out.clone()
        dout = torch.randn(out.shape).to("cuda", out.dtype)
        torch.cuda.synchronize()
        print(f"tma_probe {phase}: backward begin", flush=True)
        attn_backward(dout, q, k, v, s, out, lse, mask, 64**-0.5)
        torch.cuda.synchronize()
        print(f"tma_probe {phase}: backward end", flush=True)


def mimo():
    g = torch.Generator().manual_seed(1)
    for B, S, C, cp in ((4, 96, 2, 4), (2, 64, 1, 2), (4, 40, 4, 1)):
        batch = make_mimo_batch(B, S, num_chunks=C, cp_size=cp, device="cuda", image_token_id=7, video_token_id=8,
                                generator=g)  # fmt: skip
        host_meta = {k: v.cpu() if k in ("seq_lens", "seq_lens_padded") else v for k, v in batch.items()}
        with fake_mesh(cp, cp - 1) as mesh:  # staged table, then the table as a launch parameter
            for b in (batch, host_meta):
                ncp.mimo.shard_batch_for_mimo_te(mesh, None, dict(b), num_chunks=C, image_token_id=7, video_token_id=8)
    cu = torch.tensor([0, 8, 16, 48], dtype=torch.int32, device="cuda")
    ncp.thd_partition_indices(cu, 64, 2, 1, validate=False)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["attention", "malformed", "mimo"]
    # every kernel family the dispatcher picks: the defaults (on sm_90: the persistent Hopper
    # forward, the atomic-dQ backward) on a 3-CTA grid (many items per CTA), the deterministic
    # Hopper backward with one CTA per forward item and whole tiles, and the portable kernels
    hooks = ({"grid": 3}, {"grid": 1 << 30, "whole_tiles": True, "det": True}, {"portable": True, "det": True})
    for h in hooks:
        det = h.pop("det", False)
        os.environ["NCP_DETERMINISTIC"] = "1" if det else "0"
        with attn_debug(**h):
            if "attention" in parts:
                attention()
            if "malformed" in parts:
                malformed()
    os.environ.pop("NCP_DETERMINISTIC")
    if "mimo" in parts:
        mimo()
    if "initprobe" in parts:
        initcheck_probe()
    for part in parts:
        if part.startswith("tmaprobe:"):
            tma_probe(part.split(":", 1)[1])
    torch.cuda.synchronize()
    print("sanitize_kernels: all kernels ran")
