"""Host-sync budgets of the hot paths (issue 16, README "Sync budgets"), on CUDA: torch's sync debug
mode set to "error" turns any synchronizing CUDA operation inside the call into an exception.
Skipped without a GPU and a CUDA build."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native import flint, testing
from nemo_cp_native.testing import doc_lengths, make_attention_case

pytestmark = pytest.mark.cuda


class _no_syncs:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        return False


@pytest.mark.parametrize("window", [0, 513])
@pytest.mark.parametrize("deterministic", ["0", "1"])
def test_sink_attention_forward_and_backward_make_no_sync(window, deterministic, monkeypatch):
    """Default arguments: no sync in the forward or the backward (validate is opt-in)."""
    monkeypatch.setenv("NCP_DETERMINISTIC", deterministic)
    c = make_attention_case(doc_lengths(3000, "random", mean=700), 8, 2, 128, device="cuda", requires_grad=True)
    dout = torch.randn_like(c["q"])
    with _no_syncs():
        out = ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"], window=window)
        out.backward(dout)
    torch.cuda.synchronize()
    assert torch.isfinite(c["q"].grad).all()
    with pytest.raises(RuntimeError):  # the opt-in host check is the one call that syncs
        with _no_syncs():
            ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"], validate=True)


@pytest.mark.parametrize("window", [0, 513])
def test_flint_rank_steps_make_no_sync(window):
    """Every CP rank's step (send rows, K/V buffer, kernels; backward: returned rows, kernels, the
    sum), simulated on one GPU: no sync beyond the all-to-all, which the simulation routes
    in-process; the first call's table uploads are non-blocking copies from pinned memory."""
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=128, sliding_window=window,
                          magi_chunk_size=256)  # fmt: skip
    c = make_attention_case(doc_lengths(4096, "random", mean=900), 8, 2, 128, device="cuda")
    cu = c["cu_seqlens"].cpu()
    plans = [flint._build_magi_plan(cu, cfg, testing.SimulatedGroup(4, r)) for r in range(4)]
    L = plans[0].keys[0].num_local_tokens
    loc = [[torch.randn(L, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)] for h in (8, 2, 2, 8)]
    for _ in range(2):  # first call (uploads the tables) and a later one
        with _no_syncs():
            outs, grads = testing.simulate_cp_attention(plans, loc[0], loc[1], loc[2], c["sink"], window, 0.1, loc[3])
    torch.cuda.synchronize()
    assert all(torch.isfinite(o).all() for o in outs)


def test_select_with_a_cpu_index_makes_no_sync():
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=128, sliding_window=0)
    cu = torch.tensor([0, 512], dtype=torch.int32)
    plans = flint.FlintMagiBatchPlans(plans=(flint._build_magi_plan(cu, cfg, None),) * 3)
    with _no_syncs():
        assert plans.select(torch.tensor([2])) is plans.plans[2]
