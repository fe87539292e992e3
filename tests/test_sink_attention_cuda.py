"""CUDA sink attention against the float64 oracle (tolerance rule of STYLE.md), both mask policies
(documents, and the CP table mask) on both kernel families (Hopper and portable), plus poisoned
outputs with guard bands, determinism, the dispatcher's choices and test hooks, rank-simulated
CP, and the CPU C path as second oracle. Skipped without a GPU and a CUDA build."""

from __future__ import annotations

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native import flint, testing
from nemo_cp_native._ops import _C, dl
from nemo_cp_native.attention import AttnMask, attn_backward, attn_forward
from nemo_cp_native.reference import cp_attention as rcp
from nemo_cp_native.reference import magi as rmagi
from nemo_cp_native.reference.sink_attention import attention_ref, attention_table_ref, sink_grad_closed_form
from nemo_cp_native.reference.tolerance import assert_close_to_ref, assert_close_to_ref_ulp
from nemo_cp_native.testing import attn_debug, doc_lengths, make_attention_case

from _attn_checks import check_dsink, d_rounding_allowance, guarded, guards_intact

pytestmark = pytest.mark.cuda

DEV = "cuda"
DQ_KERNEL_MAX_WINDOW = 192  # dispatch.cu: kDqKernelMaxWindow


def _lean_memory() -> bool:
    """Whether the dispatcher gives small D = 128 windows the deterministic pair on this device
    (dispatch.cu, dq_kernel_pays: little memory bandwidth per SM clock); checked against the two
    cards it was measured on."""
    lean = testing.kernels(D=128, window=DQ_KERNEL_MAX_WINDOW)[1] == "sm90-deterministic"
    name = torch.cuda.get_device_name()
    if "H100" in name and "HBM3" in name:
        assert lean, f"{name}: 3.35 TB/s over 132 SMs is below the dispatcher's bandwidth bar"
    if "H200" in name:
        assert not lean, f"{name}: 4.8 TB/s over 132 SMs is above the dispatcher's bandwidth bar"
    return lean
HUGE_GRID = 1 << 30  # a persistent-grid cap above any item count: one CTA per work item


def _hopper() -> bool:
    return testing.kernels()[0] == "sm90"


@pytest.fixture(params=["auto", "sm90-grid7-det", "sm90-whole-det", "portable"])
def kernel(request, monkeypatch):
    """Runs a test on the default kernels (on an H200: the persistent Hopper forward and the
    atomic-dQ Hopper backward), on the Hopper forward on a persistent grid of 7 CTAs (many work
    items each) with the deterministic Hopper backward, on the Hopper forward with one CTA per
    work item and whole edge tiles (no half tiles) with the deterministic backward, and on the
    portable mma.sync forward and backward."""
    monkeypatch.delenv("NCP_DETERMINISTIC", raising=False)
    hooks = {"auto": {}, "portable": {"portable": True}, "sm90-grid7-det": {"grid": 7},
             "sm90-whole-det": {"grid": HUGE_GRID, "whole_tiles": True}}[request.param]  # fmt: skip
    if request.param.endswith("-det"):
        monkeypatch.setenv("NCP_DETERMINISTIC", "1")
    with attn_debug(portable=False, grid=0, whole_tiles=False), attn_debug(**hooks):
        yield request.param


