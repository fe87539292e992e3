"""CPU sink attention (``nemo_cp_native.sink_attention`` on the C backend, csrc/cpu/sink_attn.c).

Against the float64 oracle (``reference.sink_attention``) with the tolerance rule of STYLE.md
item 10; sinks drawn in [-4, 4]; documents shorter than, equal to and longer than the window,
length-1 documents, GQA 1/4/8, windows 0/1/128/513; rows without keys (table mask); poisoned
outputs in guarded buffers; bitwise determinism; fp64 gradcheck; opcheck of the custom ops;
torch.compile; and argument validation (every error names its argument).

Keep it fast: the C kernel is scalar double-precision, so T * T * Hq * D stays small here.
Reproduce a failure with ``NCP_TEST_SEED=<seed printed in the report>``.
"""

from __future__ import annotations

import os

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native._ops import _C, dl
from nemo_cp_native.attention import AttnMask, SinkAttnFunc, attn_backward, attn_forward
from nemo_cp_native.reference.sink_attention import attention_ref, attention_table_ref, sink_grad_closed_form
from nemo_cp_native.reference.tolerance import assert_close_to_ref, assert_close_to_ref_ulp
from nemo_cp_native.testing import doc_lengths, make_attention_case, pack_documents

from _attn_checks import check_dsink, d_rounding_allowance, guarded, guards_intact

F64 = torch.float64


def _gen(seed: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1009 + salt)


def _leaves(c, sink=True, sink_dtype=None):
    ts = [c["q"], c["k"], c["v"]] + ([c["sink"] if sink_dtype is None else c["sink"].to(sink_dtype)] if sink else [])
    return [t.detach().clone().requires_grad_() for t in ts]


def _lp_dtype(dtype):
    """The low-precision run that sets the tolerance. For float64 the naive float64 run IS the
    reference (zero error, an empty budget), so a float64 kernel is held to twice the error of
    the naive float32 run (inputs rounded to float32)."""
    return torch.float32 if dtype == F64 else dtype


def _oracle(leaves, cu, window, scale, dout, upcast):
    """(out, lse, grads) of the oracle: float64 autograd (upcast) or the naive low-precision run."""
    if upcast:
        ls = [t.detach().double().requires_grad_() for t in leaves]
        d = dout.double()
    else:
        lp = _lp_dtype(leaves[0].dtype)
        ls = [t.detach().to(lp).requires_grad_() for t in leaves[:3]]
        ls += [t.detach().float().requires_grad_() for t in leaves[3:]]
        d = dout.to(lp)
    sink = ls[3] if len(ls) == 4 else None
    out, lse = attention_ref(ls[0], ls[1], ls[2], sink, cu, window=window, scale=scale, upcast=upcast)
    grads = torch.autograd.grad(out, ls, d)
    return out.detach(), lse.detach(), grads, d


def check_against_oracle(c, window, g, *, sink=True, sink_dtype=None, scale=None, name=""):
    """Runs sink_attention forward + backward on the case and checks every output against the
    float64 oracle with the tolerance rule (out/dq/dk/dv: max-norm rule; lse: ulp rule; dsink:
    check_dsink)."""
    leaves = _leaves(c, sink, sink_dtype)
    cu = c["cu_seqlens"]
    s = leaves[3] if sink else None
    out, lse = ncp.sink_attention(*leaves[:3], s, cu, window=window, scale=scale, return_lse=True)
    assert out.dtype == c["q"].dtype and out.shape == c["q"].shape
    assert lse.dtype == torch.float32 and lse.shape == (c["q"].shape[1], c["q"].shape[0])
    dout = torch.randn(out.shape, generator=g, dtype=torch.float32).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    for a, t in zip(grads, leaves):
        assert a.dtype == t.dtype and a.shape == t.shape

    ref, ref_lse, ref_grads, _ = _oracle(leaves, cu, window, scale, dout, True)
    lp, lp_lse, lp_grads, lp_dout = _oracle(leaves, cu, window, scale, dout, False)
    assert_close_to_ref(out, ref, lp, name=f"{name} out")
    assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name=f"{name} lse")
    allow = d_rounding_allowance(lambda *t: attention_ref(*t[:3], t[3] if sink else None, cu, window=window, scale=scale),
                                 leaves, dout, out.dtype)  # fmt: skip
    for n, a, r, l, al in zip(("dq", "dk", "dv"), grads, ref_grads, lp_grads, allow):
        assert_close_to_ref(a, r, l, name=f"{name} {n}", allowance=al)
    if sink:
        # The low-precision run computes D_i = <dO_i, O_i> from its rounded output (spec 5.7).
        lp_dsink = sink_grad_closed_form(lp, lp_dout, lp_lse, leaves[3].detach())
        check_dsink(grads[3], out.detach(), lse, dout, leaves[3].detach(), ref_grads[3], lp_dsink, name=f"{name} dsink")
    return out.detach(), lse, grads


# ------------------------------------------------------------------------------------------
# against the oracle
# ------------------------------------------------------------------------------------------

CASES = [
    # (doc mode, mean doc length for "random", total, Hq, Hkv, D, window)
    ("one", 0, 320, 4, 4, 64, 0),  # one document, GQA 1, full causal
    ("random", 200, 500, 8, 1, 16, 0),  # GQA 8, documents of 1..399 tokens
    ("window", 0, 520, 4, 1, 32, 128),  # documents of 127, 128, 129, 1, 256 tokens (W-1, W, W+1, 1, 2W)
    ("window", 0, 1100, 2, 2, 16, 513),  # the Flint window: 512, 513, 514, 1, 1026
    ("random", 150, 300, 8, 2, 40, 1),  # window 1: every token sees only itself; a head dim CUDA lacks
    ("random", 250, 500, 4, 1, 32, 128),  # GQA 4, documents longer and shorter than W
    ("tiny", 0, 150, 4, 2, 64, 0),  # documents of 1-3 tokens
]
# fp16 on a subset: the C kernel's fp16 loads (ldexp per element) are ~8x slower than bf16's.
_FP16 = {1, 2, 6}
_PARAMS = [
    pytest.param(c, dt, id=f"{c[0]}-T{c[2]}-{c[3]}x{c[4]}-d{c[5]}-w{c[6]}-{str(dt)[6:]}")
    for i, c in enumerate(CASES)
    for dt in (torch.bfloat16, torch.float32) + ((torch.float16,) if i in _FP16 else ())
]


