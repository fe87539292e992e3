"""Prove the learned-sink attention oracles right (spec flint_magi.md §5).

Everything here checks ``nemo_cp_native.reference`` against independent formulations: an explicit
per-(query, key) double loop, the post-correction form, plain softmax attention (SDPA), autograd
gradcheck, the closed-form dsink, and the CP whole-sequence oracle's bookkeeping.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_cp_native.reference.cp_attention import cp_attention_ref, local_rows
from nemo_cp_native.reference.magi import dispatch
from nemo_cp_native.reference.sink_attention import (
    attention_positions_ref,
    attention_ref,
    sink_grad_closed_form,
)
from nemo_cp_native.reference.tolerance import assert_close_to_ref, assert_close_to_ref_ulp, ulp

F64 = torch.float64


# ---------------------------------------------------------------------------- case generators


def random_cu(total: int, *, tail_pad: int = 0, max_docs: int = 4) -> torch.Tensor:
    """Random int32 document boundaries over ``total - tail_pad`` tokens (empty docs allowed)."""
    real = total - tail_pad
    ndocs = int(torch.randint(1, max_docs + 1, ()))
    cuts = torch.randint(0, real + 1, (ndocs - 1,)).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([real])]).to(torch.int32)


def make_qkv(total, hq, hkv, d, *, dtype=F64, amp=2.0, sink=True):
    q = (torch.rand(total, hq, d, dtype=F64) * 2 - 1) * amp
    k = (torch.rand(total, hkv, d, dtype=F64) * 2 - 1) * amp
    v = torch.rand(total, hkv, d, dtype=F64) * 2 - 1
    s = torch.randn(hq, dtype=torch.float32) if sink else None
    return q.to(dtype), k.to(dtype), v.to(dtype), s


def loop_attention(q, k, v, sink, cu, window, scale):
    """The plainest possible oracle: Python loops over (query, head, key), float64 math."""
    total, hq, d = q.shape
    group = hq // k.shape[1]
    cu = [int(x) for x in cu]
    doc = [-1] * total
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        for p in range(s, e):
            doc[p] = n
    out = torch.zeros(total, hq, d, dtype=F64)
    lse = torch.full((hq, total), -math.inf, dtype=F64)
    for h in range(hq):
        g = h // group
        for i in range(total):
            keys = [
                j
                for j in range(total)
                if doc[i] >= 0 and doc[j] == doc[i] and j <= i and (window == 0 or i - j < window)
            ]
            logits = [scale * float(q[i, h].double() @ k[j, g].double()) for j in keys]
            if sink is not None:
                logits.append(float(sink[h]))
            if not logits:
                continue
            m = max(logits)
            den = sum(math.exp(z - m) for z in logits)
            lse[h, i] = m + math.log(den)
            for z, j in zip(logits, keys):
                out[i, h] += math.exp(z - lse[h, i]) * v[j, g].double()
    return out, lse


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [0, 1, 2, 3, 100])
@pytest.mark.parametrize("with_sink", [True, False])
def test_matches_double_loop(group, window, with_sink):
    total, hkv, d = 9, 1 if group == 8 else 2, 3
    q, k, v, sink = make_qkv(total, hkv * group, hkv, d, sink=with_sink)
    cu = random_cu(total, tail_pad=int(torch.randint(0, 3, ())))
    scale = 0.7
    out, lse = attention_ref(q, k, v, sink, cu, window=window, scale=scale)
    out_l, lse_l = loop_attention(q, k, v, sink, cu, window, scale)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, out_l, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_l, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [0, 1, 3])
def test_post_correction_form(window):
    """O = O' * sigmoid(lse' - sink), lse = logaddexp(lse', sink), P_sink = sigmoid(sink - lse')."""
    q, k, v, sink = make_qkv(12, 4, 2, 5)
    cu = random_cu(12, tail_pad=2)
    out, lse = attention_ref(q, k, v, sink, cu, window=window)
    out_p, lse_p = attention_ref(q, k, v, None, cu, window=window)
    s = sink.double()[:, None]
    torch.testing.assert_close(lse, torch.logaddexp(lse_p, s), rtol=1e-13, atol=1e-13)
    factor = torch.sigmoid(lse_p - s).transpose(0, 1)[..., None]  # [T, Hq, 1]
    torch.testing.assert_close(out, out_p * factor, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(torch.exp(s - lse), torch.sigmoid(s - lse_p), rtol=1e-13, atol=1e-13)


def test_no_sink_limit_is_plain_softmax_attention():
    total, hq, hkv, d = 16, 8, 2, 4
    q, k, v, _ = make_qkv(total, hq, hkv, d, sink=False)
    cu = random_cu(total)
    scale = 0.3
    out_none, lse_none = attention_ref(q, k, v, None, cu, window=5, scale=scale)
    very_negative = torch.full((hq,), -1.0e4, dtype=torch.float32)  # exp(-1e4) == 0 in float64
    out_neg, lse_neg = attention_ref(q, k, v, very_negative, cu, window=5, scale=scale)
    torch.testing.assert_close(out_neg, out_none, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(lse_neg, lse_none, rtol=1e-14, atol=1e-14)

    # Independent: SDPA with an explicit boolean mask (every row sees at least itself).
    cul = cu.tolist()
    doc = torch.bucketize(torch.arange(total), torch.tensor(cul[1:]), right=True)
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    mask = (doc[:, None] == doc[None, :]) & (j <= i) & (i - j < 5)
    kk = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
    torch.testing.assert_close(out_none, ref.transpose(0, 1), rtol=1e-12, atol=1e-12)
    scores = torch.einsum("qhd,khd->hqk", q, kk.transpose(0, 1)) * scale
    torch.testing.assert_close(lse_none, torch.logsumexp(scores.masked_fill(~mask, -math.inf), -1))


def test_window_one_sees_only_itself():
    q, k, v, sink = make_qkv(7, 4, 2, 3)
    cu = random_cu(7)
    out, lse = attention_ref(q, k, v, sink, cu, window=1)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    z = (q * kk).sum(-1) * 3**-0.5  # [T, Hq]
    s = sink.double()[None, :]
    torch.testing.assert_close(lse.transpose(0, 1), torch.logaddexp(z, s), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(out, vv * torch.sigmoid(z - s)[..., None], rtol=1e-13, atol=1e-13)


def test_window_beyond_documents_equals_causal():
    q, k, v, sink = make_qkv(20, 4, 1, 4)
    cu = torch.tensor([0, 6, 13, 20], dtype=torch.int32)
    out0, lse0 = attention_ref(q, k, v, sink, cu, window=0)
    for window in (7, 8, 100):
        out, lse = attention_ref(q, k, v, sink, cu, window=window)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
    out6, _ = attention_ref(q, k, v, sink, cu, window=6)
    assert not torch.equal(out6, out0)  # the 7-token document feels a window of 6


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_groups_are_contiguous(group):
    """Query head h uses kv head h // group: same as repeating K/V heads explicitly."""
    q, k, v, sink = make_qkv(10, 2 * group, 2, 3)
    cu = random_cu(10)
    out, lse = attention_ref(q, k, v, sink, cu, window=3)
    rep_k, rep_v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out_r, lse_r = attention_ref(q, rep_k, rep_v, sink, cu, window=3)
    torch.testing.assert_close(out, out_r, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_r, rtol=0, atol=0)