def test_cuda_dispatcher_picks_hopper_on_sm90():
    """On compute capability 9.0 with an sm_90a build the Hopper kernels run for both masks (the
    choice does not depend on the mask), so the suite does not silently test only the fallback;
    the portable hook and the deterministic mode switch them as documented."""
    if torch.cuda.get_device_capability() != (9, 0) or "90a" not in ncp.build_info()["cuda_archs"].split(";"):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 device")
    assert testing.kernels() == ("sm90", "sm90-atomic-dq")
    assert testing.kernels(deterministic=True) == ("sm90", "sm90-deterministic")
    with attn_debug(portable=True):
        assert testing.kernels() == ("portable", "portable")
    assert testing.kernels() == ("sm90", "sm90-atomic-dq")
    # small windows at D = 128 take the deterministic pair by default where memory is lean
    # (dispatch.cu, dq_kernel_pays), and their workspace then has no dQ accumulator
    small = "sm90-deterministic" if _lean_memory() else "sm90-atomic-dq"
    for d, window, bwd in ((128, 1, small), (128, DQ_KERNEL_MAX_WINDOW, small),
                           (128, DQ_KERNEL_MAX_WINDOW + 1, "sm90-atomic-dq"), (128, 0, "sm90-atomic-dq"),
                           (64, 1, "sm90-atomic-dq"), (64, 128, "sm90-atomic-dq")):  # fmt: skip
        assert testing.kernels(D=d, window=window) == ("sm90", bwd), (d, window)
        assert testing.kernels(deterministic=True, D=d, window=window) == ("sm90", "sm90-deterministic")
    ws = {w: _C.sink_attn_bwd_workspace(Tq=4096, Tk=4096, Hq=8, D=128, has_sink=1, deterministic=0, device=0, window=w)
          for w in (0, DQ_KERNEL_MAX_WINDOW, DQ_KERNEL_MAX_WINDOW + 1)}  # fmt: skip
    assert ws[0] == ws[DQ_KERNEL_MAX_WINDOW + 1]
    # the accumulator and its tiles' claim flags, less the dQ grid's tile order (256 bytes)
    acc, diff = 8 * 4096 * 128 * 4 + 8 * (4096 // 64) * 2 * 4, ws[0] - ws[DQ_KERNEL_MAX_WINDOW]
    assert (acc - 4096 <= diff < acc) if small == "sm90-deterministic" else diff == 0, diff


def _default_det_default(seed, tokens, mean, d, window, monkeypatch):
    """A random document case (8/2 heads, head dim d) and its gradients (q, k, v, sink) from the
    default backward, the deterministic one, then the default again: (case, leaves, dout, (default
    run 1, default run 2, deterministic))."""
    g = torch.Generator().manual_seed(seed)
    lengths = doc_lengths(tokens, "random", mean=mean, generator=g)
    c = make_attention_case(lengths, 8, 2, d, device=DEV, generator=g, requires_grad=True)
    args = (c["q"], c["k"], c["v"], c["sink"])
    dout = torch.randn(c["q"].shape, generator=g).to(DEV, torch.bfloat16)
    grads = {}
    for det in ("0", "1", "0"):
        monkeypatch.setenv("NCP_DETERMINISTIC", det)
        out = ncp.sink_attention(*args, c["cu_seqlens"], window=window)
        grads.setdefault(det, []).append(torch.autograd.grad(out, args, dout))
    return c, args, dout, (grads["0"][0], grads["0"][1], grads["1"][0])


def test_cuda_backward_after_the_portable_hook_same_shape(ncp_seed):
    """A shape's backward under attn_debug(portable=True), then the same shape on the default
    kernels: the second call sizes its own workspace (it was refused with a workspace sized for the
    portable kernels when the size cache outlived the hook) and matches the first."""
    g = torch.Generator().manual_seed(ncp_seed)
    c = make_attention_case([300, 212], 4, 2, 64, device=DEV, generator=g)
    dout = torch.randn(c["q"].shape, generator=g).to(DEV, c["q"].dtype)
    grads = []
    for portable in (True, False):
        leaves = [c[n].detach().requires_grad_() for n in ("q", "k", "v", "sink")]
        with attn_debug(portable=portable):
            ncp.sink_attention(*leaves, c["cu_seqlens"], window=100).backward(dout)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_cuda_small_window_backward_is_the_deterministic_pair(ncp_seed, monkeypatch):
    """A window the dispatcher gives the deterministic pair by default: the default backward's
    gradients are bitwise those of NCP_DETERMINISTIC=1 (the same kernels), run after run, and just
    above that window the default takes the atomic kernel again (dq then differs in its last bits
    only: test_cuda_atomic_dq_backward_matches_deterministic)."""
    if testing.kernels()[1] != "sm90-atomic-dq":
        pytest.skip("needs the Hopper backward (sm_90a build, compute capability 9.0)")
    if not _lean_memory():
        pytest.skip("this device keeps the atomic kernel for small windows (dispatch.cu, dq_kernel_pays)")
    _, _, _, (a1, a2, dt) = _default_det_default(ncp_seed, 2500, 700, 128, DQ_KERNEL_MAX_WINDOW, monkeypatch)
    for i in range(4):
        assert torch.equal(a1[i], dt[i]) and torch.equal(a2[i], dt[i]), i


def _grads(out, tensors, dout):
    return torch.autograd.grad(out, tensors, dout, allow_unused=False)


def _check_case(lengths, hq, hkv, d, window, dtype, seed, sink=True):
    g = torch.Generator().manual_seed(seed)
    c = make_attention_case(lengths, hq, hkv, d, dtype=dtype, device=DEV, generator=g)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    s = s if sink else None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([s.detach().requires_grad_()] if sink else [])
    out, lse = ncp.sink_attention(*leaves[:3], leaves[3] if sink else None, cu, window=window, return_lse=True)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float32).to(DEV, dtype)
    grads = _grads(out, leaves, dout)

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse = attention_ref(*ref_leaves[:3], ref_leaves[3] if sink else None, cu, window=window)
    ref_grads = _grads(ref, ref_leaves, dout.double())
    lp_leaves = [t.detach().requires_grad_() for t in leaves]
    lp, lp_lse = attention_ref(*lp_leaves[:3], lp_leaves[3] if sink else None, cu, window=window, upcast=False)
    lp_grads = _grads(lp, lp_leaves, dout)

    assert_close_to_ref(out, ref, lp, name="out")
    assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse", magnitude_floor=1.0)
    allow = d_rounding_allowance(lambda *t: attention_ref(*t[:3], t[3] if sink else None, cu, window=window), leaves,
                                 dout, dtype)  # fmt: skip
    for name, a, r, l, al in zip(("dq", "dk", "dv"), grads, ref_grads, lp_grads, allow):
        assert_close_to_ref(a, r, l, name=name, allowance=al)
    if sink:
        # A low-precision run computes D_i = <dO_i, O_i> from its rounded output (spec 5.7), as
        # every flash kernel does; autograd through the low-precision reference would not.
        lp_dsink = sink_grad_closed_form(lp.detach(), dout, lp_lse.detach(), leaves[3].detach())
        check_dsink(grads[3], out.detach(), lse, dout, leaves[3].detach(), ref_grads[3], lp_dsink)


CASES = [
    # (doc mode, total, Hq, Hkv, D, window)
    ("one", 1000, 4, 4, 128, 0),
    ("random", 2048, 8, 1, 128, 0),
    ("random", 1531, 8, 2, 64, 128),
    ("window", 3000, 4, 1, 128, 513),
    ("window", 777, 8, 8, 64, 1),
    ("tiny", 300, 4, 4, 128, 0),
    ("equal:513", 2100, 8, 2, 128, 513),
    ("one", 2500, 16, 2, 64, 128),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[1]}-{c[2]}x{c[3]}-d{c[4]}-w{c[5]}" for c in CASES])
