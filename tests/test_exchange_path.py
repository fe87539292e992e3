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


def _errors_of_both_calls(x_call, kw_call, a: dict, order) -> list:
    """What the positional exchange-API call (arguments ``a`` in ``order``) and the keyword call (by
    capsules) raise on the same arguments: (type, message) each, or None where it returned."""
    errs = []
    for fast in (True, False):
        try:
            if fast:
                assert x_call(*(a[n] for n in order)) is None
            else:
                kw_call(**{n: (dl(t) if isinstance(t, torch.Tensor) else t) for n, t in a.items()})
            errs.append(None)
        except (ValueError, TypeError) as e:
            errs.append((type(e), str(e)))
    return errs


@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
def test_x_calls_check_their_arguments_as_the_keyword_calls_do():
    """Contents and scalars: the same exception and message from both native entry points."""
    q, k, v, s, cu = _case()
    out, lse = torch.empty_like(q), torch.empty(4, 15)
    T = q.shape[0]

    def both(**kw):
        a = dict(q=q, k=k, v=v, out=out, lse=lse, sink=s, cu_seqlens=cu, row_lo=None, row_hi=None, scale=0.5, window=0)
        a.update(kw)
        order = ("q", "k", "v", "out", "lse", "sink", "cu_seqlens", "row_lo", "row_hi", "scale", "window")
        return _errors_of_both_calls(_C.sink_attn_fwd_x, _C.sink_attn_fwd, a, order)

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
def test_bwd_x_checks_its_arguments_as_the_keyword_call_does():
    q, k, v, s, cu = _case()
    out, lse = attn_forward(q, k, v, s, AttnMask(cu_seqlens=cu, window=0), 0.5)
    order = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "sink", "dsink", "workspace", "cu_seqlens",
             "row_lo", "row_hi", "scale", "window", "deterministic")  # fmt: skip

    def both(**kw):
        a = dict(q=q, k=k, v=v, out=out, lse=lse, dout=torch.ones_like(out), dq=torch.empty_like(q),
                 dk=torch.empty_like(k), dv=torch.empty_like(v), sink=s, dsink=torch.empty_like(s), workspace=None,
                 cu_seqlens=cu, row_lo=None, row_hi=None, scale=0.5, window=0, deterministic=0)  # fmt: skip
        a.update(kw)
        return _errors_of_both_calls(_C.sink_attn_bwd_x, _C.sink_attn_bwd, a, order)

    assert both() == [None, None]
    for kw in (dict(dq=torch.empty(15, 4, 7)), dict(dk=torch.empty_like(k, dtype=torch.float64)),
               dict(dsink=None), dict(dout=None), dict(workspace=torch.empty(4, dtype=torch.float64)),
               dict(deterministic=True), dict(deterministic=2**40), dict(scale=float("nan")),
               dict(cu_seqlens=torch.tensor([0, 3, 2, 15], dtype=torch.int32))):  # fmt: skip
        x, ref = both(**kw)
        assert ref is not None and x == ref, (kw, x, ref)


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


# ---- the MiMo sharder ----------------------------------------------------------------------------

from _mesh import FakeCPMesh, fake_dist  # noqa: E402
from _upstream import assert_same_outcome, call  # noqa: E402

from nemo_cp_native import mimo as M  # noqa: E402
from nemo_cp_native.testing import make_mimo_batch  # noqa: E402


@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
@pytest.mark.parametrize("C", [1, 2, 4])
@pytest.mark.parametrize("mesh", [FakeCPMesh(1, 0), FakeCPMesh(2, 1), FakeCPMesh(4, 3)], ids=["cp1", "cp2", "cp4"])
def test_mimo_fast_path_gives_the_capsule_paths_outputs(C, mesh, monkeypatch, ncp_seed):
    """``shard_batch_for_mimo_te`` through ``_C.mimo_run_x`` (no capsule made) and through the capsule
    call: the same dict, keys, dtypes, shapes and values, and the same errors."""
    g = torch.Generator().manual_seed(ncp_seed)
    batch = make_mimo_batch(8, 64, num_chunks=C, cp_size=mesh.size(), generator=g, docs_per_row=(1, 3),
                            image_token_id=5, video_token_id=6, media_fraction=0.2)  # fmt: skip
    if mesh.size() == 1 and C == 1:  # the one native case without position ids
        batch["position_ids"] = None
    made = []
    monkeypatch.setattr(M, "to_dlpack", lambda t: made.append(t) or dl(t))
    outcomes = []
    for fast in (True, False):
        monkeypatch.setattr(M, "_X", fast)
        with fake_dist(mesh):
            outcomes.append(call(M.shard_batch_for_mimo_te, mesh, None, dict(batch), num_chunks=C))
        assert (made == []) == fast, len(made)
        assert M.fast_path_info()["path"] == "native", M.fast_path_info()
    assert_same_outcome(*outcomes)
    if mesh.size() == 1:
        return
    bad = dict(batch, seq_lens_padded=batch["seq_lens_padded"] + 1)  # not divisible by 2 cp: the same error
    errs = []
    for fast in (True, False):
        monkeypatch.setattr(M, "_X", fast)
        with fake_dist(mesh):
            errs.append(call(M.shard_batch_for_mimo_te, mesh, None, bad, num_chunks=C))
    assert errs[0][0] == "err"
    assert_same_outcome(*errs)


