"""A/B of the table mask's window hint (Flint CP window layers), one build, one process.

The Flint plan gives each window key's table mask its window (``AttnMask(row_lo, row_hi,
window=W)``), and the Hopper backward then takes its skipping kernels. This times every rank's
backward kernels (cp = 8, Flint 32/4/128, 64k tokens, window 513) with the plan's mask (B) and the
same tables without the hint (A: ``window=0``, the kernels a table took before the hint), round
robin, queued, L2 flushed, CUDA events, median; checks that both give the same gradients bit for
bit (atomic dQ aside: dq is compared to a tolerance of one ulp-scale bf16 step).

    python benchmarks/ab_table_hint.py [--docs 8192,2048] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from types import SimpleNamespace

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]
from common import env_record, time_cuda  # noqa: E402

from nemo_cp_native import flint  # noqa: E402
from nemo_cp_native.attention import attn_backward, attn_forward  # noqa: E402
from nemo_cp_native.flint import _kv_buffer  # noqa: E402
from nemo_cp_native.testing import doc_lengths, make_attention_case  # noqa: E402
from nemo_cp_native.testing import SimulatedGroup  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", default="8192,2048")
    ap.add_argument("--window", type=int, default=513)
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    T, hq, hkv, d, cp, w = 65536, 32, 4, 128, args.cp, args.window
    cfg = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, sliding_window=w,
                          magi_chunk_size=512)  # bench_flint.py's
    rows = []
    for doc in (int(x) for x in args.docs.split(",")):
        g = torch.Generator().manual_seed(3)
        c = make_attention_case(doc_lengths(T, f"equal:{doc}"), hq, hkv, d, device="cuda", generator=g)
        cu, sink, scale = c["cu_seqlens"], c["sink"], d**-0.5
        times = {"a": [], "b": []}
        for r in range(cp):
            plan = flint._build_magi_plan(cu.cpu(), cfg, SimulatedGroup(cp, r))
            mk = plan.keys[w]
            idx = mk.local_token_global_indices.cuda()
            real = idx < T
            q, k, v, do = (t.new_zeros((idx.numel(),) + tuple(t.shape[1:])) for t in (c["q"], c["k"], c["v"], c["q"]))
            for dst, src in ((q, c["q"]), (k, c["k"]), (v, c["v"])):
                dst[real] = src[idx[real]]
            do.normal_(generator=torch.Generator(device="cuda").manual_seed(r))
            recv = torch.randn((sum(mk.recv_counts), hkv, 2 * d), device="cuda", dtype=k.dtype)
            kb, vb = _kv_buffer(mk, k, v, recv)
            masks = {"b": mk.device_tables(q.device)["mask"]}
            masks["a"] = dataclasses.replace(masks["b"], window=0)
            assert masks["b"].window == w
            out, lse = attn_forward(q, kb, vb, sink, masks["b"], scale)
            ga, gb = (attn_backward(do, q, kb, vb, sink, out, lse, masks[x], scale) for x in ("a", "b"))
            for name, x, y in zip(("dq", "dk", "dv", "dsink"), ga, gb):
                if name == "dq":  # atomic dQ: the order of the adds differs between the kernels
                    torch.testing.assert_close(x.float(), y.float(), rtol=1e-2, atol=1e-2)
                else:
                    assert torch.equal(x, y), f"{name} differs with the hint (rank {r}, doc {doc})"
            per = {"a": [], "b": []}
            for rnd in range(args.rounds):
                for key in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
                    m = masks[key]
                    per[key].append(time_cuda(lambda: attn_backward(do, q, kb, vb, sink, out, lse, m, scale),
                                              reps=args.reps, queued=True))  # fmt: skip
            for key in per:
                times[key].append(statistics.median(per[key]))
        a, b = sum(times["a"]), sum(times["b"])
        rows.append({"T": T, "cp": cp, "doc": doc, "window": w, "bwd_ms_all_ranks_a_nohint": round(a, 4),
                     "bwd_ms_all_ranks_b_hint": round(b, 4), "a_over_b": round(a / b, 4),
                     "per_rank_a": [round(x, 4) for x in times["a"]], "per_rank_b": [round(x, 4) for x in times["b"]]})
        print(f"doc {doc} w{w} cp{cp}: backward kernels over all ranks, no hint {a:.3f} ms, hint {b:.3f} ms, "
              f"speedup {a / b:.4f}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env_record(), "method": "queued spin, L2 flush, CUDA events, median of reps, median of "
                       "rounds (round robin), summed over ranks", "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
