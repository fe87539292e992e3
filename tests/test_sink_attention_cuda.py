"""CUDA sink attention against the float64 oracle (tolerance rule of STYLE.md), plus poisoned
outputs with guard bands, determinism, rank-simulated CP, and the CPU C path as second oracle.
Skipped without a GPU and a CUDA build."""

from __future__ import annotations

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native import flint
from nemo_cp_native._ops import _C, dl
from nemo_cp_native.reference import cp_attention as rcp
from nemo_cp_native.reference import magi as rmagi
from nemo_cp_native.reference.sink_attention import attention_ref, sink_grad_closed_form
from nemo_cp_native.reference.tolerance import assert_close_to_ref, assert_close_to_ref_ulp
from nemo_cp_native.testing_attention import doc_lengths, make_attention_case

from _attn_checks import check_dsink, d_rounding_allowance, tile_schedule_brute_force

pytestmark = pytest.mark.cuda

DEV = "cuda"


@pytest.fixture(params=["auto", "sm90-fwd-serial", "sm90-bwd-overlap", "portable"])
def fwd_kernel(request, monkeypatch):
    """Runs a test on the default kernels (on an H200: the Hopper forward with its default schedule
    on a persistent grid and the atomic-dQ backward), on the serial Hopper forward on a persistent grid
    of 7 CTAs (many work items each) with the deterministic Hopper backward, on the ping-pong Hopper
    forward with one CTA per work item, a 3-stage K/V ring, O copied out by the consumer threads
    (not the producer's TMA store), whole edge tiles (no half tiles) and the deterministic dK/dV
    kernel with MMA overlap, and on the portable mma.sync forward and backward (switches are read
    at each call)."""
    for var in ("NCP_FWD_VARIANT", "NCP_BWD_VARIANT", "NCP_SM90_FWD_SCHED", "NCP_SM90_FWD_PERSIST", "NCP_SM90_FWD_GRID",
                "NCP_SM90_FWD_STAGES", "NCP_SM90_FWD_FOLD", "NCP_SM90_FWD_LAZY", "NCP_SM90_FWD_EAGER_STORE",
                "NCP_SM90_FWD_OSTORE", "NCP_SM90_FWD_HALF", "NCP_SM90_FWD_EARLY",
                "NCP_SM90_BWD_OVERLAP", "NCP_DETERMINISTIC"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    if request.param == "portable":
        monkeypatch.setenv("NCP_FWD_VARIANT", "3")
        monkeypatch.setenv("NCP_BWD_VARIANT", "1")
    elif request.param == "sm90-fwd-serial":
        monkeypatch.setenv("NCP_SM90_FWD_SCHED", "serial")
        monkeypatch.setenv("NCP_SM90_FWD_PERSIST", "1")
        monkeypatch.setenv("NCP_SM90_FWD_GRID", "7")
        monkeypatch.setenv("NCP_DETERMINISTIC", "1")
    elif request.param == "sm90-bwd-overlap":
        monkeypatch.setenv("NCP_SM90_FWD_SCHED", "pingpong")
        monkeypatch.setenv("NCP_SM90_FWD_PERSIST", "0")
        monkeypatch.setenv("NCP_SM90_FWD_STAGES", "3")
        monkeypatch.setenv("NCP_SM90_FWD_OSTORE", "0")
        monkeypatch.setenv("NCP_SM90_FWD_HALF", "0")
        monkeypatch.setenv("NCP_SM90_BWD_OVERLAP", "1")
        monkeypatch.setenv("NCP_DETERMINISTIC", "1")
    return request.param


def test_cuda_hopper_forward_is_selected_on_sm90():
    """On compute capability 9.0 with an sm_90a build the default forward is the wgmma/TMA kernel,
    so the suite does not silently test only the fallback."""
    if torch.cuda.get_device_capability() != (9, 0) or "90a" not in ncp.build_info()["cuda_archs"].split(";"):
        pytest.skip("needs an sm_90a build on a compute capability 9.0 device")
    assert _C.sink_attn_fwd_variant() == 4
    assert _C.sink_attn_bwd_variant() == 4


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
def test_cuda_matches_oracle(case, dtype, ncp_seed, fwd_kernel):
    mode, total, hq, hkv, d, window = case
    lengths = doc_lengths(total, mode, window=window, generator=torch.Generator().manual_seed(ncp_seed))
    _check_case(lengths, hq, hkv, d, window, dtype, ncp_seed)


def test_cuda_no_sink_and_length_one_documents(ncp_seed, fwd_kernel):
    _check_case([1, 1, 5, 1, 200, 1, 64, 1], 4, 1, 64, 0, torch.bfloat16, ncp_seed, sink=False)
    _check_case([1, 1, 5, 1, 200, 1, 64, 1], 4, 1, 64, 3, torch.bfloat16, ncp_seed, sink=True)


def _guarded(shape, dtype, fill, pad=4096):
    """A tensor view inside a larger buffer whose head and tail hold a known pattern."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 2 * pad,), 7.0, dtype=torch.float32, device=DEV).to(dtype)
    buf[pad : pad + n] = fill
    return buf, buf[pad : pad + n].view(shape), pad


def test_cuda_poisoned_outputs_and_guards(ncp_seed, fwd_kernel):
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(1300, "random", generator=g)
    c = make_attention_case(lengths, 8, 2, 128, device=DEV, generator=g)
    q, k, v, s, cu = c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"]
    T, Hq, D = q.shape
    ob, out, pad = _guarded((T, Hq, D), q.dtype, float("nan"))
    lb, lse, _ = _guarded((Hq, T), torch.float32, float("nan"))
    _C.sink_attn_fwd(dl(q), dl(k), dl(v), dl(s), dl(out), dl(lse), D**-0.5, (dl(cu), 0), None)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    for b in (ob, lb):
        assert bool((b[:pad] == 7).all()) and bool((b[-pad:] == 7).all()), "a guard band was overwritten"
    dout = torch.randn_like(out)
    bufs = [_guarded(t.shape, t.dtype, float("nan")) for t in (q, k, v)]
    sb, dsink, _ = _guarded((Hq,), torch.float32, float("nan"))
    delta = torch.full((Hq, T), float("nan"), device=DEV)
    part = torch.full((Hq, _C.sink_attn_bwd_n_part(T)), float("nan"), device=DEV)
    det = int(fwd_kernel != "auto")  # auto: the atomic-dQ Hopper backward, from a poisoned accumulator
    acc = torch.full((Hq, (T + 63) // 64 * 64, D), float("nan"), device=DEV)
    _C.sink_attn_bwd(dl(q), dl(k), dl(v), dl(s), dl(out), dl(lse), dl(dout), dl(bufs[0][1]), dl(bufs[1][1]),
                     dl(bufs[2][1]), dl(dsink), dl(delta), dl(part), D**-0.5, (dl(cu), 0), det, None, dl(acc))  # fmt: skip
    torch.cuda.synchronize()
    for b, t, p in bufs + [(sb, dsink, pad)]:
        assert not t.isnan().any(), "an output element was never written"
        assert bool((b[:p] == 7).all()) and bool((b[-p:] == 7).all()), "a guard band was overwritten"
    if not det and _C.sink_attn_bwd_variant() == 4:  # the atomic-dQ path ran: it zeroed and filled acc
        assert not acc.isnan().any()


@pytest.mark.parametrize("d,window", [(128, 0), (64, 513)])
def test_cuda_strided_views_of_packed_qkv(d, window, ncp_seed, fwd_kernel):
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


def test_cuda_backward_is_deterministic(ncp_seed, fwd_kernel, monkeypatch):
    """Bitwise repeatable under NCP_DETERMINISTIC=1 (also the portable kernels' only mode)."""
    monkeypatch.setenv("NCP_DETERMINISTIC", "1")
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(4096, "random", mean=700, generator=g)
    c = make_attention_case(lengths, 16, 2, 128, device=DEV, generator=g, requires_grad=True)
    dout = torch.randn((c["q"].shape), generator=g).to(DEV, torch.bfloat16)
    runs = []
    for _ in range(2):
        out = ncp.sink_attention(c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"], window=513)
        runs.append(torch.autograd.grad(out, (c["q"], c["k"], c["v"], c["sink"]), dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d,window", [(128, 0), (64, 513), (128, 100)])
def test_cuda_atomic_dq_backward_matches_deterministic(d, window, ncp_seed, monkeypatch):
    """The default Hopper backward (dq from atomic reductions) against the deterministic one and the
    fp64 oracle; dk, dv and dsink stay bitwise repeatable, dq differs only in summation order."""
    if _C.sink_attn_bwd_variant() != 4:
        pytest.skip("needs the Hopper backward (sm_90a build, compute capability 9.0)")
    monkeypatch.delenv("NCP_DETERMINISTIC", raising=False)
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(3000, "random", mean=800, generator=g)
    c = make_attention_case(lengths, 8, 2, d, device=DEV, generator=g, requires_grad=True)
    args = (c["q"], c["k"], c["v"], c["sink"])
    dout = torch.randn(c["q"].shape, generator=g).to(DEV, torch.bfloat16)
    grads = {}
    for det in ("0", "1", "0"):
        monkeypatch.setenv("NCP_DETERMINISTIC", det)
        out = ncp.sink_attention(*args, c["cu_seqlens"], window=window)
        grads.setdefault(det, []).append(torch.autograd.grad(out, args, dout))
    (a1, a2), (dt,) = grads["0"], grads["1"]
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


@pytest.mark.parametrize("stages", ["2", "3"])
@pytest.mark.parametrize("sched", ["serial", "pingpong"])
@pytest.mark.parametrize("d,window,mode", [(128, 0, "random"), (128, 513, "random"), (64, 1, "window"), (128, 0, "tiny")])
def test_cuda_persistent_forward_matches_one_cta_per_item(stages, sched, d, window, mode, ncp_seed, monkeypatch):
    """The persistent Hopper forward (grids of 1, 5 and one CTA per SM walking the work items, the
    Q buffers and the K/V ring carried across items) against one CTA per item: the same arithmetic
    per item, so out and lse are bitwise equal (2- and 3-stage rings; at D = 128 the 3-stage ring
    has a single Q buffer). On the grid of 5 also with the O rescale done on every tile (not only
    when a row maximum changed), with O copied out by the consumer threads instead of the
    producer's TMA store, and with that store issued only when the Q buffer is needed again."""
    if _C.sink_attn_fwd_variant() != 4:
        pytest.skip("needs the Hopper forward (sm_90a build, compute capability 9.0)")
    for var in ("NCP_FWD_VARIANT", "NCP_SM90_FWD_GRID", "NCP_SM90_FWD_LAZY", "NCP_SM90_FWD_EAGER_STORE",
                "NCP_SM90_FWD_OSTORE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCP_SM90_FWD_SCHED", sched)
    monkeypatch.setenv("NCP_SM90_FWD_STAGES", stages)
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(2900, mode, window=window, mean=400, generator=g)
    c = make_attention_case(lengths, 8, 2, d, device=DEV, generator=g)
    args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
    monkeypatch.setenv("NCP_SM90_FWD_PERSIST", "0")
    want, want_lse = ncp.sink_attention(*args, window=window, return_lse=True)
    monkeypatch.setenv("NCP_SM90_FWD_PERSIST", "1")
    for grid in ("1", "5", None):
        if grid is None:
            monkeypatch.delenv("NCP_SM90_FWD_GRID", raising=False)
        else:
            monkeypatch.setenv("NCP_SM90_FWD_GRID", grid)
        out, lse = ncp.sink_attention(*args, window=window, return_lse=True)
        assert torch.equal(out, want), f"out differs on a persistent grid of {grid or 'one CTA per SM'}"
        assert torch.equal(lse, want_lse), f"lse differs on a persistent grid of {grid or 'one CTA per SM'}"
    monkeypatch.setenv("NCP_SM90_FWD_GRID", "5")
    for lazy, ostore, eager in (("0", "1", "1"), ("1", "0", "1"), ("0", "0", "1"), ("1", "1", "0")):
        monkeypatch.setenv("NCP_SM90_FWD_LAZY", lazy)
        monkeypatch.setenv("NCP_SM90_FWD_OSTORE", ostore)
        monkeypatch.setenv("NCP_SM90_FWD_EAGER_STORE", eager)
        out, lse = ncp.sink_attention(*args, window=window, return_lse=True)
        msg = f"differs with lazy={lazy} ostore={ostore} eager_store={eager}"
        assert torch.equal(out, want) and torch.equal(lse, want_lse), msg


@pytest.mark.parametrize("stages", ["2", "3"])
@pytest.mark.parametrize("sched", ["serial", "pingpong"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_half_tiles_match_whole_tiles(stages, sched, d, ncp_seed, monkeypatch):
    """Half tiles (a warpgroup computes only the 64 keys of an item's first or last kv tile that its
    rows can see) against whole tiles (NCP_SM90_FWD_HALF=0): the skipped keys only add exact zeros,
    so out and lse are bitwise equal. Cases: aligned causal documents (the first warpgroup's
    diagonal tile is a low half), aligned windows of 513 (both warpgroups take a half tile),
    windows whose far tile the second warpgroup cannot see at all (449, 385), documents that start
    inside a q tile, and a last q tile whose second warpgroup has no rows (Tq % 128 < 64); with one
    CTA per item and on a persistent grid of 5. The same bits with NCP_SM90_FWD_EARLY=1 (the next
    item's S(0) issued with the last P V). Also the default (half tiles) against the fp64 oracle
    on the unaligned case."""
    if _C.sink_attn_fwd_variant() != 4:
        pytest.skip("needs the Hopper forward (sm_90a build, compute capability 9.0)")
    for var in ("NCP_FWD_VARIANT", "NCP_SM90_FWD_PERSIST", "NCP_SM90_FWD_GRID", "NCP_SM90_FWD_HALF",
                "NCP_SM90_FWD_EARLY", "NCP_SM90_FWD_LAZY", "NCP_SM90_FWD_OSTORE", "NCP_SM90_FWD_EAGER_STORE", "NCP_SM90_FWD_FOLD"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCP_SM90_FWD_SCHED", sched)
    monkeypatch.setenv("NCP_SM90_FWD_STAGES", stages)
    g = torch.Generator().manual_seed(ncp_seed)
    cases = [
        ([1024, 2048, 512], 0),
        ([2048, 1024], 513),
        ([2048], 449),
        ([1536], 385),
        ([300, 77, 900, 41], 0),
        ([300, 77, 900, 41], 200),
        ([130, 1000, 5, 700], 513),
        ([128 * 9 + 30], 64),
        ([128 * 9 + 70], 65),
    ]
    for lengths, window in cases:
        c = make_attention_case(lengths, 4, 2, d, device=DEV, generator=g)
        args = (c["q"], c["k"], c["v"], c["sink"], c["cu_seqlens"])
        for grid in (None, "5"):
            if grid is None:
                monkeypatch.setenv("NCP_SM90_FWD_PERSIST", "0")
                monkeypatch.delenv("NCP_SM90_FWD_GRID", raising=False)
            else:
                monkeypatch.setenv("NCP_SM90_FWD_PERSIST", "1")
                monkeypatch.setenv("NCP_SM90_FWD_GRID", grid)
            monkeypatch.setenv("NCP_SM90_FWD_HALF", "0")
            want, want_lse = ncp.sink_attention(*args, window=window, return_lse=True)
            monkeypatch.delenv("NCP_SM90_FWD_HALF")
            out, lse = ncp.sink_attention(*args, window=window, return_lse=True)
            msg = f"half tiles differ from whole tiles: lengths {lengths} window {window} grid {grid}"
            assert torch.equal(out, want) and torch.equal(lse, want_lse), msg
            monkeypatch.setenv("NCP_SM90_FWD_EARLY", "1")
            out_e, lse_e = ncp.sink_attention(*args, window=window, return_lse=True)
            monkeypatch.delenv("NCP_SM90_FWD_EARLY")
            msg = f"early S(0) differs: lengths {lengths} window {window} grid {grid}"
            assert torch.equal(out_e, want) and torch.equal(lse_e, want_lse), msg
        if lengths == [130, 1000, 5, 700]:
            ref, ref_lse = attention_ref(*(t.double() for t in args[:4]), c["cu_seqlens"], window=window)
            lp, lp_lse = attention_ref(*args, window=window, upcast=False)
            assert_close_to_ref(out, ref, lp, name="out (half tiles)")
            assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse (half tiles)", magnitude_floor=1.0)


def _tile_schedule(seen: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The brute-force schedule as the CSR tables the kernels read (entry = kv tile * 2 + full)."""
    off, ent = [0], []
    for row in tile_schedule_brute_force(seen, bm, bn):
        ent += [kt * 2 + full for kt, full in row]
        off.append(len(ent))
    return torch.tensor(off, dtype=torch.int32), torch.tensor(ent, dtype=torch.int32)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sink", [True, False])
def test_cuda_forward_query_tiles_without_keys(d, sink, ncp_seed, monkeypatch):
    """Positions mode with whole query tiles that see no key (work items without kv tiles) between
    ordinary ones: out 0 and lse = sink (or -inf) there, the oracle elsewhere, and every Hopper grid,
    schedule and epilogue gives the same bits (on small persistent grids a CTA meets empty items
    between full ones and back to back)."""
    from nemo_cp_native.attention import AttnMask, attn_forward
    from nemo_cp_native.reference.sink_attention import attention_positions_ref

    for var in ("NCP_FWD_VARIANT", "NCP_SM90_FWD_SCHED", "NCP_SM90_FWD_PERSIST", "NCP_SM90_FWD_GRID",
                "NCP_SM90_FWD_STAGES", "NCP_SM90_FWD_LAZY", "NCP_SM90_FWD_OSTORE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    g = torch.Generator().manual_seed(ncp_seed)
    tq, tk, hq, hkv = 128 * 6 - 37, 500, 4, 2
    k_pos = torch.randint(0, 3 * tk, (tk,), generator=g).sort().values.to(torch.int32)
    q_pos = torch.randint(0, 3 * tk, (tq,), generator=g).to(torch.int32)
    width = torch.randint(0, 3 * tk, (tq,), generator=g)
    q_lo = (q_pos.long() - width).to(torch.int32)
    for t in (1, 2, 4):  # tiles 1, 2 and 4 see nothing
        q_lo[128 * t : 128 * (t + 1)] = torch.iinfo(torch.int32).max
    seen = (k_pos[None, :] >= q_lo[:, None]) & (k_pos[None, :] <= q_pos[:, None])
    off, ent = _tile_schedule(seen, 128, 64)
    n_kv = (off[1:] - off[:-1]).tolist()
    assert n_kv[1] == n_kv[2] == n_kv[4] == 0 and min(n_kv[0], n_kv[3], n_kv[5]) > 0, n_kv
    mask = AttnMask(q_pos=q_pos.to(DEV), q_lo=q_lo.to(DEV), k_pos=k_pos.to(DEV), fwd_off=off.to(DEV),
                    fwd_ent=ent.to(DEV))  # fmt: skip
    c = make_attention_case([tq], hq, hkv, d, device=DEV, generator=g)
    kc = make_attention_case([tk], hkv, hkv, d, device=DEV, generator=g)
    q, k, v, s = c["q"], kc["k"], kc["v"], (c["sink"] if sink else None)
    scale = d**-0.5
    out, lse = attn_forward(q, k, v, s, mask, scale)
    empty = ~seen.any(1)
    assert bool(empty.any())
    assert not out[empty.to(DEV)].any(), "a row that sees nothing must output exactly 0"
    want = s[:, None].expand(-1, tq) if sink else torch.full((hq, tq), float("-inf"), device=DEV)
    # lse = (sink log2(e) + log2(1)) ln(2) in fp32 on the GPU: the sink up to rounding
    torch.testing.assert_close(lse[:, empty.to(DEV)], want[:, empty.to(DEV)], rtol=1e-6, atol=1e-6)
    pos = (mask.q_pos, mask.q_lo, mask.k_pos)
    ref, ref_lse = attention_positions_ref(q.double(), k.double(), v.double(), None if s is None else s.double(), *pos,
                                           scale=scale)  # fmt: skip
    lp, lp_lse = attention_positions_ref(q, k, v, s, *pos, scale=scale, upcast=False)
    assert_close_to_ref(out, ref, lp, name="out")
    assert_close_to_ref_ulp(lse, ref_lse, lp_lse.double(), name="lse", magnitude_floor=1.0)
    if _C.sink_attn_fwd_variant() != 4:
        return
    variants = [
        {"NCP_SM90_FWD_PERSIST": "0"},
        {"NCP_SM90_FWD_GRID": "2"},
        {"NCP_SM90_FWD_GRID": "1"},
        {"NCP_SM90_FWD_GRID": "2", "NCP_SM90_FWD_LAZY": "0"},
        {"NCP_SM90_FWD_GRID": "1", "NCP_SM90_FWD_LAZY": "0", "NCP_SM90_FWD_OSTORE": "0"},
        {"NCP_SM90_FWD_GRID": "2", "NCP_SM90_FWD_EAGER_STORE": "0"},
        {"NCP_SM90_FWD_GRID": "3", "NCP_SM90_FWD_OSTORE": "0"},
        {"NCP_SM90_FWD_GRID": "2", "NCP_SM90_FWD_SCHED": "serial"},
        {"NCP_SM90_FWD_GRID": "2", "NCP_SM90_FWD_STAGES": "3"},
    ]
    for env in variants:
        for var in ("NCP_SM90_FWD_PERSIST", "NCP_SM90_FWD_GRID", "NCP_SM90_FWD_LAZY", "NCP_SM90_FWD_EAGER_STORE",
                    "NCP_SM90_FWD_OSTORE",
                    "NCP_SM90_FWD_SCHED", "NCP_SM90_FWD_STAGES"):  # fmt: skip
            monkeypatch.delenv(var, raising=False)
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        o2, l2 = attn_forward(q, k, v, s, mask, scale)
        assert torch.equal(o2, out) and torch.equal(l2, lse), f"differs with {env}"


@pytest.mark.parametrize("scale", [0.3, -0.125, 0.0])
def test_cuda_any_softmax_scale(scale, ncp_seed, fwd_kernel, monkeypatch):
    """Positive, negative and zero scales (the Hopper forward folds a positive scale into the
    exponent on full tiles and scales first otherwise) against the fp64 oracle, with gradients."""
    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(1400, "random", mean=500, generator=g)
    c = make_attention_case(lengths, 8, 2, 128, device=DEV, generator=g)
    leaves = [c[n].detach().requires_grad_() for n in ("q", "k", "v", "sink")]
    dout = torch.randn(c["q"].shape, generator=g).to(DEV, torch.bfloat16)
    for window, fold in ((0, "1"), (300, "1"), (0, "0")):
        monkeypatch.setenv("NCP_SM90_FWD_FOLD", fold)
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
def test_cuda_simulated_cp_matches_whole_sequence(cp, window, chunk, ncp_seed, fwd_kernel):
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(ncp_seed)
    lengths = doc_lengths(5000, "random", mean=900, generator=g)
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=128, sliding_window=window,
                          magi_chunk_size=chunk)  # fmt: skip
    c = make_attention_case(lengths, 8, 2, 128, device=DEV, generator=g)
    cu = c["cu_seqlens"].cpu()
    plans = [flint._build_magi_plan(cu, cfg, flint.SimulatedGroup(cp, r)) for r in range(cp)]
    d = rmagi.dispatch(cu, cp, chunk)
    dout = torch.randn(c["q"].shape, generator=g).to(DEV, torch.bfloat16)
    ref = rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cu, dout, d, cp, window=window)
    lp = rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cu, dout, d, cp, window=window, upcast=False)
    loc = [[rcp.local_rows(t, d, r) for r in range(cp)] for t in (c["q"], c["k"], c["v"], dout)]
    outs, grads = flint.simulate_cp_attention(plans, loc[0], loc[1], loc[2], c["sink"], window, 128**-0.5, loc[3])
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
