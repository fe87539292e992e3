"""Four calls of a bench_sink_attention case, for a profiler to capture (the `profile` stage of
gpu_run.sh runs it under Nsight Compute and captures the fourth launch of each kernel it names).
Forward only by default; ``--bwd``: forward and backward (the default, atomic-dQ backward, or the
deterministic one with NCP_DETERMINISTIC=1). A case named ``sdpa-<case>`` runs PyTorch's SDPA
(causal, no sink, one document per batch row, as the benchmark's ``sdpa(no sink)`` row) on that
case's tensors instead, so its kernels can be profiled beside ours.

    python benchmarks/profile_attn.py [--bwd] flint-8k-w513 [sdpa-flint-32k-causal ...]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import doc_lengths, make_attention_case  # noqa: E402  (also puts the repository root on the path)

import nemo_cp_native as ncp  # noqa: E402
from nemo_cp_native import baselines as bl  # noqa: E402
from bench_sink_attention import CASES, QUICK  # noqa: E402


def main(argv: list[str]) -> None:
    bwd = "--bwd" in argv
    names = [a for a in argv if a != "--bwd"] or ["flint-8k-w513"]
    for name in names:
        sdpa = name.startswith("sdpa-")
        total, doc_len, hq, hkv, d, window = {**CASES, **QUICK}[name[5:] if sdpa else name]
        if sdpa and (window != 0 or total % doc_len):
            raise SystemExit(f"{name}: SDPA runs causal cases of equal documents only")
        lengths = doc_lengths(total, f"equal:{doc_len}")
        c = make_attention_case(lengths, hq, hkv, d, dtype=torch.bfloat16, device="cuda", requires_grad=bwd,
                                generator=torch.Generator().manual_seed(1234))  # fmt: skip
        args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
        dout = torch.randn_like(c["q"]) if bwd else None
        if sdpa:
            q, k, v = (bl.to_documents(t, doc_len).requires_grad_(bwd) for t in args[:3])
            dout = bl.to_documents(dout, doc_len) if bwd else None

            def call():
                return bl.sdpa_causal(q, k, v)
        else:

            def call():
                return ncp.sink_attention(*args, window=window)

        for _ in range(4):
            if bwd:
                call().backward(dout)
            else:
                with torch.no_grad():
                    call()
        torch.cuda.synchronize()
        print(f"profiled {name}{' (forward and backward)' if bwd else ''}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