@pytest.mark.parametrize("case,dtype", _PARAMS)
def test_matches_oracle(case, dtype, ncp_seed):
    mode, mean, total, hq, hkv, d, window = case
    g = _gen(ncp_seed)
    lengths = doc_lengths(total, mode, window=window, generator=g, mean=mean or 64)
    c = make_attention_case(lengths, hq, hkv, d, dtype=dtype, generator=g)
    check_against_oracle(c, window, g, name=f"{dtype} {lengths[:8]}")


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("sink_dtype", [torch.float32, F64])
def test_float64_matches_oracle(window, sink_dtype, ncp_seed):
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(90, "random", generator=g, mean=20), 4, 2, 16, dtype=F64, generator=g)
    _, _, grads = check_against_oracle(c, window, g, sink_dtype=sink_dtype, name="f64")
    assert grads[3].dtype == sink_dtype


def test_float64_honours_the_scale_exactly(ncp_seed):
    """With float64 inputs the kernel must be closer to the exact-scale oracle than rounding the
    scale to float32 would move the answer (D = 8: D**-0.5 is not a float32)."""
    g = _gen(ncp_seed)
    c = make_attention_case([7, 9, 4], 2, 1, 8, dtype=F64, generator=g)
    args = (c["q"], c["k"], c["v"], c["sink"])
    out = ncp.sink_attention(*args, c["cu_seqlens"])
    exact, _ = attention_ref(*args, c["cu_seqlens"], scale=8**-0.5)
    rounded, _ = attention_ref(*args, c["cu_seqlens"], scale=float(torch.tensor(8**-0.5, dtype=torch.float32)))
    shift = (exact - rounded).abs().max()
    assert shift > 0
    assert (out - exact).abs().max() < shift / 2, "float64 output moved by the float32 rounding of scale"


def test_no_sink_and_length_one_documents(ncp_seed):
    g = _gen(ncp_seed)
    for sink, window in ((False, 0), (True, 3), (False, 130)):
        c = make_attention_case([1, 1, 5, 1, 140, 1, 64, 1, 135, 1], 4, 1, 32, generator=g)
        check_against_oracle(c, window, g, sink=sink, name=f"sink={sink} w={window}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_one_without_sink_is_the_identity_on_v(dtype, ncp_seed):
    """Window 1, no sink: each token attends to itself alone with P = 1, so exactly O = v (per
    GQA group), lse = scale <q_i, k_i>, dv = dO and dq = dk = 0 (D_i = <dO_i, v_i> = dP_ii).
    Exact comparisons: products of 16-bit floats and their short sums are exact in double."""
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(300, "random", generator=g), 4, 2, 32, dtype=dtype, generator=g)
    q, k, v = _leaves(c, sink=False)
    out, lse = ncp.sink_attention(q, k, v, None, c["cu_seqlens"], window=1, return_lse=True)
    assert torch.equal(out, v.detach().repeat_interleave(2, dim=1))
    z = torch.einsum("thd,thd->ht", q.detach().double(), k.detach().double().repeat_interleave(2, dim=1))
    assert torch.equal(lse, (z * 32**-0.5).float())
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert not dq.any() and not dk.any()
    assert torch.equal(dv, dout.view(-1, 2, 2, 32).double().sum(2).to(dtype))


def test_zero_sink_versus_no_sink(ncp_seed):
    """A sink of 0 adds exp(0) = 1 to every denominator: lse = logaddexp(lse', 0) and O = O'
    sigmoid(lse'), nothing else. The difference of the kernel's two runs must equal the oracle's
    difference (tolerance rule on the difference). A very negative sink changes nothing at all,
    bit for bit, and gets a zero gradient."""
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(400, "window", window=128, generator=g), 4, 1, 32, dtype=torch.float32,
                            generator=g)  # fmt: skip
    q, k, v, cu = c["q"], c["k"], c["v"], c["cu_seqlens"]
    zero = torch.zeros(4)
    o0, l0 = ncp.sink_attention(q, k, v, zero, cu, window=128, return_lse=True)
    on, ln = ncp.sink_attention(q, k, v, None, cu, window=128, return_lse=True)
    r0, _ = attention_ref(q.double(), k.double(), v.double(), zero, cu, window=128)
    rn, rln = attention_ref(q.double(), k.double(), v.double(), None, cu, window=128)
    p0, pl0 = attention_ref(q, k, v, zero, cu, window=128, upcast=False)
    pn, pln = attention_ref(q, k, v, None, cu, window=128, upcast=False)
    assert_close_to_ref(o0.double() - on.double(), r0 - rn, p0.double() - pn.double(), name="O(sink 0) - O(no sink)")
    assert_close_to_ref_ulp(l0, torch.logaddexp(rln, torch.zeros(())), pl0.double(), name="lse(sink 0)")
    assert bool((l0 >= ln).all()), "a zero sink can only raise lse"

    leaves = _leaves(c, sink=False)
    dout = torch.randn(on.shape, generator=g)
    plain = torch.autograd.grad(ncp.sink_attention(*leaves, None, cu, window=128), leaves, dout)
    neg = torch.full((4,), -1e4, requires_grad=True)
    o_neg = ncp.sink_attention(*leaves, neg, cu, window=128)
    assert torch.equal(o_neg, on)
    with_neg = torch.autograd.grad(o_neg, leaves + [neg], dout)
    for a, b in zip(plain, with_neg[:3]):
        assert torch.equal(a, b)
    assert not with_neg[3].any()


def test_large_sinks_drive_output_to_zero(ncp_seed):
    """Spec 5.7: P_sink -> 1 and O -> 0 for a large positive sink, finite everywhere; a sink of
    1e4 leaves exp(z - 1e4) = 0 in double, so O = 0 and lse = 1e4 exactly."""
    g = _gen(ncp_seed)
    c = make_attention_case([50, 70], 3, 1, 16, dtype=torch.float32, generator=g)
    big = torch.tensor([30.0, 60.0, 1e4])
    q, k, v, cu = c["q"], c["k"], c["v"], c["cu_seqlens"]
    out, lse = ncp.sink_attention(q, k, v, big, cu, return_lse=True)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), big, cu)
    lp, lp_lse = attention_ref(q, k, v, big, cu, upcast=False)
    assert_close_to_ref(out, ref, lp, name="out")
    assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse")
    assert torch.equal(lse[2], torch.full_like(lse[2], 1e4)) and not out[:, 2].any()


@pytest.mark.parametrize("scale", [None, 0.3, 1])
def test_scale(scale, ncp_seed):
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(200, "random", generator=g), 4, 2, 32, dtype=torch.float32, generator=g)
    args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
    out = ncp.sink_attention(*args, window=50, scale=scale)
    if scale is None:
        assert torch.equal(out, ncp.sink_attention(*args, window=50, scale=32**-0.5))
    ref, _ = attention_ref(*(t.double() for t in args[:3]), c["sink"], c["cu_seqlens"], window=50, scale=scale)
    lp, _ = attention_ref(*args, window=50, scale=scale, upcast=False)
    assert_close_to_ref(out, ref, lp, name=f"out scale={scale}")
    if scale is not None:
        default = ncp.sink_attention(*args, window=50)
        assert not torch.equal(out, default), "the explicit scale was ignored"