def test_cuda_matches_oracle(case, dtype, ncp_seed, kernel):
    mode, total, hq, hkv, d, window = case
    lengths = doc_lengths(total, mode, window=window, generator=torch.Generator().manual_seed(ncp_seed))
    _check_case(lengths, hq, hkv, d, window, dtype, ncp_seed)


@pytest.mark.parametrize("window", [0, 513, 100])
def test_cuda_empty_documents_and_key_tiles_across_documents(window, ncp_seed, kernel):
    """The dK/dV producer takes a row's document start from the one document it searched for its
    key tile's last key (sm90_bwd_parts.cuh, CtaKeyBounds) and searches only rows outside it:
    empty documents (repeated cu_seqlens entries, leading ones included), documents shorter than a
    key tile, key tiles of 128 keys that start in one document and end in another, and rows of a
    q tile past the searched document."""
    _check_case([0, 0, 70, 0, 300, 129, 0, 0, 1, 700, 0, 190, 5, 0], 8, 2, 128, window, torch.bfloat16, ncp_seed)


def test_cuda_no_sink_and_length_one_documents(ncp_seed, kernel):
    _check_case([1, 1, 5, 1, 200, 1, 64, 1], 4, 1, 64, 0, torch.bfloat16, ncp_seed, sink=False)
    _check_case([1, 1, 5, 1, 200, 1, 64, 1], 4, 1, 64, 3, torch.bfloat16, ncp_seed, sink=True)


# ------------------------------------------------------------------------------------------
# the table mask (context parallelism)
# ------------------------------------------------------------------------------------------


