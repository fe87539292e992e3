"""Which kernels PyTorch's SDPA runs for the causal 32k benchmark case (forward and backward):

    python benchmarks/probe_sdpa_kernels.py
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from nemo_cp_native import baselines as bl  # noqa: E402

q, k, v = (torch.randn(4, 32768, h, 128, device="cuda", dtype=torch.bfloat16) for h in (32, 4, 4))
q, k, v = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
print("flash", torch.backends.cuda.flash_sdp_enabled(), "cudnn", torch.backends.cuda.cudnn_sdp_enabled(),
      "mem_eff", torch.backends.cuda.mem_efficient_sdp_enabled())
for _ in range(2):
    bl.sdpa_causal(q, k, v).sum().backward()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    bl.sdpa_causal(q, k, v).sum().backward()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