def test_return_lse_and_dtypes(ncp_seed):
    g = _gen(ncp_seed)
    c = make_attention_case([30, 1, 20], 4, 2, 16, dtype=torch.bfloat16, generator=g)
    q, k, v, s = _leaves(c)
    out = ncp.sink_attention(q, k, v, s, c["cu_seqlens"])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == q.shape
    res = ncp.sink_attention(q, k, v, s, c["cu_seqlens"], return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    assert torch.equal(res[0], out)
    assert res[1].dtype == torch.float32 and res[1].shape == (4, 51) and not res[1].requires_grad
    dq, dk, dv, ds = torch.autograd.grad(out.float().sum(), (q, k, v, s))
    assert (dq.dtype, dk.dtype, dv.dtype, ds.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)


def test_strided_inputs_and_dout(ncp_seed):
    """Non-contiguous q/k/v (slices of a packed qkv tensor) and an expanded dout give bit-equal
    results to contiguous ones, through sink_attention and straight into the C kernel."""
    g = _gen(ncp_seed)
    T, Hq, Hkv, D = 120, 4, 2, 16
    cu = pack_documents(doc_lengths(T, "random", generator=g, mean=40))
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=g)
    sink = (torch.rand(Hq, generator=g) * 8 - 4).requires_grad_()
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
    assert not q.is_contiguous()
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    mask = AttnMask(cu_seqlens=cu, window=17)
    o1, l1 = attn_forward(q, k, v, sink, mask, 0.25)  # strides go to C as they are
    o2, l2 = attn_forward(qc, kc, vc, sink, mask, 0.25)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    leaves = [t.clone().requires_grad_() for t in (qkv,)]
    pk = leaves[0]
    out = ncp.sink_attention(pk[:, :Hq], pk[:, Hq : Hq + Hkv], pk[:, Hq + Hkv :], sink, cu, window=17)
    (g1, gs1) = torch.autograd.grad(out.sum(), (pk, sink))  # dout is an expanded (stride 0) tensor
    ql, kl, vl = (t.clone().requires_grad_() for t in (qc, kc, vc))
    out2 = ncp.sink_attention(ql, kl, vl, sink, cu, window=17)
    assert torch.equal(out, out2)
    g2 = torch.autograd.grad(out2, (ql, kl, vl, sink), torch.ones_like(out2))
    assert torch.equal(g1, torch.cat(g2[:3], dim=1)) and torch.equal(gs1, g2[3])


# ------------------------------------------------------------------------------------------
# table mask (CP): rows that see no key
# ------------------------------------------------------------------------------------------


def _table_case(g, tq, tk, hq, hkv, d, dtype, all_empty=False):
    """Non-decreasing row bounds with empty rows (lo > hi), among them the first, and keys nobody sees."""
    lo = torch.randint(0, 3 * tk // 4, (tq,), generator=g).sort().values
    hi = (lo + torch.randint(-8, tk // 4, (tq,), generator=g)).clamp(-1, tk - 1).cummax(0).values
    hi[0] = -1  # at least one row sees nothing (hi stays non-decreasing: -1 is the least bound)
    if all_empty:
        lo, hi = torch.full((tq,), tk // 2), torch.full((tq,), tk // 2 - 1)
    mask = AttnMask(row_lo=lo.to(torch.int32), row_hi=hi.to(torch.int32))
    c = make_attention_case([tq], hq, hkv, d, dtype=dtype, generator=g)
    kc = make_attention_case([tk], hkv, hkv, d, dtype=dtype, generator=g)
    j = torch.arange(tk)
    seen = (j[None, :] >= lo[:, None]) & (j[None, :] <= hi[:, None])  # [tq, tk]
    return c["q"], kc["k"], kc["v"], c["sink"], mask, seen


def test_table_window_hint_changes_nothing_and_is_checked(ncp_seed):
    """A table's ``window`` is a kernel-choice hint: the same outputs and gradients bit for bit with
    and without it, and a negative one is a ValueError naming it."""
    import dataclasses

    g = _gen(ncp_seed)
    q, k, v, s, mask, _ = _table_case(g, 90, 70, 4, 2, 16, torch.bfloat16)
    hinted = dataclasses.replace(mask, window=17)
    out, lse = attn_forward(q, k, v, s, mask, 0.25)
    out_h, lse_h = attn_forward(q, k, v, s, hinted, 0.25)
    assert torch.equal(out, out_h) and torch.equal(lse, lse_h)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    grads = attn_backward(dout, q, k, v, s, out, lse, mask, 0.25)
    grads_h = attn_backward(dout, q, k, v, s, out, lse, hinted, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_h))
    with pytest.raises(ValueError, match="window must be >= 0"):
        attn_forward(q, k, v, s, dataclasses.replace(mask, window=-1), 0.25)


@pytest.mark.parametrize("all_empty", [False, True])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_table_mask_rows_without_keys(dtype, sink, all_empty, ncp_seed):
    g = _gen(ncp_seed)
    q, k, v, s, mask, seen = _table_case(g, 90, 70, 4, 2, 16, dtype, all_empty)
    s = s if sink else None
    empty, unseen = ~seen.any(1), ~seen.any(0)
    assert bool(empty.any()) and (all_empty or not bool(empty.all()))
    scale = 0.25
    out, lse = attn_forward(q, k, v, s, mask, scale)
    assert not out[empty].any(), "a row that sees nothing must output exactly 0"
    want = s[:, None].expand(-1, q.shape[0]) if sink else torch.full((4, q.shape[0]), float("-inf"))
    assert torch.equal(lse[:, empty], want[:, empty]), "a row that sees nothing must have lse = sink (or -inf)"

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)] + ([s.double().requires_grad_()] if sink else [])
    pos = (mask.row_lo, mask.row_hi)
    ref, ref_lse = attention_table_ref(*leaves[:3], leaves[3] if sink else None, *pos, scale=scale)
    lp, lp_lse = attention_table_ref(q, k, v, s, *pos, scale=scale, upcast=False)
    assert_close_to_ref(out, ref, lp, name="out")
    assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse")

    dout = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv, ds = attn_backward(dout, q, k, v, s, out, lse, mask, scale)
    assert not dq[empty].any() and not dk[unseen].any() and not dv[unseen].any()
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    lpl = [t.detach().clone().requires_grad_() for t in (q, k, v)] + ([s.clone().requires_grad_()] if sink else [])
    lp2, lp_lse2 = attention_table_ref(*lpl[:3], lpl[3] if sink else None, *pos, scale=scale, upcast=False)
    lp_grads = torch.autograd.grad(lp2, lpl, dout)
    allow = d_rounding_allowance(lambda *t: attention_table_ref(*t[:3], t[3] if sink else None, *pos, scale=scale),
                                 [q, k, v] + ([s] if sink else []), dout, dtype)  # fmt: skip
    for n, a, r, l, al in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, lp_grads, allow):
        assert_close_to_ref(a, r, l, name=n, allowance=al)
    if sink:
        assert ds.dtype == torch.float32
        lp_dsink = sink_grad_closed_form(lp2.detach(), dout, lp_lse2.detach(), s)
        check_dsink(ds, out, lse, dout, s, ref_grads[3], lp_dsink)
        if all_empty:
            assert not ds.any()
    else:
        assert ds is None