def test_fully_masked_rows():
    """Tail pads (cu[-1] < T) and a sink: out 0, lse = sink, zero grads; no NaN without a sink."""
    total, hq, hkv, d = 10, 4, 2, 3
    q, k, v, sink = make_qkv(total, hq, hkv, d)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)  # tokens 7..9 see nothing
    for s in (sink, None):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        sl = None if s is None else s.double().clone().requires_grad_(True)
        out, lse = attention_ref(*leaves, sl, cu, window=2)
        assert torch.equal(out[7:], torch.zeros_like(out[7:]))
        expect = torch.full((hq, 3), -math.inf, dtype=F64) if s is None else s.double()[:, None].expand(hq, 3)
        assert torch.equal(lse[:, 7:], expect)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        dout = torch.randn_like(out)
        (out * dout).sum().backward()
        for leaf in leaves:
            assert torch.isfinite(leaf.grad).all()
            assert torch.equal(leaf.grad[7:], torch.zeros_like(leaf.grad[7:]))
        if sl is not None:  # dout on pad rows must not matter
            dout2 = dout.clone()
            dout2[7:] = torch.randn_like(dout2[7:])
            assert torch.equal(
                sink_grad_closed_form(out.detach(), dout, lse.detach(), s),
                sink_grad_closed_form(out.detach(), dout2, lse.detach(), s),
            )


