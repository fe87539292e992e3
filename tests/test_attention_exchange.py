"""The attention calls' fast host path: tensors read through the DLPack C exchange API
(``_C.sink_attn_fwd_x`` / ``_C.sink_attn_bwd_x``) where torch publishes it, the capsule calls
(``_C.sink_attn_fwd`` / ``_C.sink_attn_bwd``) otherwise. Both must give the same bits and the same
errors; the fast path must hand every tensor it cannot read to the capsule path untouched.
CUDA twin (side stream): tests/test_sink_attention_cuda.py::test_cuda_exchange_path_matches_capsules."""

from __future__ import annotations

import pytest
import torch

from nemo_cp_native import attention as A
from nemo_cp_native._ops import _C, dl
from nemo_cp_native.attention import AttnMask, attn_backward, attn_forward
from nemo_cp_native.testing import make_attention_case

HAS_API = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


class _Sub(torch.Tensor):
    """A tensor subclass: not a registered type, so the capsule path carries it."""


def _case(dtype=torch.float32):
    c = make_attention_case([5, 7, 3], 4, 2, 8, dtype=dtype)
    return c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]


def _masks(cu, T):
    lo = torch.zeros(T, dtype=torch.int32)
    hi = torch.arange(T, dtype=torch.int32)
    return {"docs": AttnMask(cu_seqlens=cu, window=3), "table": AttnMask(row_lo=lo, row_hi=hi, window=0)}


def _run(q, k, v, s, mask, det=False):
    out, lse = attn_forward(q, k, v, s, mask, 0.5)
    dout = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return (out, lse, *(g for g in attn_backward(dout, q, k, v, s, out, lse, mask, 0.5) if g is not None))


@pytest.fixture
def capsules_counted(monkeypatch):
    """Counts the capsules the attention calls make (0 when the fast path carried the call)."""
    made = []

    def counting(t):
        made.append(t)
        return dl(t)

    monkeypatch.setattr(A, "to_dlpack", counting)
    return made


def test_fast_path_is_on_where_torch_publishes_the_api():
    assert A._X == HAS_API
    if HAS_API:
        assert _C.exchange_init((torch.Tensor, torch.nn.Parameter)) is True  # registering again is idempotent


@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
@pytest.mark.parametrize("mode", ["docs", "table"])
@pytest.mark.parametrize("sink", ["tensor", "parameter", "none"])
def test_fast_path_gives_the_capsule_paths_bits_and_makes_no_capsule(mode, sink, monkeypatch, capsules_counted):
    q, k, v, s, cu = _case()
    s = {"tensor": s, "parameter": torch.nn.Parameter(s.clone()), "none": None}[sink]
    mask = _masks(cu, q.shape[0])[mode]
    fast = _run(q, k, v, s, mask)
    assert capsules_counted == []  # every tensor, Parameter included, went through the exchange API
    monkeypatch.setattr(A, "_X", False)
    slow = _run(q, k, v, s, mask)
    assert len(capsules_counted) > 0
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
def test_unregistered_tensor_types_take_the_capsule_path(capsules_counted):
    q, k, v, s, cu = _case()
    mask = _masks(cu, q.shape[0])["docs"]
    want = _run(q, k, v, s, mask)
    assert capsules_counted == []
    got = _run(q.as_subclass(_Sub), k, v, s, mask)  # q a subclass: the whole call goes by capsules
    assert len(capsules_counted) > 0
    for a, b in zip(got, want):
        assert torch.equal(a.as_subclass(torch.Tensor), b)


@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
def test_x_calls_check_their_arguments_as_the_keyword_calls_do():
    """Contents and scalars: the same exception and message from both native entry points."""
    q, k, v, s, cu = _case()
    out, lse = torch.empty_like(q), torch.empty(4, 15)
    T = q.shape[0]

    def both(**kw):
        a = dict(q=q, k=k, v=v, out=out, lse=lse, sink=s, cu_seqlens=cu, row_lo=None, row_hi=None, scale=0.5, window=0)
        a.update(kw)
        errs = []
        for call in ("x", "kw"):
            try:
                if call == "x":
                    r = _C.sink_attn_fwd_x(*(a[n] for n in ("q", "k", "v", "out", "lse", "sink", "cu_seqlens",
                                                            "row_lo", "row_hi", "scale", "window")))  # fmt: skip
                    assert r is None
                else:
                    _C.sink_attn_fwd(**{n: (dl(t) if isinstance(t, torch.Tensor) else t) for n, t in a.items()})
                errs.append(None)
            except (ValueError, TypeError) as e:
                errs.append((type(e), str(e)))
        return errs

    assert both() == [None, None]
    cases = [
        dict(cu_seqlens=torch.tensor([0, 9, 5, 15], dtype=torch.int32)),
        dict(cu_seqlens=torch.tensor([2, 15], dtype=torch.int32)),
        dict(cu_seqlens=cu.long()),
        dict(window=-2),
        dict(cu_seqlens=None),
        dict(cu_seqlens=None, row_lo=torch.arange(T, dtype=torch.int32), row_hi=torch.arange(T - 1, dtype=torch.int32)),
        dict(out=torch.empty(15, 4, 7)),
        dict(lse=torch.empty(4, 15, dtype=torch.float64)),
        dict(sink=torch.zeros(3)),
        dict(k=k.double()),
        dict(q=None),
        dict(q=q.to(torch.int32)),
        dict(scale=float("inf")),
        dict(scale=True),
        dict(window=2**63),
        dict(window=True),
    ]
    for kw in cases:
        x, ref = both(**kw)
        assert ref is not None, kw
        assert x == ref, kw


@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
def test_x_calls_refuse_what_they_cannot_read_without_side_effects():
    q, k, v, s, cu = _case()
    out, lse = torch.zeros_like(q), torch.zeros(4, 15)
    args = [q, k, v, out, lse, s, cu, None, None, 0.5, 0]
    for bad in ([1, 2], q.to("meta"), q.as_subclass(_Sub), "q"):
        assert _C.sink_attn_fwd_x(bad, *args[1:]) is NotImplemented
    assert torch.count_nonzero(out) == 0 and torch.count_nonzero(lse) == 0  # nothing was written
    with pytest.raises(TypeError, match=r"sink_attn_fwd_x\(\) takes 11 positional arguments \(10 given\)"):
        _C.sink_attn_fwd_x(*args[:-1])
    with pytest.raises(TypeError, match=r"sink_attn_bwd_x\(\) takes 18 positional arguments \(11 given\)"):
        _C.sink_attn_bwd_x(*args)
    with pytest.raises(TypeError):
        _C.sink_attn_fwd_x(*args, window=0)  # positional only


def test_exchange_init_checks_its_argument_and_can_be_restored():
    with pytest.raises(TypeError, match="tuple of 1 to 4 tensor types"):
        _C.exchange_init(torch.Tensor)
    with pytest.raises(TypeError, match="type objects"):
        _C.exchange_init((torch.Tensor, 3))
    try:
        assert _C.exchange_init((object,)) is False  # no API on that type: the fast path is off ...
        q, k, v, s, cu = _case()
        out, lse = torch.empty_like(q), torch.empty(4, 15)
        assert _C.sink_attn_fwd_x(q, k, v, out, lse, s, cu, None, None, 0.5, 0) is NotImplemented
        if HAS_API:  # ... and the public calls still work, by capsules
            mask = _masks(cu, q.shape[0])["docs"]
            assert all(torch.isfinite(t).all() for t in _run(q, k, v, s, mask))
    finally:
        assert _C.exchange_init((torch.Tensor, torch.nn.Parameter)) is HAS_API