# ------------------------------------------------------------------------------------------
# poisoned outputs, guard bands, determinism
# ------------------------------------------------------------------------------------------


def _poisoned_fwd(q, k, v, s, mask: AttnMask, scale):
    T, Hq, D = q.shape
    ob, out, pad = guarded((T, Hq, D), q.dtype, float("nan"))
    lb, lse, _ = guarded((Hq, T), torch.float32, float("nan"))
    _C.sink_attn_fwd(q=dl(q), k=dl(k), v=dl(v), sink=dl(s), out=dl(out), lse=dl(lse), scale=scale, **mask.kwargs())
    assert not out.isnan().any() and not lse.isnan().any(), "an output element was never written"
    assert guards_intact(ob, pad) and guards_intact(lb, pad), "a guard band was overwritten"
    return out, lse


def _poisoned_bwd(q, k, v, s, out, lse, dout, mask: AttnMask, scale):
    T, Hq, _ = q.shape
    bufs = [guarded(t.shape, t.dtype, float("nan")) for t in (q, k, v)]
    sb = guarded((Hq,), s.dtype, float("nan")) if s is not None else None
    _C.sink_attn_bwd(q=dl(q), k=dl(k), v=dl(v), sink=dl(s), out=dl(out), lse=dl(lse), dout=dl(dout), dq=dl(bufs[0][1]),
                     dk=dl(bufs[1][1]), dv=dl(bufs[2][1]), dsink=dl(sb[1] if sb else None), scale=scale,
                     deterministic=1, **mask.kwargs())  # fmt: skip
    for b, t, p in bufs + ([sb] if sb else []):
        assert not t.isnan().any(), "an output element was never written"
        assert guards_intact(b, p), "a guard band was overwritten"
    return [b[1] for b in bufs] + [sb[1] if sb else None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, F64])
def test_poisoned_outputs_and_guards(dtype, ncp_seed):
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(160, "window", window=20, generator=g), 4, 2, 16, dtype=dtype, generator=g)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    if dtype == F64:
        s = s.double()
    mask = AttnMask(cu_seqlens=cu, window=20)
    out, lse = _poisoned_fwd(q, k, v, s, mask, 0.25)
    e_out, e_lse = attn_forward(q, k, v, s, mask, 0.25)
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv, ds = _poisoned_bwd(q, k, v, s, out, lse, dout, mask, 0.25)
    for a, b in zip((dq, dk, dv, ds), attn_backward(dout, q, k, v, s, out, lse, mask, 0.25)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sink", [True, False])
def test_poisoned_outputs_table_mask(sink, ncp_seed):
    """Rows without keys are written too (out 0, lse = sink or -inf, dq 0) and so are keys
    nobody sees (dk = dv = 0)."""
    g = _gen(ncp_seed)
    q, k, v, s, mask, seen = _table_case(g, 60, 50, 4, 1, 16, torch.bfloat16)
    s = s if sink else None
    out, lse = _poisoned_fwd(q, k, v, s, mask, 0.25)
    e_out, e_lse = attn_forward(q, k, v, s, mask, 0.25)
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse)
    dout = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    dq, dk, dv, ds = _poisoned_bwd(q, k, v, s, out, lse, dout, mask, 0.25)
    empty, unseen = ~seen.any(1), ~seen.any(0)
    assert not dq[empty].any() and not dk[unseen].any() and not dv[unseen].any()
    ref = attn_backward(dout, q, k, v, s, out, lse, mask, 0.25)
    for a, b in zip((dq, dk, dv, ds), ref):
        assert (a is None and b is None) or torch.equal(a, b)


def test_backward_is_deterministic(ncp_seed):
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(500, "random", mean=150, generator=g), 8, 2, 32, generator=g,
                            requires_grad=True)  # fmt: skip
    dout = torch.randn(c["q"].shape, generator=g).to(torch.bfloat16)
    runs = []
    for _ in range(2):
        out = ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"], window=128)
        runs.append((out,) + torch.autograd.grad(out, (c["q"], c["k"], c["v"], c["sink"]), dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_backward_determinism_switches(monkeypatch):
    """torch's deterministic mode or NCP_DETERMINISTIC=1 select the bitwise-repeatable backward."""
    from nemo_cp_native.attention import backward_is_deterministic

    monkeypatch.delenv("NCP_DETERMINISTIC", raising=False)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not backward_is_deterministic()
        monkeypatch.setenv("NCP_DETERMINISTIC", "1")
        assert backward_is_deterministic()
        monkeypatch.setenv("NCP_DETERMINISTIC", "0")
        assert not backward_is_deterministic()
        os.environ["NCP_DETERMINISTIC"] = "1"  # set and deleted at run time, outside monkeypatch too
        assert backward_is_deterministic()
        del os.environ["NCP_DETERMINISTIC"]
        assert not backward_is_deterministic()
        monkeypatch.setattr(os, "environ", {"NCP_DETERMINISTIC": "1"})  # os.environ swapped for a plain dict
        assert backward_is_deterministic()
        os.environ["NCP_DETERMINISTIC"] = "2"
        assert not backward_is_deterministic()
        monkeypatch.undo()
        torch.use_deterministic_algorithms(True)
        assert backward_is_deterministic()
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("bad", ["dtype", "ndim", "layout"])
def test_bwd_rejects_bad_workspace(bad, ncp_seed):
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(100, "random", mean=40, generator=g), 4, 2, 16, generator=g)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    out, lse = attn_forward(q, k, v, s, AttnMask(cu_seqlens=cu, window=0), 0.25)
    ws = {"dtype": torch.zeros(64, dtype=torch.float64), "ndim": torch.zeros(8, 8),
          "layout": torch.zeros(128)[::2]}[bad]  # fmt: skip
    grads = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match="workspace"):
        _C.sink_attn_bwd(q=dl(q), k=dl(k), v=dl(v), sink=dl(s), out=dl(out), lse=dl(lse), dout=dl(torch.randn_like(out)),
                         dq=dl(grads[0]), dk=dl(grads[1]), dv=dl(grads[2]), dsink=dl(torch.empty_like(s)),
                         workspace=dl(ws), scale=0.25, cu_seqlens=dl(cu))  # fmt: skip