def test_positions_form_subset_and_permutation():
    """The general form: any subset of queries against a permuted key set gives the same rows."""
    total, hq, hkv, d, window = 24, 4, 2, 4, 5
    q, k, v, sink = make_qkv(total, hq, hkv, d)
    cu = random_cu(total, tail_pad=3)
    out, lse = attention_ref(q, k, v, sink, cu, window=window)
    rows = torch.randperm(total)[:10]
    perm = torch.randperm(total)
    pos = torch.arange(total)
    doc = torch.bucketize(pos, cu[1:].long(), right=True).clamp(max=cu.numel() - 2)
    starts = cu.long()[doc]
    q_lo = torch.maximum(starts, pos - window + 1)
    q_lo = torch.where(pos < int(cu[-1]), q_lo, pos + 1)
    out_s, lse_s = attention_positions_ref(q[rows], k[perm], v[perm], sink, rows, q_lo[rows], perm)
    torch.testing.assert_close(out_s, out[rows], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lse_s, lse[:, rows], rtol=1e-13, atol=1e-13)


def test_low_precision_run():
    q, k, v, sink = make_qkv(32, 8, 2, 16)
    cu = random_cu(32)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    out, lse = attention_ref(qb, kb, vb, sink, cu, window=6)
    out_lp, lse_lp = attention_ref(qb, kb, vb, sink, cu, window=6, upcast=False)
    assert out_lp.dtype == torch.bfloat16 and lse_lp.dtype == torch.float32
    err = (out_lp.double() - out).abs().max().item()
    assert 0 < err < 0.05  # it really is low precision, and still an attention
    assert (lse_lp.double() - lse).abs().max().item() < 0.05
    # autograd works in low precision too (used for gradient tolerances)
    leaves = [t.clone().requires_grad_(True) for t in (qb, kb, vb)]
    sl = sink.clone().requires_grad_(True)
    o, _ = attention_ref(*leaves, sl, cu, window=6, upcast=False)
    o.float().sum().backward()
    assert all(torch.isfinite(t.grad.float()).all() for t in leaves) and torch.isfinite(sl.grad).all()


# ---------------------------------------------------------------------------- backward


@pytest.mark.parametrize("window", [0, 2])
def test_gradcheck_with_sink(window):
    q, k, v, sink = make_qkv(6, 4, 2, 3, amp=1.0)
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)  # a pad row at the end
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, sink.double())]

    def fn(q_, k_, v_, s_):
        return attention_ref(q_, k_, v_, s_, cu, window=window, scale=0.8)

    assert torch.autograd.gradcheck(fn, inputs)


def test_gradcheck_without_sink():
    q, k, v, _ = make_qkv(6, 2, 1, 3, amp=1.0, sink=False)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)  # a pad row whose lse is -inf: check out only
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: attention_ref(a, b, c, None, cu, window=2)[0], inputs)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("window", [0, 3])
def test_closed_form_dsink_equals_autograd(group, window):
    q, k, v, sink = make_qkv(40, 2 * group, 2, 8)
    cu = random_cu(40, tail_pad=4)
    sl = sink.double().clone().requires_grad_(True)
    out, lse = attention_ref(q, k, v, sl, cu, window=window)
    dout = torch.randn_like(out)
    (dsink,) = torch.autograd.grad(out, [sl], dout)
    closed = sink_grad_closed_form(out.detach(), dout, lse.detach(), sink)
    torch.testing.assert_close(closed, dsink, rtol=1e-11, atol=1e-13)


