"""One forward of a bench_sink_attention case, for a profiler to capture (the `profile` stage of
gpu_run.sh runs it under Nsight Compute). Three warm-up calls, then one marked call.

    python benchmarks/profile_attn_fwd.py flint-8k-w513 [more cases]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, make_attention_case  # noqa: E402  (also puts the repository root on the path)

import nemo_cp_native as ncp  # noqa: E402
from bench_sink_attention import CASES, QUICK  # noqa: E402


def main(names: list[str]) -> None:
    for name in names:
        total, doc_len, hq, hkv, d, window = {**CASES, **QUICK}[name]
        lengths = doc_lengths(total, f"equal:{doc_len}")
        c = make_attention_case(lengths, hq, hkv, d, dtype=torch.bfloat16, device="cuda",
                                generator=torch.Generator().manual_seed(1234))  # fmt: skip
        args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
        with torch.no_grad():
            for _ in range(4):
                ncp.sink_attention(*args, window=window, validate=False)
        torch.cuda.synchronize()
        print(f"profiled {name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["flint-8k-w513"])