@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
def test_mimo_run_x_reads_as_mimo_run_does():
    """``_C.mimo_run_x``: the keyword call's results; unmapped input dtypes are ``Fallback`` with the
    same message; required None, unknown objects and refused tensors are NotImplemented (nothing
    written); bad buffers stay errors."""
    z, lens = torch.zeros(4, 16, dtype=torch.long), torch.full((4, 1), 16)
    plan = M._plan((4, 16, 1, 1, 1, 2, 7))
    order = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded", "out", "host")
    scalars = dict(num_chunks=1, cp_size=2, cp_rank=0, image_token_id=None, video_token_id=None, sentinel=-1000,
                   outputs=7)  # fmt: skip

    def both(**over):
        ts = dict(input_ids=z, labels=z, position_ids=z, seq_lens=lens, seq_lens_padded=lens, host=None)
        ts.update(over)
        res = []
        for fast in (True, False):
            out = torch.full((plan.out_words,), -7, dtype=torch.int64)
            t = dict(ts, out=ts.get("out", out))
            try:
                if fast:
                    r = _C.mimo_run_x(*(t[k] for k in order), *scalars.values())
                else:
                    r = _C.mimo_run(**{k: (dl(v) if isinstance(v, torch.Tensor) else v) for k, v in t.items()},
                                    **scalars, stream=None)  # fmt: skip
                res.append(("ok", r, t["out"].clone()))
            except Exception as e:  # noqa: BLE001 - compared below
                res.append(("err", type(e), str(e)))
        return res

    (fk, fr, fo), (ck, cr, co) = both()
    assert fk == ck == "ok" and fr == cr and torch.equal(fo, co)
    for key, t in (("input_ids", z.to(torch.complex64)), ("labels", z.to(torch.uint8)),
                   ("position_ids", z.reshape(4, 16, *[1] * 7)), ("seq_lens", lens.short())):  # fmt: skip
        fast, caps = both(**{key: t})
        assert fast == caps and fast[1] is _C.Fallback, (key, fast, caps)
    fast, caps = both(out=torch.zeros(8, dtype=torch.complex64))
    assert fast == caps and fast[1] is ValueError and "out: unsupported dtype" in fast[2]
    out = torch.full((plan.out_words,), -7, dtype=torch.int64)
    for k, bad in (("input_ids", None), ("labels", [1]), ("seq_lens", lens.to("meta")), ("out", out.as_subclass(_Sub))):
        t = dict(input_ids=z, labels=z, position_ids=z, seq_lens=lens, seq_lens_padded=lens, out=out, host=None)
        t[k] = bad
        assert _C.mimo_run_x(*(t[n] for n in order), *scalars.values()) is NotImplemented, k
    assert bool((out == -7).all())
    with pytest.raises(TypeError, match=r"mimo_run_x\(\) takes 14 arguments \(13 given\)"):
        _C.mimo_run_x(*(None,) * 13)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
@pytest.mark.parametrize("meta_on", ["cpu", "cuda"])
@pytest.mark.parametrize("C", [1, 4])
def test_cuda_mimo_fast_path_matches_capsules_on_a_side_stream(C, meta_on, monkeypatch, ncp_seed):
    """On the GPU, tokens written on a side stream after a queued spin: the fast path's kernel runs on
    that (current) stream, so it reads the written tokens; its outputs equal the capsule path's."""
    mesh = FakeCPMesh(4, 1)
    g = torch.Generator().manual_seed(ncp_seed)
    batch = make_mimo_batch(8, 256, num_chunks=C, cp_size=4, generator=g, docs_per_row=(1, 3), image_token_id=5,
                            video_token_id=6, media_fraction=0.2)  # fmt: skip
    on_gpu = {key: t.cuda() for key, t in batch.items()
              if isinstance(t, torch.Tensor) and (key not in ("seq_lens", "seq_lens_padded") or meta_on == "cuda")}
    outcomes = []
    for fast in (True, False):
        monkeypatch.setattr(M, "_X", fast)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = {key: torch.zeros_like(on_gpu[key]) if key in on_gpu else t for key, t in batch.items()}
            torch.cuda._sleep(50_000_000)
            for key, t in on_gpu.items():  # device to device, queued behind the spin on the side stream
                b[key].copy_(t)
            with fake_dist(mesh):
                outcomes.append(call(M.shard_batch_for_mimo_te, mesh, None, b, num_chunks=C))
            assert M.fast_path_info()["path"] == "native", M.fast_path_info()
        side.synchronize()
    assert outcomes[0][0] == "ok"
    assert_same_outcome(*outcomes)
    with fake_dist(mesh):  # and both are the CPU batch's result, moved
        want = call(M.shard_batch_for_mimo_te, mesh, None, dict(batch), num_chunks=C)
    assert want[0] == "ok"
    got_batch, want_batch = outcomes[0][1][1], want[1][1]  # (context, prepared batch, layout)
    assert got_batch.keys() == want_batch.keys()
    for key, v in want_batch.items():
        if isinstance(v, torch.Tensor) and key not in ("seq_lens", "seq_lens_padded"):
            assert torch.equal(got_batch[key].cpu(), v), key