# ------------------------------------------------------------------------------------------
# autograd, custom-op and compiler plumbing
# ------------------------------------------------------------------------------------------


GRADCHECK = [
    # (Hq, Hkv, D, window, sink, fast_mode): full Jacobians on the small ones
    (2, 1, 4, 0, True, False),
    (2, 2, 4, 3, True, False),
    (4, 2, 8, 3, True, True),
    (4, 1, 8, 0, False, True),
    (3, 3, 4, 2, False, False),
    (4, 4, 8, 1, True, True),
]


@pytest.mark.parametrize("hq,hkv,d,window,sink,fast", GRADCHECK)
def test_gradcheck_float64(hq, hkv, d, window, sink, fast, ncp_seed):
    g = _gen(ncp_seed)
    lengths = doc_lengths(12, "random", generator=g, mean=4)
    c = make_attention_case(lengths, hq, hkv, d, dtype=F64, generator=g)
    leaves = _leaves(c, sink, sink_dtype=F64)
    cu = c["cu_seqlens"]

    def f(*ts):
        return ncp.sink_attention(*ts[:3], ts[3] if sink else None, cu, window=window)

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=fast)


@pytest.mark.parametrize("sink", [True, False])
def test_out_only_node_equals_the_two_output_node(sink, ncp_seed):
    """Without ``return_lse`` the graph holds ``_SinkAttnOutFunc`` (one output); its values and
    gradients are bitwise those of ``SinkAttnFunc`` (``return_lse=True``), which the oracle tests
    check."""
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(60, "random", generator=g, mean=20), 4, 2, 16, generator=g)
    cu, dout = c["cu_seqlens"], torch.randn(c["q"].shape, generator=g)
    runs = []
    for return_lse in (False, True):
        leaves = _leaves(c, sink, None)
        got = ncp.sink_attention(*leaves[:3], leaves[3] if sink else None, cu, window=7, return_lse=return_lse)
        out = got[0] if return_lse else got
        assert (out.grad_fn.__class__.__name__ == "_SinkAttnOutFuncBackward") == (not return_lse)
        runs.append((out.detach(), torch.autograd.grad(out, leaves, dout)))
    (o1, g1), (o2, g2) = runs
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_gradcheck_table_mask(ncp_seed):
    """SinkAttnFunc under a table mask, with rows that see nothing."""
    g = _gen(ncp_seed)
    q, k, v, s, mask, seen = _table_case(g, 10, 8, 2, 1, 4, F64)
    assert not bool(seen[0].any())
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    assert torch.autograd.gradcheck(lambda *ts: SinkAttnFunc.apply(*ts, mask, 0.5)[0], tuple(leaves), eps=1e-6,
                                    atol=1e-5, rtol=1e-4)  # fmt: skip


def _op_args(g, sink, window, dtype=torch.float32):
    c = make_attention_case([5, 9, 1, 4], 4, 2, 16, dtype=dtype, generator=g)
    s = c["sink"] if sink else None
    return c["q"], c["k"], c["v"], s, 0.25, c["cu_seqlens"], window


@pytest.mark.parametrize("sink,window", [(True, 0), (True, 3), (False, 0)])
def test_opcheck(sink, window, ncp_seed):
    """torch.library.opcheck runs test_schema, test_autograd_registration, test_faketensor and
    test_aot_dispatch_dynamic on both custom ops."""
    g = _gen(ncp_seed)
    q, k, v, s, scale, cu, w = _op_args(g, sink, window)
    fwd = torch.ops.nemo_cp_native.sink_attn_fwd.default
    bwd = torch.ops.nemo_cp_native.sink_attn_bwd.default
    fargs = (q, k, v, s, scale, cu, w, None, None)
    torch.library.opcheck(fwd, fargs)
    out, lse = fwd(*fargs)
    dout = torch.randn(out.shape, generator=g)
    torch.library.opcheck(bwd, (dout, q, k, v, s, out, lse, scale, cu, w, None, None))
    # inputs that require grad: the ops have no autograd kernel of their own (SinkAttnFunc is above them)
    rq = q.clone().requires_grad_()
    torch.library.opcheck(fwd, (rq,) + fargs[1:], test_utils=("test_schema", "test_autograd_registration"))


def test_opcheck_table_mask(ncp_seed):
    g = _gen(ncp_seed)
    q, k, v, s, mask, _ = _table_case(g, 12, 9, 2, 1, 8, torch.float32)
    f = (None, 0, mask.row_lo, mask.row_hi)
    fwd = torch.ops.nemo_cp_native.sink_attn_fwd.default
    torch.library.opcheck(fwd, (q, k, v, s, 0.5) + f)
    out, lse = fwd(q, k, v, s, 0.5, *f)
    torch.library.opcheck(torch.ops.nemo_cp_native.sink_attn_bwd.default,
                          (torch.randn(out.shape, generator=g), q, k, v, s, out, lse, 0.5) + f)  # fmt: skip


# Dynamo itself reads .grad of the non-leaf output when it resumes after the graph break, and
# torch warns about that (a torch-internal UserWarning, promoted to an error by pyproject).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_matches_eager(backend, ncp_seed):
    """fullgraph=False: the host check of cu_seqlens graph-breaks (.item()); the ops go through
    their fake implementations at trace time and the real ones at run time."""
    import torch._dynamo

    torch._dynamo.reset()
    g = _gen(ncp_seed)
    c = make_attention_case(doc_lengths(64, "random", generator=g, mean=20), 4, 2, 16, dtype=torch.float32,
                            generator=g)  # fmt: skip
    cu = c["cu_seqlens"]

    def f(q, k, v, s):
        out, lse = ncp.sink_attention(q, k, v, s, cu, window=7, return_lse=True)
        return out * 2, lse

    try:
        cf = torch.compile(f, fullgraph=False, backend=backend)
        leaves = _leaves(c)
        out, lse = cf(*leaves)
    except Exception as e:  # noqa: BLE001
        if backend == "inductor" and "compiler" in str(e).lower():
            pytest.skip(f"inductor cannot build C++ here: {type(e).__name__}")
        raise
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, leaves, dout)
    e_leaves = _leaves(c)
    e_out, e_lse = f(*e_leaves)
    e_grads = torch.autograd.grad(e_out, e_leaves, dout)
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse)
    for a, b in zip(grads, e_grads):
        assert torch.equal(a, b)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------


def _base(dtype=torch.float32):
    c = make_attention_case([5, 7, 3], 4, 2, 8, dtype=dtype)
    return dict(q=c["q"], k=c["k"], v=c["v"], sink=c["sink"], cu_seqlens=c["cu_seqlens"])


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32)