def _table_case(g, tq, tk, hq, hkv, d, empty_tiles=(), hint=0):
    """Non-decreasing row bounds with empty rows (lo > hi) and keys nobody sees; whole query tiles
    of 128 rows listed in empty_tiles see nothing. ``hint``: the table's window hint (kernel choice)."""
    lo = torch.randint(0, 3 * tk // 4, (tq,), generator=g).sort().values
    hi = (lo + torch.randint(-8, tk // 4, (tq,), generator=g)).clamp(-1, tk - 1).cummax(0).values
    for t in empty_tiles:  # keep both bounds non-decreasing: rows see nothing between neighbours
        a, b = 128 * t, min(128 * (t + 1), tq)
        hi[a:b] = hi[a - 1] if a > 0 else -1
        lo[a:b] = torch.maximum(lo[a:b], hi[a:b] + 1)
        lo = lo.cummax(0).values
    mask = AttnMask(row_lo=lo.to(torch.int32).to(DEV), row_hi=hi.to(torch.int32).to(DEV), window=hint)
    c = make_attention_case([tq], hq, hkv, d, device=DEV, generator=g)
    kc = make_attention_case([tk], hkv, hkv, d, device=DEV, generator=g)
    j = torch.arange(tk)
    seen = (j[None, :] >= lo[:, None]) & (j[None, :] <= hi[:, None])
    return c["q"], kc["k"], kc["v"], c["sink"], mask, seen


@pytest.mark.parametrize("hint", [0, 257], ids=["nohint", "window_hint"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sink", [True, False])
def test_cuda_table_mask_matches_oracle(d, sink, hint, ncp_seed, kernel):
    """The CP mask on every kernel: out, lse, dq, dk, dv, dsink against the float64 oracle, with
    rows and whole query tiles that see no key (out 0, lse = sink or -inf, zero gradients). With a
    window hint the Hopper backward takes its skipping kernels, on the same (arbitrary) table."""
    g = torch.Generator().manual_seed(ncp_seed)
    q, k, v, s, mask, seen = _table_case(g, 128 * 7 - 37, 900, 8, 2, d, empty_tiles=(1, 2, 4), hint=hint)
    s = s if sink else None
    scale = d**-0.5
    out, lse = attn_forward(q, k, v, s, mask, scale)
    empty, unseen = (~seen.any(1)).to(DEV), (~seen.any(0)).to(DEV)
    assert bool(empty.any())
    assert not out[empty].any(), "a row that sees nothing must output exactly 0"
    want = s[:, None].expand(-1, q.shape[0]) if sink else torch.full((8, q.shape[0]), float("-inf"), device=DEV)
    torch.testing.assert_close(lse[:, empty], want[:, empty], rtol=1e-6, atol=1e-6)
    bounds = (mask.row_lo, mask.row_hi)
    leaves = [q, k, v] + ([s] if sink else [])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref, ref_lse = attention_table_ref(*ref_leaves[:3], ref_leaves[3] if sink else None, *bounds, scale=scale)
    lp_leaves = [t.detach().requires_grad_() for t in leaves]
    lp, lp_lse = attention_table_ref(*lp_leaves[:3], lp_leaves[3] if sink else None, *bounds, scale=scale,
                                     upcast=False)  # fmt: skip
    assert_close_to_ref(out, ref, lp, name="out")
    assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse", magnitude_floor=1.0)
    dout = torch.randn(out.shape, generator=g).to(DEV, out.dtype)
    dq, dk, dv, ds = attn_backward(dout, q, k, v, s, out, lse, mask, scale)
    assert not dq[empty].any() and not dk[unseen].any() and not dv[unseen].any()
    ref_grads = _grads(ref, ref_leaves, dout.double())
    lp_grads = _grads(lp, lp_leaves, dout)
    allow = d_rounding_allowance(lambda *t: attention_table_ref(*t[:3], t[3] if sink else None, *bounds, scale=scale),
                                 leaves, dout, out.dtype)  # fmt: skip
    for name, a, r, l, al in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, lp_grads, allow):
        assert_close_to_ref(a, r, l, name=name, allowance=al)
    if sink:
        lp_dsink = sink_grad_closed_form(lp.detach(), dout, lp_lse.detach(), s)
        check_dsink(ds, out, lse, dout, s, ref_grads[3], lp_dsink)


def test_cuda_table_mask_runs_the_hopper_kernels(ncp_seed):
    """On an H200 the table mask takes the Hopper kernels: the dispatcher says so, and their
    results differ in the last bits from the portable kernels' (another summation order) while
    both pass the oracle (test_cuda_table_mask_matches_oracle)."""
    if not _hopper():
        pytest.skip("needs the Hopper kernels (sm_90a build, compute capability 9.0)")
    g = torch.Generator().manual_seed(ncp_seed)
    q, k, v, s, mask, _ = _table_case(g, 3000, 2500, 8, 2, 128)
    dout = torch.randn(q.shape, generator=g).to(DEV, q.dtype)
    runs = []
    for portable in (False, True):
        with attn_debug(portable=portable):
            out, lse = attn_forward(q, k, v, s, mask, 0.1)
            runs.append((out, lse) + tuple(attn_backward(dout, q, k, v, s, out, lse, mask, 0.1)))
    assert any(not torch.equal(a, b) for a, b in zip(*runs)), "the default and portable kernels gave the same bits"


# ------------------------------------------------------------------------------------------
# poisoned outputs, strides, determinism
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,window", [(128, 0), (64, 0), (64, 96), (128, 513)])
def test_cuda_poisoned_outputs_and_guards(d, window, ncp_seed, kernel):
    """Every output element written, nothing outside the outputs touched, from NaN-poisoned
    outputs and a NaN-poisoned workspace (the atomic-dQ Hopper backward zeroes its own part).
    D = 64 and windows too: a dq tile the deterministic D = 64 backward never wrote would pass an
    oracle test wherever the output's memory still held an earlier, correct dq (the D = 64
    failures of docs/EXPERIMENTS.md, "Flaky CUDA test failures"); NaN-poisoned, it fails anywhere."""
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(1300, "random", generator=g)
    c = make_attention_case(lengths, 8, 2, d, device=DEV, generator=g)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    T, Hq, D = q.shape
    ob, out, pad = guarded((T, Hq, D), q.dtype, float("nan"), device=DEV)
    lb, lse, _ = guarded((Hq, T), torch.float32, float("nan"), device=DEV)
    _C.sink_attn_fwd(q=dl(q), k=dl(k), v=dl(v), sink=dl(s), out=dl(out), lse=dl(lse), scale=D**-0.5,
                     cu_seqlens=dl(cu), window=window, stream=torch.cuda.current_stream().cuda_stream)  # fmt: skip
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    assert guards_intact(ob, pad) and guards_intact(lb, pad), "a guard band was overwritten"
    dout = torch.randn_like(out)
    bufs = [guarded(t.shape, t.dtype, float("nan"), device=DEV) for t in (q, k, v)]
    sb = guarded((Hq,), torch.float32, float("nan"), device=DEV)
    det = int(kernel.endswith("-det"))
    nbytes = _C.sink_attn_bwd_workspace(Tq=T, Tk=T, Hq=Hq, D=D, has_sink=1, deterministic=det, device=0, window=window)
    wb = guarded(((nbytes + 3) // 4,), torch.float32, float("nan"), device=DEV, pad=256)
    _C.sink_attn_bwd(q=dl(q), k=dl(k), v=dl(v), sink=dl(s), out=dl(out), lse=dl(lse), dout=dl(dout), dq=dl(bufs[0][1]),
                     dk=dl(bufs[1][1]), dv=dl(bufs[2][1]), dsink=dl(sb[1]), workspace=dl(wb[1]), scale=D**-0.5,
                     cu_seqlens=dl(cu), window=window, deterministic=det,
                     stream=torch.cuda.current_stream().cuda_stream)  # fmt: skip
    torch.cuda.synchronize()
    for b, t, p in bufs + [sb, wb]:
        assert guards_intact(b, p), "a guard band was overwritten"
    for b, t, p in bufs + [sb]:
        assert not t.isnan().any(), "an output element was never written"


def test_cuda_workspace_too_small_is_an_error():
    c = make_attention_case([300], 4, 2, 64, device=DEV)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    out, lse = attn_forward(q, k, v, s, AttnMask(cu_seqlens=cu), 0.125)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match="workspace must hold"):
        _C.sink_attn_bwd(q=dl(q), k=dl(k), v=dl(v), sink=dl(s), out=dl(out), lse=dl(lse), dout=dl(torch.randn_like(out)),
                         dq=dl(grads[0]), dk=dl(grads[1]), dv=dl(grads[2]), dsink=dl(torch.empty_like(s)),
                         workspace=dl(torch.empty(16, device=DEV)), scale=0.125, cu_seqlens=dl(cu))  # fmt: skip


@pytest.mark.parametrize("d,window", [(128, 0), (64, 513)])
def test_cuda_strided_views_of_packed_qkv(d, window, ncp_seed, kernel):
    """q, k, v as views of one packed (T, Hq + 2 Hkv, D) tensor: token strides differ from the
    head count (the TMA tensor maps take strides, not shapes)."""
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(1500, "random", generator=g)
    T, hq, hkv = sum(lengths), 8, 2
    qkv = torch.randn(T, hq + 2 * hkv, d, generator=g).to(DEV, torch.bfloat16)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    sink = (torch.rand(hq, generator=g) * 8 - 4).to(DEV)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(DEV, torch.int32)
    out, lse = ncp.sink_attention(q, k, v, sink, cu, window=window, return_lse=True)
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), sink, cu, window=window)
    lp, lp_lse = attention_ref(q, k, v, sink, cu, window=window, upcast=False)
    assert_close_to_ref(out, ref, lp, name="out")
    assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse", magnitude_floor=1.0)


@pytest.mark.parametrize("d,window", [(128, 513), (128, 0), (64, 513), (64, 0)])
@pytest.mark.parametrize("table", [False, True])
def test_cuda_backward_is_deterministic(table, d, window, ncp_seed, kernel, monkeypatch):
    """Bitwise repeatable under NCP_DETERMINISTIC=1 (also the portable kernels' only mode), for
    both masks and head dims, with and without the skipping kernels (a window, or a table's window
    hint), on long documents (about 4k tokens; one kv head, so 8 query heads per dK/dV CTA); three
    runs."""
    monkeypatch.setenv("NCP_DETERMINISTIC", "1")
    g = torch.Generator().manual_seed(ncp_seed)
    if table:
        q, k, v, s, mask, _ = _table_case(g, 3000, 2600, 16, 2, d, hint=window)
    else:
        lengths = doc_lengths(8192, "random", mean=4000, generator=g)
        c = make_attention_case(lengths, 8, 1, d, device=DEV, generator=g)
        q, k, v, s, mask = c["q"], c["k"], c["v"], c["sink"], AttnMask(cu_seqlens=c["cu_seqlens"], window=window)
    dout = torch.randn(q.shape, generator=g).to(DEV, torch.bfloat16)
    runs = []
    for _ in range(3):
        out, lse = attn_forward(q, k, v, s, mask, 0.09)
        runs.append((out, lse) + tuple(attn_backward(dout, q, k, v, s, out, lse, mask, 0.09)))
    for run in runs[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), runs[0], run):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("table", [False, True])
def test_cuda_backward_tile_orders_change_no_bit(table, ncp_seed, monkeypatch):
    """The Hopper backward grids take their tiles longest first within chunks of waves (launch.h).
    Any order gives the same gradients: bitwise in the deterministic mode (every CTA sums in its own
    fixed order), and dk, dv, dsink bitwise with dq within rounding in the atomic-dQ mode. Orders:
    index order, the default, one-wave chunks, the whole grid as one chunk."""
    if not _hopper():
        pytest.skip("needs the Hopper kernels (sm_90a build, compute capability 9.0)")
    g = torch.Generator().manual_seed(ncp_seed)
    if table:
        q, k, v, s, mask, _ = _table_case(g, 3000, 2600, 16, 2, 128, empty_tiles=(3,))
    else:
        c = make_attention_case([2000, 37, 900, 129, 3000, 1], 16, 2, 128, device=DEV, generator=g)
        q, k, v, s, mask = c["q"], c["k"], c["v"], c["sink"], AttnMask(cu_seqlens=c["cu_seqlens"])
    dout = torch.randn(q.shape, generator=g).to(DEV, q.dtype)
    out, lse = attn_forward(q, k, v, s, mask, 0.09)
    for det in (1, 0):
        monkeypatch.setenv("NCP_DETERMINISTIC", str(det))
        runs = []
        for waves in (-1, 0, 1, 1 << 20):
            with attn_debug(order_waves=waves):
                runs.append(attn_backward(dout, q, k, v, s, out, lse, mask, 0.09))
        for run in runs[1:]:
            for name, a_, b_ in zip(("dq", "dk", "dv", "dsink"), runs[0], run):
                if name == "dq" and not det:
                    torch.testing.assert_close(a_, b_, rtol=1e-2, atol=1e-2)
                else:
                    assert torch.equal(a_, b_), f"{name} (deterministic={det})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_backward_short_key_tiles(dtype, ncp_seed, kernel):
    """Causal, D = 128, one query head per kv head: the dK/dV CTAs of 128 keys see 1, 2, 3 and 5
    q tiles of 64 rows (documents 192, 256, 64, 130), so the Hopper kernel's item loop runs with
    its first item alone, no steady state, and one or two items of hand-offs between the
    warpgroups (the deferred dQ MMA and its last item after the loop)."""
    _check_case([192, 256, 64, 130], 2, 2, 128, 0, dtype, ncp_seed)


@pytest.mark.parametrize("d,window", [(128, 0), (64, 513), (64, 100), (128, DQ_KERNEL_MAX_WINDOW + 1), (128, 513)])
def test_cuda_atomic_dq_backward_matches_deterministic(d, window, ncp_seed, monkeypatch):
    """The default Hopper backward (dq from atomic reductions) against the deterministic one and the
    fp64 oracle; dk, dv and dsink stay bitwise repeatable, dq differs only in summation order.
    (128, 513): documents of about 800 tokens give the skipping kernel key tiles that 8 or more q
    tiles see (its deferred loop) and key tiles near a document's end that fewer see (its loop
    with one barrier per item)."""
    if testing.kernels()[1] != "sm90-atomic-dq":
        pytest.skip("needs the Hopper backward (sm_90a build, compute capability 9.0)")
    c, args, dout, (a1, a2, dt) = _default_det_default(ncp_seed, 3000, 800, d, window, monkeypatch)
    for i in (1, 2, 3):  # dk, dv, dsink do not depend on the dq mode
        assert torch.equal(a1[i], dt[i]) and torch.equal(a2[i], dt[i])
    ref_leaves = [t.detach().double().requires_grad_() for t in args]
    ref, _ = attention_ref(*ref_leaves, c["cu_seqlens"], window=window)
    (ref_dq,) = _grads(ref, ref_leaves[:1], dout.double())
    lp_leaves = [t.detach().requires_grad_() for t in args]
    lp, _ = attention_ref(*lp_leaves, c["cu_seqlens"], window=window, upcast=False)
    (lp_dq,) = _grads(lp, lp_leaves[:1], dout)
    allow = d_rounding_allowance(lambda *t: attention_ref(*t, c["cu_seqlens"], window=window), args, dout, torch.bfloat16)
    for name, dq in (("dq atomic run 1", a1[0]), ("dq atomic run 2", a2[0]), ("dq deterministic", dt[0])):
        assert_close_to_ref(dq, ref_dq, lp_dq, name=name, allowance=allow[0])


# ------------------------------------------------------------------------------------------
# Hopper forward: persistent grid and half tiles give the bits of one CTA per item, whole tiles
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("d,window,mode", [(128, 0, "random"), (128, 513, "random"), (64, 1, "window"), (128, 0, "tiny")])
def test_cuda_persistent_forward_matches_one_cta_per_item(d, window, mode, table, ncp_seed):
    """The persistent Hopper forward (grids of 1, 5 and one CTA per SM walking the work items, the
    Q buffers and the K/V ring carried across items) against one CTA per item: the same
    arithmetic per item, so out and lse are bitwise equal; for both masks."""
    if not _hopper():
        pytest.skip("needs the Hopper forward (sm_90a build, compute capability 9.0)")
    g = torch.Generator().manual_seed(ncp_seed)
    if table:
        q, k, v, s, mask, _ = _table_case(g, 2900, 2500, 8, 2, d)
    else:
        c = make_attention_case(doc_lengths(2900, mode, window=window, mean=400, generator=g), 8, 2, d, device=DEV,
                                generator=g)  # fmt: skip
        q, k, v, s, mask = c["q"], c["k"], c["v"], c["sink"], AttnMask(cu_seqlens=c["cu_seqlens"], window=window)
    with attn_debug(grid=HUGE_GRID):
        want, want_lse = attn_forward(q, k, v, s, mask, d**-0.5)
    for grid in (1, 5, 0):
        with attn_debug(grid=grid):
            out, lse = attn_forward(q, k, v, s, mask, d**-0.5)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), f"differs on a persistent grid of {grid or 'SMs'}"


@pytest.mark.parametrize("d", [64, 128])
def test_cuda_half_tiles_match_whole_tiles(d, ncp_seed):
    """Half tiles (a warpgroup computes only the 64 keys of an item's first or last kv tile that its
    rows can see) against whole tiles: the skipped keys only add exact zeros, so out and lse are
    bitwise equal. Cases: aligned causal documents (the first warpgroup's diagonal tile is a low
    half), aligned windows of 513 (both warpgroups take a half tile), windows whose far tile the
    second warpgroup cannot see at all (449, 385), documents that start inside a q tile, and a last
    q tile whose second warpgroup has no rows (Tq % 128 < 64); with one CTA per item and on a
    persistent grid of 5; the default also against the fp64 oracle on the unaligned case."""
    if not _hopper():
        pytest.skip("needs the Hopper forward (sm_90a build, compute capability 9.0)")
    g = torch.Generator().manual_seed(ncp_seed)
    cases = [([1024, 2048, 512], 0), ([2048, 1024], 513), ([2048], 449), ([1536], 385), ([300, 77, 900, 41], 0),
             ([300, 77, 900, 41], 200), ([130, 1000, 5, 700], 513), ([128 * 9 + 30], 64), ([128 * 9 + 70], 65)]  # fmt: skip
    for lengths, window in cases:
        c = make_attention_case(lengths, 4, 2, d, device=DEV, generator=g)
        args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
        for grid in (HUGE_GRID, 5):
            with attn_debug(grid=grid, whole_tiles=True):
                want, want_lse = ncp.sink_attention(*args, window=window, return_lse=True)
            with attn_debug(grid=grid, whole_tiles=False):
                out, lse = ncp.sink_attention(*args, window=window, return_lse=True)
            msg = f"half tiles differ from whole tiles: lengths {lengths} window {window} grid {grid}"
            assert torch.equal(out, want) and torch.equal(lse, want_lse), msg
        if lengths == [130, 1000, 5, 700]:
            ref, ref_lse = attention_ref(*(t.double() for t in args[:4]), c["cu_seqlens"], window=window)
            lp, lp_lse = attention_ref(*args, window=window, upcast=False)
            assert_close_to_ref(out, ref, lp, name="out (half tiles)")
            assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse (half tiles)", magnitude_floor=1.0)


@pytest.mark.parametrize("scale", [0.3, -0.125, 0.0])
def test_cuda_any_softmax_scale(scale, ncp_seed, kernel):
    """Positive, negative and zero scales (the Hopper forward folds a positive scale into the
    exponent and scales the scores first otherwise) against the fp64 oracle, with gradients."""
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(1400, "random", mean=500, generator=g)
    c = make_attention_case(lengths, 8, 2, 128, device=DEV, generator=g)
    leaves = [c[n].detach().requires_grad_() for n in ("q", "k", "v", "sink")]
    dout = torch.randn(c["q"].shape, generator=g).to(DEV, torch.bfloat16)
    for window in (0, 300):
        out, lse = ncp.sink_attention(*leaves, c["cu_seqlens"], window=window, scale=scale, return_lse=True)
        grads = _grads(out, leaves, dout)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        ref, ref_lse = attention_ref(*ref_leaves, c["cu_seqlens"], window=window, scale=scale)
        ref_grads = _grads(ref, ref_leaves, dout.double())
        lp_leaves = [t.detach().requires_grad_() for t in leaves]
        lp, lp_lse = attention_ref(*lp_leaves, c["cu_seqlens"], window=window, scale=scale, upcast=False)
        lp_grads = _grads(lp, lp_leaves[:3], dout)
        allow = d_rounding_allowance(lambda *t: attention_ref(*t, c["cu_seqlens"], window=window, scale=scale), leaves,
                                     dout, out.dtype)  # fmt: skip
        assert_close_to_ref(out, ref, lp, name=f"out (scale {scale}, window {window})")
        assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse", magnitude_floor=1.0)
        for name, a, r, lo, al in zip(("dq", "dk", "dv"), grads, ref_grads, lp_grads, allow):
            assert_close_to_ref(a, r, lo, name=f"{name} (scale {scale}, window {window})", allowance=al)


def test_cuda_matches_cpu_c_path(ncp_seed):
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(600, "random", generator=g)
    c = make_attention_case(lengths, 4, 2, 64, dtype=torch.float16, device=DEV, generator=g)
    args = (c["q"], c["k"], c["v"], c["sink"])
    gpu, gpu_lse = ncp.sink_attention(*args, c["cu_seqlens"], window=100, return_lse=True)
    cpu, cpu_lse = ncp.sink_attention(*(t.cpu() for t in args), c["cu_seqlens"].cpu(), window=100, return_lse=True)
    ref, ref_lse = attention_ref(*(t.double() for t in args), c["cu_seqlens"], window=100)
    lp, lp_lse = attention_ref(*args, c["cu_seqlens"], window=100, upcast=False)
    assert_close_to_ref(gpu, ref, lp, name="gpu out")
    assert_close_to_ref(cpu.to(DEV), ref, lp, name="cpu out")
    assert_close_to_ref_ulp(gpu_lse, cpu_lse.to(DEV).double(), lp_lse.double(), name="gpu lse vs cpu", magnitude_floor=1.0)


@pytest.mark.parametrize("cp,window,chunk", [(2, 0, 512), (4, 513, 512), (4, 100, 64), (8, 0, 128)])
def test_cuda_simulated_cp_matches_whole_sequence(cp, window, chunk, ncp_seed, kernel):
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(5000, "random", mean=900, generator=g)
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=128, sliding_window=window,
                          magi_chunk_size=chunk)  # fmt: skip
    c = make_attention_case(lengths, 8, 2, 128, device=DEV, generator=g)
    cu = c["cu_seqlens"].cpu()
    plans = [flint._build_magi_plan(cu, cfg, testing.SimulatedGroup(cp, r)) for r in range(cp)]
    d = rmagi.dispatch(cu, cp, chunk)
    dout = torch.randn(c["q"].shape, generator=g).to(DEV, torch.bfloat16)
    ref = rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cu, dout, d, cp, window=window)
    lp = rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cu, dout, d, cp, window=window, upcast=False)
    loc = [[rcp.local_rows(t, d, r) for r in range(cp)] for t in (c["q"], c["k"], c["v"], dout)]
    outs, grads = testing.simulate_cp_attention(plans, loc[0], loc[1], loc[2], c["sink"], window, 128**-0.5, loc[3])
    allow = d_rounding_allowance(lambda *t: attention_ref(*t, cu.to(DEV), window=window),
                                 [c[n] for n in ("q", "k", "v", "sink")], dout, torch.bfloat16)  # fmt: skip
    for r in range(cp):
        rr, rl = ref.ranks[r], lp.ranks[r]
        assert_close_to_ref(outs[r], rr.out, rl.out, name=f"rank {r} out")
        for i, name in enumerate(("dq", "dk", "dv")):
            al = rcp.local_rows(allow[i], d, r)
            assert_close_to_ref(grads[r][i], getattr(rr, name), getattr(rl, name), name=f"rank {r} {name}", allowance=al)
    total = sum(gr[3].double() for gr in grads)
    lp_dsink = sink_grad_closed_form(lp.out, dout, lp.lse, c["sink"])
    whole_out = torch.zeros_like(ref.out, dtype=outs[0].dtype)  # the kernels' outputs in global order
    for r in range(cp):
        idx = d.local_token_global_indices(r).to(DEV)
        real = idx < whole_out.shape[0]
        whole_out[idx[real]] = outs[r][real]
    check_dsink(total, whole_out, ref.lse, dout, c["sink"], ref.dsink, lp_dsink, name="sum of dsink")