# ---------------------------------------------------------------------------- CP oracle


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("with_sink", [True, False])
def test_cp_oracle_rows_and_partial_dsink(cp, with_sink):
    total, hq, hkv, d, window = 37, 4, 2, 4, 5
    q, k, v, sink = make_qkv(total, hq, hkv, d, sink=with_sink)
    cu = random_cu(total)
    disp = dispatch(cu, cp, requested_chunk=3)
    dout = torch.randn(total, hq, d, dtype=F64)
    ref = cp_attention_ref(q, k, v, sink, cu, dout, disp, cp, window=window)

    out, lse = attention_ref(q, k, v, sink, cu, window=window)
    assert torch.equal(ref.out, out) and torch.equal(ref.lse, lse)
    dq_all = torch.zeros_like(q)
    dk_all, dv_all = torch.zeros_like(k), torch.zeros_like(v)
    for r, rank in enumerate(ref.ranks):
        idx = disp.local_token_global_indices(r)
        real = idx < total
        assert rank.out.shape == (disp.total_seqlen_padded // cp, hq, d)
        assert torch.equal(rank.out[~real], torch.zeros_like(rank.out[~real]))
        assert torch.equal(rank.dq[~real], torch.zeros_like(rank.dq[~real]))
        pad_lse = rank.lse[:, ~real]
        assert torch.equal(pad_lse, torch.full_like(pad_lse, -math.inf) if sink is None
                           else sink.double()[:, None].expand_as(pad_lse))
        # The spec §2 oracle: the rank's local queries against the whole K/V, by position.
        lq = local_rows(q, disp, r)
        starts = torch.tensor(cu.tolist(), dtype=torch.int64)[
            torch.bucketize(idx.clamp(max=total - 1), cu[1:].long(), right=True)
        ]
        q_lo = torch.where(real, torch.maximum(starts, idx - window + 1), idx + 1)
        o_r, l_r = attention_positions_ref(lq, k, v, sink, idx, q_lo, torch.arange(total))
        torch.testing.assert_close(rank.out, o_r, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(rank.lse, l_r, rtol=1e-13, atol=1e-13)
        dq_all[idx[real]] += rank.dq[real]
        dk_all[idx[real]] += rank.dk[real]
        dv_all[idx[real]] += rank.dv[real]
    assert torch.equal(dq_all, ref.dq) and torch.equal(dk_all, ref.dk) and torch.equal(dv_all, ref.dv)
    if with_sink:
        total_dsink = torch.stack([rk.dsink for rk in ref.ranks]).sum(0)
        torch.testing.assert_close(total_dsink, ref.dsink, rtol=1e-11, atol=1e-13)
        closed = sink_grad_closed_form(ref.out, dout, ref.lse, sink)
        torch.testing.assert_close(closed, ref.dsink, rtol=1e-11, atol=1e-13)
    else:
        assert ref.dsink is None and all(rk.dsink is None for rk in ref.ranks)


# ---------------------------------------------------------------------------- tolerance helpers


def _bf16_ref_and_lp():
    """(float64 reference, naive bf16 run) of one small bf16 case."""
    q, k, v, sink = make_qkv(24, 4, 2, 8)
    cu = random_cu(24)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    return attention_ref(qb, kb, vb, sink, cu)[0], attention_ref(qb, kb, vb, sink, cu, upcast=False)[0]


def test_tolerance_rule_accepts_lp_and_rejects_worse():
    ref, ref_lp = _bf16_ref_and_lp()
    assert_close_to_ref(ref_lp, ref, ref_lp, name="out")  # the naive run passes its own rule
    assert_close_to_ref(ref.to(torch.bfloat16), ref, ref_lp, name="out")  # exact answer, rounded
    bound = 2 * (ref_lp.double() - ref).abs().max() + 2 * (ref.bfloat16().double() - ref).abs().max()
    bad = ref.clone()
    bad[3, 1, 2] += 1.01 * bound
    with pytest.raises(AssertionError, match=r"index \(3, 1, 2\)"):
        assert_close_to_ref(bad, ref, ref_lp, name="out")
    # The factor is exactly 2 (float64 out: no rounding noise term).
    lp_err = (ref_lp.double() - ref).abs().max()
    assert lp_err > 0
    edge = ref.clone()
    edge[0, 0, 0] += 1.99 * lp_err
    assert_close_to_ref(edge, ref, ref_lp, name="out")
    edge[0, 0, 0] += 0.02 * lp_err
    with pytest.raises(AssertionError, match="exceeds bound"):
        assert_close_to_ref(edge, ref, ref_lp, name="out")
    nan = ref.clone()
    nan[0, 0, 0] = math.nan
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_ref(nan, ref, ref_lp, name="out")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_ref(ref, ref, nan, name="out")


def test_tolerance_allowance_is_per_element():
    """allowance widens the bound only where it is given (the D-rounding term of the gradients)."""
    ref, ref_lp = _bf16_ref_and_lp()
    lp_err = (ref_lp.double() - ref).abs().max()
    allow = torch.zeros_like(ref)
    allow[5, 2, 3] = 0.5
    bad = ref.clone()
    bad[5, 2, 3] += 2 * lp_err + 0.49  # within the bound plus the allowance there
    assert_close_to_ref(bad, ref, ref_lp, name="out", allowance=allow)
    with pytest.raises(AssertionError, match="exceeds bound"):
        assert_close_to_ref(bad, ref, ref_lp, name="out")  # not without it
    other = ref.clone()
    other[6, 2, 3] += 2.01 * lp_err + 0.1  # the allowance of another element does not help
    with pytest.raises(AssertionError, match=r"allowance 0 there; worst at index \(6, 2, 3\)"):
        assert_close_to_ref(other, ref, ref_lp, name="out", allowance=allow)


def test_tolerance_nonfinite_reference_entries():
    ref = torch.tensor([[-math.inf, 1.0], [2.0, 3.0]], dtype=F64)
    out = ref.float()
    assert_close_to_ref(out, ref, ref, name="lse")
    assert_close_to_ref_ulp(out, ref, ref, name="lse")
    wrong = out.clone()
    wrong[0, 0] = -1e30
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_to_ref(wrong, ref, ref, name="lse")
    wrong = out.clone()
    wrong[1, 1] = math.inf
    with pytest.raises(AssertionError, match="inf"):
        assert_close_to_ref_ulp(wrong, ref, ref, name="lse")


def test_ulp_rule_is_per_element():
    ref = torch.tensor([1000.0, 1e-3, -5.0], dtype=F64)
    ref_lp = ref + torch.tensor([0.5, 0.0, 0.0], dtype=F64)  # the lp run is only off at entry 0
    ok = ref.float() + torch.tensor([0.9, 0.0, 0.0])
    assert_close_to_ref_ulp(ok, ref, ref_lp, name="dsink")
    # 0.9 at entry 0 would pass a max-norm rule everywhere; per element, entry 1 may move ~4 ulp only.
    u = ulp(ref, torch.float32)
    near = ref.float().double() + torch.tensor([0.0, 1.0, 0.0], dtype=F64) * 3 * u
    assert_close_to_ref_ulp(near.float(), ref, ref_lp, name="dsink")
    far = ref.float().double() + torch.tensor([0.0, 1.0, 0.0], dtype=F64) * 8 * u
    with pytest.raises(AssertionError, match=r"index \(1,\)"):
        assert_close_to_ref_ulp(far.float(), ref, ref_lp, name="dsink")
    assert_close_to_ref(far.float(), ref, ref_lp, name="dsink")  # ...which the max-norm rule misses


def test_validation_errors():
    q, k, v, sink = make_qkv(6, 3, 2, 2)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        attention_ref(q, k, v, sink, cu)
    q, k, v, sink = make_qkv(6, 4, 2, 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_ref(q, k, v, sink, torch.tensor([0, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_ref(q, k, v, sink, torch.tensor([0, 4, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="window"):
        attention_ref(q, k, v, sink, cu, window=-1)
    with pytest.raises(ValueError, match="sink"):
        attention_ref(q, k, v, sink[:2], cu)