BAD = [
    # (id, changes to the base call, exception, message substring)
    ("q int", lambda a: dict(q=a["q"].int(), k=a["k"].int(), v=a["v"].int()), ValueError,
     "q must be float16, bfloat16, float32 or float64 on the CPU"),
    ("q fp8", lambda a: dict(q=a["q"].to(torch.float8_e4m3fn), k=a["k"].to(torch.float8_e4m3fn),
                             v=a["v"].to(torch.float8_e4m3fn)), ValueError, "q"),  # fmt: skip
    ("k dtype", lambda a: dict(k=a["k"].double()), ValueError, "k and v must have the dtype of q"),
    ("v dtype", lambda a: dict(v=a["v"].half()), ValueError, "k and v must have the dtype of q"),
    ("sink fp16", lambda a: dict(sink=a["sink"].half()), ValueError, "sink must be float32"),
    ("sink bf16 q", lambda a: dict(q=a["q"].bfloat16(), k=a["k"].bfloat16(), v=a["v"].bfloat16(),
                                   sink=a["sink"].bfloat16()), ValueError, "sink must be float32"),  # fmt: skip
    ("sink fp64 fp32 q", lambda a: dict(sink=a["sink"].double()), ValueError, "sink must be float32"),
    ("sink int", lambda a: dict(sink=a["sink"].int()), ValueError, "sink must be float32"),
    ("sink shape", lambda a: dict(sink=a["sink"][:3]), ValueError, "sink must have shape (num_heads,) = (4,)"),
    ("sink 2-D", lambda a: dict(sink=a["sink"][None]), ValueError, "sink must be 1-D"),
    ("sink list", lambda a: dict(sink=[0.0] * 4), TypeError, "sink must be a torch.Tensor or None"),
    ("sink strided", lambda a: dict(sink=torch.zeros(8)[::2]), ValueError, "sink must be contiguous"),
    ("heads", lambda a: dict(k=a["k"][:, :1].expand(-1, 3, -1).contiguous(), v=a["v"][:, :1].expand(-1, 3, -1)
                             .contiguous()), ValueError, "multiple of the kv heads"),  # fmt: skip
    ("no kv heads", lambda a: dict(k=a["k"][:, :0], v=a["v"][:, :0]), ValueError, "multiple of the kv heads"),
    ("no q heads", lambda a: dict(q=a["q"][:, :0], sink=None), ValueError, "multiple of the kv heads"),
    ("head dim k/v", lambda a: dict(k=a["k"][..., :4], v=a["v"][..., :4]), ValueError, "k must have shape"),
    ("head dim v", lambda a: dict(v=torch.zeros(15, 2, 16)), ValueError, "v must have shape"),
    ("head dim 0", lambda a: dict(q=a["q"][..., :0], k=a["k"][..., :0], v=a["v"][..., :0]), ValueError, "head_dim"),
    ("kv heads differ", lambda a: dict(v=a["v"][:, :1]), ValueError, "v must have shape"),
    ("kv tokens differ", lambda a: dict(v=a["v"][:-1]), ValueError, "v must have shape"),
    ("k tokens", lambda a: dict(k=a["k"][:-1], v=a["v"][:-1]), ValueError, "q and k must have the same number of tokens"),
    ("q 2-D", lambda a: dict(q=a["q"][0]), ValueError, "q must be 3-D"),
    ("k 4-D", lambda a: dict(k=a["k"][None]), ValueError, "k must be 3-D"),
    ("q list", lambda a: dict(q=a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("k None", lambda a: dict(k=None), TypeError, "k must be a torch.Tensor"),
    ("v array", lambda a: dict(v=a["v"].numpy()), TypeError, "v must be a torch.Tensor"),
    ("cu list", lambda a: dict(cu_seqlens=[0, 5, 12, 15]), TypeError, "cu_seqlens must be a torch.Tensor"),
    ("cu int64", lambda a: dict(cu_seqlens=a["cu_seqlens"].long()), ValueError, "cu_seqlens must be int32"),
    ("cu float", lambda a: dict(cu_seqlens=a["cu_seqlens"].float()), ValueError, "int32"),
    ("cu 2-D", lambda a: dict(cu_seqlens=a["cu_seqlens"][None]), ValueError, "cu_seqlens must be 1-D"),
    ("cu empty", lambda a: dict(cu_seqlens=_i32()), ValueError, "cu_seqlens must have between 1 and"),
    ("cu start", lambda a: dict(cu_seqlens=_i32(1, 5, 15)), ValueError, "cu_seqlens must start at 0"),
    ("cu monotone", lambda a: dict(cu_seqlens=_i32(0, 9, 5, 15)), ValueError, "cu_seqlens must be non-decreasing"),
    ("cu end short", lambda a: dict(cu_seqlens=_i32(0, 5, 14)), ValueError, "cu_seqlens must end at the number"),
    ("cu end long", lambda a: dict(cu_seqlens=_i32(0, 5, 16)), ValueError, "cu_seqlens must end at the number"),
    ("window neg", lambda a: dict(window=-1), ValueError, "window must be an int in [0, 2^31)"),
    ("window float", lambda a: dict(window=3.0), ValueError, "window must be an int"),
    ("window bool", lambda a: dict(window=True), ValueError, "window must be an int"),
    ("window str", lambda a: dict(window="3"), ValueError, "window must be an int"),
    ("window huge", lambda a: dict(window=2**40), ValueError, "window"),
    ("scale nan", lambda a: dict(scale=float("nan")), ValueError, "scale must be finite"),
    ("scale inf", lambda a: dict(scale=float("inf")), ValueError, "scale must be finite"),
    ("scale str", lambda a: dict(scale="0.5"), TypeError, "scale must be a float or None"),
    ("scale bool", lambda a: dict(scale=True), TypeError, "scale must be a float or None"),
    ("q meta", lambda a: dict(q=a["q"].to("meta")), ValueError, "q is a meta tensor"),
    ("cu meta", lambda a: dict(cu_seqlens=a["cu_seqlens"].to("meta")), ValueError, "cu_seqlens is a meta tensor"),
    ("big head dim", lambda a: dict(q=torch.zeros(15, 4, 1100), k=torch.zeros(15, 2, 1100), v=torch.zeros(15, 2, 1100)),
     None, None),
    ("many heads", lambda a: dict(q=torch.zeros(2, 4100, 8), k=torch.zeros(2, 1, 8), v=torch.zeros(2, 1, 8), sink=None,
                                  cu_seqlens=_i32(0, 2)), None, None),
]


@pytest.mark.parametrize("change,exc,msg", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(change, exc, msg):
    """Each bad argument gets a clear exception naming it (exc None: the CPU path takes any head
    dim and head count, so the call must succeed)."""
    a = _base()
    a.update(change(a))
    q, k, v, s, cu = (a.pop(n) for n in ("q", "k", "v", "sink", "cu_seqlens"))
    if exc is None:
        out = ncp.sink_attention(q, k, v, s, cu, **a)
        assert out.shape == q.shape
        return
    with pytest.raises(exc) as ei:
        ncp.sink_attention(q, k, v, s, cu, **a)
    assert msg in str(ei.value), f"{type(ei.value).__name__}: {ei.value}"


def test_doc_mask_is_the_dataclass_built_field_by_field():
    """``sink_attention`` makes its mask without the frozen dataclass's __init__
    (``attention._doc_mask``): the object ``AttnMask(...)`` makes, every field set, still frozen."""
    import dataclasses

    from nemo_cp_native.attention import _doc_mask

    cu = _i32(0, 3, 7)
    made, want = _doc_mask(cu, 5), AttnMask(cu_seqlens=cu, window=5)
    assert type(made) is AttnMask and made == want and repr(made) == repr(want)
    assert set(vars(made)) == {f.name for f in dataclasses.fields(AttnMask)}
    assert all(getattr(made, f.name) is getattr(want, f.name) for f in dataclasses.fields(AttnMask))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.window = 3


@pytest.mark.parametrize("mode", ["docs", "table"])
@pytest.mark.parametrize("which", ["q", "sink", "dout", "mask"])
def test_meta_tensor_is_named_by_the_native_calls(mode, which):
    """``attn_forward`` / ``attn_backward`` (the calls of SinkAttnFunc and of the Flint CP step)
    name a meta tensor among their arguments, for both mask kinds, forward and backward."""
    a = _base()
    q, k, v, s, cu = a["q"], a["k"], a["v"], a["sink"], a["cu_seqlens"]
    T = q.shape[0]
    lo, hi = torch.zeros(T, dtype=torch.int32), torch.arange(T, dtype=torch.int32)
    mask = AttnMask(cu_seqlens=cu, window=3) if mode == "docs" else AttnMask(row_lo=lo, row_hi=hi)
    out, lse = attn_forward(q, k, v, s, mask, 0.5)
    dout = torch.ones_like(out)
    meta = lambda t: t.to("meta")  # noqa: E731
    name = {"q": "q", "sink": "sink", "dout": "dout", "mask": "cu_seqlens" if mode == "docs" else "row_lo"}[which]
    if which == "mask":
        mask = AttnMask(cu_seqlens=meta(cu), window=3) if mode == "docs" else AttnMask(row_lo=meta(lo), row_hi=hi)
    q2, s2, dout2 = (meta(q) if which == "q" else q), (meta(s) if which == "sink" else s), (
        meta(dout) if which == "dout" else dout)  # fmt: skip
    if which != "dout":
        with pytest.raises(ValueError, match=f"^{name} is a meta tensor"):
            attn_forward(q2, k, v, s2, mask, 0.5)
    with pytest.raises(ValueError, match=f"^{name} is a meta tensor"):
        attn_backward(dout2, q2, k, v, s2, out, lse, mask, 0.5)


def test_native_boundary_names_the_argument():
    """The C module checks what the Python wrapper cannot vouch for when its ops are called
    directly (cu_seqlens and table contents, output buffers, the mask fields, keyword names)."""
    a = _base()
    q, k, v, s, cu = a["q"], a["k"], a["v"], a["sink"], a["cu_seqlens"]
    out, lse = torch.empty_like(q), torch.empty(4, 15)

    def fwd(**kw):
        args = dict(q=q, k=k, v=v, sink=s, out=out, lse=lse, cu_seqlens=cu)
        args.update(kw)
        caps = {n: (dl(t) if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
        caps.setdefault("scale", 0.5)
        _C.sink_attn_fwd(**caps)

    fwd()  # the base call is fine
    cases = [
        (dict(cu_seqlens=_i32(0, 9, 5, 15)), ValueError, "cu_seqlens must be non-decreasing"),
        (dict(cu_seqlens=_i32(2, 15)), ValueError, "cu_seqlens must start at 0"),
        (dict(cu_seqlens=_i32(0, 14)), ValueError, "cu_seqlens must end"),
        (dict(cu_seqlens=cu.long()), ValueError, "cu_seqlens must be int32"),
        (dict(window=-2), ValueError, "window must be >= 0"),
        (dict(cu_seqlens=None), ValueError, "give either cu_seqlens"),
        (dict(row_lo=_i32(*range(15)), row_hi=_i32(*range(15))), ValueError, "not both"),
        (dict(cu_seqlens=None, row_lo=_i32(*range(15)), row_hi=_i32(*range(14, -1, -1))), ValueError,
         "row_lo and row_hi must be non-decreasing"),
        (dict(cu_seqlens=None, row_lo=_i32(*range(15)), row_hi=_i32(*range(14))), ValueError, "row_hi must have shape"),
        (dict(cu_seqlens=None, row_lo=_i32(*range(15)), row_hi=_i32(*range(1, 16))), ValueError, "must lie in"),
        (dict(out=torch.empty(15, 4, 8, dtype=torch.float64)), ValueError, "out must be float32"),
        (dict(out=torch.empty(15, 4, 7)), ValueError, "out must have shape"),
        (dict(lse=torch.empty(15, 4)), ValueError, "lse must have shape"),
        (dict(lse=torch.empty(4, 15, dtype=torch.float64)), ValueError, "lse must be float32"),
        (dict(sink=torch.zeros(3)), ValueError, "sink must have shape"),
        (dict(k=k.double()), ValueError, "k and v must have the dtype of q"),
        (dict(v=v[:, :1]), ValueError, "v must have shape"),
        (dict(scale=float("inf")), ValueError, "scale must be finite"),
        (dict(scale=True), TypeError, "scale must be a float"),
        (dict(window=2**63), ValueError, "window=9223372036854775808 does not fit"),
        (dict(bogus=1), TypeError, "unexpected keyword argument 'bogus'"),
        (dict(q=None), ValueError, "q must be a tensor, not None"),
        (dict(stream="x"), TypeError, ""),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc) as ei:
            fwd(**kw)
        assert msg in str(ei.value), f"{kw}: {type(ei.value).__name__}: {ei.value}"
    with pytest.raises(TypeError, match="keyword arguments only"):
        _C.sink_attn_fwd(dl(q))
    with pytest.raises(TypeError, match="missing required keyword argument 'lse'"):
        _C.sink_attn_fwd(q=dl(q), k=dl(k), v=dl(v), out=dl(out), scale=0.5, cu_seqlens=dl(cu))


def test_attn_debug_hooks_check_their_values():
    """The dispatcher's test hooks name a bad value and leave the hooks as they were."""
    before = _C.attn_debug()
    with pytest.raises(ValueError, match="order_waves must be >= -1"):
        _C.attn_debug(order_waves=-2)
    with pytest.raises(ValueError, match="grid must be >= 0"):
        _C.attn_debug(grid=-1)
    assert _C.attn_debug() == before


def test_attn_debug_clears_the_workspace_size_cache():
    """The hooks change which kernels a backward takes, and so the workspace size a shape needs:
    entering and leaving attn_debug drops the cached sizes (a size cached under the portable hook
    was too small for the Hopper backward of the same shape, which then refused the call)."""
    from nemo_cp_native import attention
    from nemo_cp_native.testing import attn_debug

    attention._ws_bytes[("sentinel",)] = 1
    with attn_debug(portable=True):
        assert attention._ws_bytes == {}
        attention._ws_bytes[("inside",)] = 1
    assert attention._ws_bytes == {}


def test_bwd_workspace_size_checks_its_arguments():
    """The workspace query names a negative size before asking any device."""
    good = dict(Tq=8, Tk=8, Hq=4, D=64, has_sink=1, deterministic=0, device=0)
    for name, bad, least in (("Tq", -1, 0), ("Tk", -5, 0), ("Hq", 0, 1), ("D", 0, 1), ("device", -1, 0),
                             ("window", -1, 0)):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be >= {least}; got {bad}"):
            _C.sink_attn_bwd_workspace(**{**good, name: bad})
    with pytest.raises(TypeError, match="missing required keyword argument 'Tk'"):
        _C.sink_attn_bwd_workspace(**{k: v for k, v in good.items() if k != "Tk"})
    with pytest.raises(ValueError, match="window must be >= 0; got -3"):
        _C.sink_attn_kernels(window=-3)
    with pytest.raises(ValueError, match="D must be >= 1; got 0"):
        _C.sink_attn_kernels(D=0)


@pytest.mark.parametrize("sink", [True, False])
def test_empty_batch(sink):
    """T = 0, cu_seqlens = [0]: empty outputs and zero gradients (empty tensors have NULL data
    pointers, which the native checks reject, so the ops must not call them)."""
    q = torch.randn(0, 4, 8, requires_grad=True)
    k = torch.randn(0, 2, 8, requires_grad=True)
    v = torch.randn(0, 2, 8, requires_grad=True)
    s = torch.randn(4, requires_grad=True) if sink else None
    out, lse = ncp.sink_attention(q, k, v, s, _i32(0), window=3, return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0) and lse.dtype == torch.float32
    leaves = (q, k, v) + ((s,) if sink else ())
    grads = torch.autograd.grad(out.sum(), leaves)
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    if sink:
        assert torch.equal(grads[3], torch.zeros(4))


@pytest.mark.cuda
def test_cuda_bad_input():
    c = make_attention_case([100, 28], 4, 2, 64, device="cuda")
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    for bad, msg in (
        (dict(k=k.cpu()), "k must be on the device of q"),
        (dict(sink=s.cpu()), "sink must be on the device of q"),
        (dict(cu_seqlens=cu.cpu()), "cu_seqlens must be on the device of q"),
        (dict(q=q.float(), k=k.float(), v=v.float()), "q must be float16 or bfloat16 on CUDA"),
        (dict(q=q[..., :32].contiguous(), k=k[..., :32].contiguous(), v=v[..., :32].contiguous()),
         "head_dim must be 64 or 128 on CUDA"),
    ):  # fmt: skip
        a = dict(q=q, k=k, v=v, sink=s, cu_seqlens=cu)
        a.update(bad)
        with pytest.raises(ValueError) as ei:
            ncp.sink_attention(a["q"], a["k"], a["v"], a["sink"], a["cu_seqlens"])
        assert msg in str(ei.value), str(ei.value)


def test_autograd_node_only_when_something_requires_grad(ncp_seed):
    """No-grad calls (or inputs that need no grad) skip the autograd node and give the same values;
    any input that requires grad under grad mode gets the node and its gradient."""
    g = torch.Generator().manual_seed(ncp_seed)
    c = make_attention_case([37, 90], 4, 2, 16, dtype=torch.float32, generator=g)
    args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
    plain = ncp.sink_attention(*args, window=7)
    assert plain.grad_fn is None
    with torch.no_grad():
        assert torch.equal(ncp.sink_attention(*args, window=7), plain)
    for name in ("q", "k", "v", "sink"):
        leaf = c[name].clone().requires_grad_(True)
        got = ncp.sink_attention(*(leaf if n == name else c[n] for n in ("q", "k", "v", "sink")), c["cu_seqlens"], window=7)
        assert isinstance(got.grad_fn, torch.autograd.graph.Node) and torch.equal(got.detach(), plain)
        got.sum().backward()
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all(), name
        with torch.no_grad():
            assert ncp.sink_attention(*(leaf if n == name else c[n] for n in ("q", "k", "v", "sink")), c["cu_seqlens"],
                                      window=7).grad_fn is None  # fmt: skip


def test_kernel_launched_before_the_autograd_node(monkeypatch, ncp_seed):
    """``sink_attention`` with grad calls the native forward before ``SinkAttnFunc.forward`` runs
    (the node's bookkeeping overlaps the kernel), once, and gives the values and gradients of the
    node that computes inside its forward (``SinkAttnFunc.apply`` without ``launched``), bit for bit."""
    from nemo_cp_native import attention

    g = torch.Generator().manual_seed(ncp_seed)
    c = make_attention_case([37, 90], 4, 2, 16, dtype=torch.float32, generator=g)
    events = []
    real_fwd, real_forward = attention._fwd, SinkAttnFunc.forward

    def fwd(*a):
        events.append("native")
        return real_fwd(*a)

    def forward(ctx, *a):
        events.append("node")
        return real_forward(ctx, *a)

    monkeypatch.setattr(attention, "_fwd", fwd)
    monkeypatch.setattr(SinkAttnFunc, "forward", staticmethod(forward))
    dout = torch.randn(c["q"].shape, generator=g)
    grads = []
    for launched_first in (True, False):
        events.clear()
        leaves = [c[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sink")]
        if launched_first:
            out, lse = ncp.sink_attention(*leaves, c["cu_seqlens"], window=7, return_lse=True)
            assert events == ["native", "node"]
        else:
            out, lse = SinkAttnFunc.apply(*leaves, AttnMask(cu_seqlens=c["cu_seqlens"], window=7), 16**-0.5)
            assert events == ["node", "native"]
        assert out.grad_fn is not None and not lse.requires_grad  # lse: marked non-differentiable
        out.backward(dout)
        grads.append([out.detach(), lse.detach()] + [t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