@pytest.mark.parametrize("sink", [True, False])
def test_cuda_nan_in_nan_out(sink, kernel):
    """A NaN in a query makes its row's out and lse NaN (never a silent 0 / -inf), on every kernel;
    rows that do not see the NaN stay finite."""
    c = make_attention_case([300, 200], 4, 2, 64, device=DEV)
    q, k, v, s, cu = c["q"].clone(), c["k"], c["v"], (c["sink"] if sink else None), c["cu_seqlens"]
    q[10, 1] = float("nan")
    out, lse = ncp.sink_attention(q, k, v, s, cu, return_lse=True)
    assert out[10, 1].isnan().all() and lse[1, 10].isnan()
    assert torch.isfinite(out[300:]).all() and torch.isfinite(lse[:, 300:]).all()


@pytest.mark.parametrize("cu, cp", [([0, 131072], 8), (list(range(0, 131073, 8192)), 8), ([0, 5, 700, 701, 4000, 9999], 4)])
def test_cuda_plan_tables_written_on_the_gpu_equal_the_host_tables(cu, cp):
    """device_tables writes a plan's tables from its runs with one kernel; they equal the host
    expansion (and so every property tests/test_flint_plan.py checks on the host)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=128, sliding_window=513)
    for r in (0, cp - 1):
        plan = flint._build_magi_plan(torch.tensor(cu, dtype=torch.int32), cfg, testing.SimulatedGroup(cp, r))
        for k in plan.keys.values():
            dev = k.device_tables(torch.device(DEV))
            for name in ("send_idx", "kv_src", "local_slot", "recv_slot"):
                assert torch.equal(dev[name].cpu(), getattr(k, name)), (cu[:3], r, k.window, name)
            for name in ("ret_off", "ret_idx"):
                assert torch.equal(dev[name].cpu(), k.mask_host[name]), (cu[:3], r, k.window, name)
            assert torch.equal(dev["mask"].row_lo.cpu(), k.mask_host["row_lo"])
            assert torch.equal(dev["mask"].row_hi.cpu(), k.mask_host["row_hi"])


def test_cuda_runs_expand_checks_its_runs_and_never_writes_outside():
    runs = torch.tensor([[0, 3, 1, 5, 1], [3, 2, 2, 9, 0]], dtype=torch.int32)
    out = torch.full((6,), -7, dtype=torch.int32, device=DEV)
    _C.runs_expand(runs=dl(runs), runs_dev=dl(runs.to(DEV)), out=dl(out), stream=torch.cuda.current_stream().cuda_stream)
    assert out.tolist() == [5, 6, 7, 9, -7, 9]
    big = torch.tensor([[0, 3, 1, -(2**31) + 5, 2**30]], dtype=torch.int32)  # t * step leaves int32, values do not
    _C.runs_expand(runs=dl(big), runs_dev=dl(big.to(DEV)), out=dl(out[:3]))
    assert out[:3].tolist() == [-(2**31) + 5, -(2**30) + 5, 5]
    with pytest.raises(ValueError, match="writes outside a table of 6"):
        bad = torch.tensor([[4, 3, 1, 0, 1]], dtype=torch.int32)
        _C.runs_expand(runs=dl(bad), runs_dev=dl(bad.to(DEV)), out=dl(out))
    with pytest.raises(ValueError, match="runs_dev must be a copy of runs"):
        _C.runs_expand(runs=dl(runs), out=dl(out))
    # a device copy that disagrees with the checked host runs: the kernel drops the stray writes
    guard = torch.full((16,), -7, dtype=torch.int32, device=DEV)
    stray = torch.tensor([[0, 3, 1, 1, 1], [2, 1000, 1, 0, 0]], dtype=torch.int32)
    _C.runs_expand(runs=dl(runs), runs_dev=dl(stray.to(DEV)), out=dl(guard[:6]))
    torch.cuda.synchronize()
    assert guard[6:].tolist() == [-7] * 10


@pytest.mark.skipif(not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"), reason="no DLPack C exchange API")
@pytest.mark.parametrize("mode", ["docs", "table"])
def test_cuda_exchange_path_matches_capsules(mode, monkeypatch):
    """The fast host path (tensors through the DLPack C exchange API, the stream from torch in C)
    gives the capsule path's bits, deterministic backward, on a side stream behind a queued spin:
    its kernels ran on the caller's current stream (the spin's), else they would have read inputs
    that the side stream writes only after the spin."""
    from nemo_cp_native import attention as A

    monkeypatch.setenv("NCP_DETERMINISTIC", "1")
    c = make_attention_case(doc_lengths(2048, "equal:512"), 8, 2, 128, dtype=torch.bfloat16, device=DEV)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    T = q.shape[0]
    starts = torch.repeat_interleave(cu[:-1], (cu[1:] - cu[:-1]).long()).to(torch.int32)
    mask = (AttnMask(cu_seqlens=cu, window=100) if mode == "docs" else
            AttnMask(row_lo=starts, row_hi=torch.arange(T, dtype=torch.int32, device=DEV), window=0))  # fmt: skip
    dout = torch.randn_like(q)
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(A, "_X", fast)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            qs = torch.zeros_like(q)
            torch.cuda._sleep(50_000_000)  # the inputs are written on the side stream after a spin
            qs.copy_(q)
            out, lse = attn_forward(qs, k, v, s, mask, 0.125)
            grads = attn_backward(dout, qs, k, v, s, out, lse, mask, 0.125)
        side.synchronize()
        runs.append((out, lse, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    want, want_lse = attn_forward(q, k, v, s, mask, 0.125)
    assert torch.equal(runs[0][0], want) and torch.equal(runs[0][1], want_lse)
