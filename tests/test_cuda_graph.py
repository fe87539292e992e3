"""CUDA-graph capture of ``sink_attention`` (README "CUDA graphs"): the forward and the backward
launch on the current stream, make no host sync, read ``cu_seqlens`` only on the device and take
their workspace from torch's allocator, so a captured training step replays them, with new input
values and new document boundaries (same shapes) copied into the static tensors. Checked against
eager calls on the same values: the forward, dk, dv and dsink bitwise (they have no atomics), dq
bitwise under the deterministic backward and within the atomic-order noise otherwise. Skipped
without a GPU and a CUDA build."""

from __future__ import annotations

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native.testing import make_attention_case

pytestmark = pytest.mark.cuda

HQ, HKV, D = 8, 2, 128
LENGTHS = ([700, 1, 1300, 513, 486], [64, 2000, 900, 30, 6])  # same T (3000) and document count


def _values(seed: int, lengths) -> dict:
    g = torch.Generator().manual_seed(seed)
    return make_attention_case(lengths, HQ, HKV, D, device="cuda", generator=g)


def _eager(vals: dict, dout: torch.Tensor, window: int):
    leaves = [vals[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "sink")]
    out = ncp.sink_attention(*leaves, vals["cu_seqlens"], window=window)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def _assert_dq(got, want, deterministic: bool):
    if deterministic:
        assert torch.equal(got, want)
    else:  # atomic dQ: the order of the fp32 additions varies, so the last bf16 bit may
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("window", [0, 513])
@pytest.mark.parametrize("deterministic", ["0", "1"])
def test_forward_and_backward_replay_in_a_cuda_graph(window, deterministic, monkeypatch):
    """A training step's attention captured once (forward and backward, grads into the leaves'
    .grad) and replayed on two sets of values, the second with other document boundaries written
    into the same cu_seqlens tensor: every replay equals the eager op on those values."""
    monkeypatch.setenv("NCP_DETERMINISTIC", deterministic)
    first = _values(0, LENGTHS[0])
    static = {n: first[n].detach().clone() for n in ("q", "k", "v", "sink")}
    for n in static:
        static[n].requires_grad_()
    cu = first["cu_seqlens"].clone()
    dout = torch.randn_like(static["q"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (first-call kernel setup), as torch asks
        for _ in range(2):
            ncp.sink_attention(static["q"], static["k"], static["v"], static["sink"], cu, window=window).backward(dout)
    torch.cuda.current_stream().wait_stream(side)
    for t in static.values():
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ncp.sink_attention(static["q"], static["k"], static["v"], static["sink"], cu, window=window)
        out.backward(dout)
    for seed, lengths in ((1, LENGTHS[0]), (2, LENGTHS[1])):
        vals = _values(seed, lengths)
        g = torch.Generator().manual_seed(100 + seed)
        new_dout = torch.randn(dout.shape, generator=g).to("cuda", dout.dtype)
        with torch.no_grad():
            for n, t in static.items():
                t.copy_(vals[n])
            cu.copy_(vals["cu_seqlens"])
            dout.copy_(new_dout)
        graph.replay()
        torch.cuda.synchronize()
        want_out, want_dq, want_dk, want_dv, want_ds = _eager(vals, new_dout, window)
        assert torch.equal(out, want_out)
        _assert_dq(static["q"].grad, want_dq, deterministic == "1")
        assert torch.equal(static["k"].grad, want_dk)
        assert torch.equal(static["v"].grad, want_dv)
        assert torch.equal(static["sink"].grad, want_ds)


# torch 2.11's make_graphed_callables warms up on one side stream and captures on another, and warns
# that the parameter's AccumulateGrad node (made during the warm-up) has the other stream; that
# is torch's own bookkeeping, the same for any module with a parameter.
@pytest.mark.filterwarnings("ignore:The AccumulateGrad node's stream:UserWarning")
def test_make_graphed_callables_matches_eager():
    """torch.cuda.make_graphed_callables over a module that calls sink_attention (window 513,
    learned sink as a parameter): outputs and gradients of the graphed callable equal eager's."""

    class Attn(torch.nn.Module):
        def __init__(self, cu):
            super().__init__()
            self.sink = torch.nn.Parameter(torch.linspace(-2.0, 2.0, HQ, device="cuda"))
            self.cu = cu

        def forward(self, q, k, v):
            return ncp.sink_attention(q, k, v, self.sink, self.cu, window=513)

    vals = _values(3, LENGTHS[0])
    mod = Attn(vals["cu_seqlens"])
    sample = tuple(vals[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
    graphed = torch.cuda.make_graphed_callables(mod, sample)
    g = torch.Generator().manual_seed(7)
    new = _values(4, LENGTHS[0])
    q, k, v = (new[n].detach().clone().requires_grad_() for n in ("q", "k", "v"))
    dout = torch.randn(q.shape, generator=g).to("cuda", q.dtype)
    mod.sink.grad = None
    out = graphed(q, k, v)
    out.backward(dout)
    got = (out.detach(), q.grad, k.grad, v.grad, mod.sink.grad.clone())
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, mod.sink)]
    want_out = ncp.sink_attention(*leaves, mod.cu, window=513)
    want = (want_out.detach(), *torch.autograd.grad(want_out, leaves, dout))
    assert torch.equal(got[0], want[0])
    _assert_dq(got[1], want[1], ncp.attention.backward_is_deterministic())
    for a, b in zip(got[2:], want[2:]):
        assert torch.equal(a, b)


def test_validate_true_during_capture_is_a_clear_error():
    """validate=True needs the table on the host, which a capture forbids: a ValueError naming the
    argument before any CUDA work, and the capture goes on intact (the next call, validate=False,
    is captured and replays right)."""
    vals = _values(5, LENGTHS[0])
    args = (vals["q"], vals["k"], vals["v"], vals["sink"], vals["cu_seqlens"])
    ncp.sink_attention(*args)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(ValueError, match="validate=True"):
            ncp.sink_attention(*args, validate=True)
        captured = ncp.sink_attention(*args, validate=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ncp.sink_attention(*args))
    out = ncp.sink_attention(vals["q"], vals["k"], vals["v"], vals["sink"], vals["cu_seqlens"], validate=True)
    bad = vals["cu_seqlens"].clone()
    bad[1] = -5
    with pytest.raises(ValueError):
        ncp.sink_attention(vals["q"], vals["k"], vals["v"], vals["sink"], bad, validate=True)
    assert torch.isfinite(out).all()
