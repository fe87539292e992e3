"""The README's main job, ``python -m nemo_cp_native demo``, and ``info``; the shared baselines.

The demo runs in a subprocess on the CPU in quick mode (its GPU half, against FlexAttention and
SDPA, runs in ``benchmarks/gpu_run.sh demo``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native import baselines as bl
from nemo_cp_native.reference.sink_attention import attention_ref

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_quick_on_cpu_passes_every_parity_check():
    run = subprocess.run([sys.executable, "-m", "nemo_cp_native", "demo", "--quick", "--device", "cpu"],
                         capture_output=True, text=True, timeout=600, cwd=_ROOT)  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    parity = [line.strip() for line in out.splitlines() if line.strip().startswith("parity ")]
    for piece in ("MiMo shard", "sink attention", "Magi plan", "Flint CP"):
        assert any(piece in line for line in parity), (piece, out)
    assert len(parity) == 7 and all(line.startswith("parity ok") for line in parity), out
    assert "all parity checks passed" in out
    assert "torch ops + native TE partition" in out  # MiMo against the framework's ops, not the Python TE loop
    assert "GPU baselines (FlexAttention" in out and "need a GPU" in out


def test_info_runs(capsys):
    from nemo_cp_native.__main__ import main

    assert main(["info"]) == 0
    assert f"nemo_cp_native {ncp.__version__}" in capsys.readouterr().out


def test_info_says_when_cuda_kernels_cannot_run(monkeypatch, capsys):
    from nemo_cp_native import __main__ as cli

    info = {**ncp.build_info(), "cuda": True, "cuda_archs": "90a"}
    monkeypatch.setattr(cli.ncp, "build_info", lambda: info)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.info() == 0
    assert "CUDA kernels are built but cannot run on this machine" in capsys.readouterr().out


def test_visible_pairs_counts_the_mask():
    g = torch.Generator().manual_seed(0)
    for window in (0, 1, 5, 40):
        lengths = [int(n) for n in torch.randint(1, 60, (5,), generator=g)]
        pos = torch.arange(sum(lengths))
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        m = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        if window:
            m &= pos[:, None] - pos[None, :] < window
        assert bl.visible_pairs(lengths, window) == int(m.sum())
        assert bl.attention_flops(lengths, window, 4, 8, backward=True) == int(2.5 * 4 * int(m.sum()) * 4 * 8)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_sink_baseline_matches_the_oracle_on_cpu():
    """The Flex+sink baseline computes learned-sink attention (eager flex, forward: CPU flex has no
    backward)."""
    lengths, hq, hkv, d = [37, 64, 11, 50], 4, 2, 16
    for window in (0, 9):
        q, k, v = (torch.randn(sum(lengths), h, d, dtype=torch.float64) for h in (hq, hkv, hkv))
        sink = torch.randn(hq, dtype=torch.float64)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        ref, _ = attention_ref(q, k, v, sink, cu, window=window)
        run = bl.flex_sink_attention(lengths, window, device="cpu", compile=False)
        got = bl.from_bhtd(run(bl.to_bhtd(q), bl.to_bhtd(k), bl.to_bhtd(v), sink))
        assert (got - ref).abs().max().item() < 1e-10


def test_sdpa_baseline_is_causal_attention_without_sink():
    lengths, hq, hkv, d = [24, 24, 24], 4, 2, 8
    q, k, v = (torch.randn(sum(lengths), h, d, dtype=torch.float64) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, 24, 48, 72], dtype=torch.int32)
    ref, _ = attention_ref(q, k, v, None, cu)
    got = bl.sdpa_causal(*(bl.to_documents(t, 24) for t in (q, k, v)))  # [B, H, 24, D]
    assert (got.transpose(1, 2).reshape(72, hq, d) - ref).abs().max().item() < 1e-10
