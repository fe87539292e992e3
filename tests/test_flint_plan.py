"""Flint Magi plans (``nemo_cp_native.flint`` over ``csrc/core/{magi_dispatch,plan}.c``), on the CPU.

1. Partition: the C solver equals the oracle ``reference.magi.dispatch`` (hypothesis, cp in
   {1,2,3,4,8}, requested chunk sizes above and below Magi's cap), the spec's worked vectors, the
   union over ranks is ``[0, T_pad)`` exactly once, one partition for every window and every call.
2. Exchange: each rank receives exactly the remote keys its queries can see
   (``reference.magi.visible_remote_tokens``), senders send exactly that, the K/V buffer is
   local ∪ received sorted by position.
3. Row bounds: the per-row buffer ranges the kernels read, against a brute-force mask (DESIGN §5).
4. Bad input: clear exceptions (asserted by message).
5. ``simulate_cp_attention`` on the CPU in fp32 against the float64 whole-sequence oracle.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nemo_cp_native import flint, testing
from nemo_cp_native._ops import _C, dl
from nemo_cp_native.reference import cp_attention as rcp
from nemo_cp_native.reference import magi as rmagi
from nemo_cp_native.testing import doc_lengths, make_attention_case, pack_documents


HYP = settings(max_examples=40, deadline=None, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
ENV = "MAGI_ATTENTION_MIN_CHUNKS_PER_RANK"


@pytest.fixture(autouse=True)
def _default_min_chunks(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)  # Magi's default of 8 chunks per rank


def config(window=0, chunk=512, hq=4, hkv=2, d=16):
    return SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, sliding_window=window,
                           magi_chunk_size=chunk)  # fmt: skip


def all_plans(cu, cp, cfg):
    return [flint._build_magi_plan(cu, cfg, testing.SimulatedGroup(cp, r)) for r in range(cp)]


packs = st.lists(st.integers(1, 300), min_size=1, max_size=8)
cps = st.sampled_from([1, 2, 3, 4, 8])
chunks = st.one_of(st.integers(1, 70), st.sampled_from([128, 512, 100_000]))  # large ones get capped
windows = st.sampled_from([1, 2, 7, 33, 64, 129, 513])


# ============================================================================ 1. partition


@given(lengths=packs, cp=cps, chunk=chunks, window=windows)
@HYP
def test_partition_equals_oracle(lengths, cp, chunk, window):
    assume(sum(lengths) >= cp)
    cu = pack_documents(lengths)
    ref = rmagi.dispatch(cu, cp, chunk)
    plans = all_plans(cu, cp, config(window, chunk))
    seen = []
    for r, plan in enumerate(plans):
        assert sorted(plan.keys) == [0, window]
        expected = ref.local_token_global_indices(r)
        for w, key in plan.keys.items():
            idx = key.local_token_global_indices
            assert idx.dtype == torch.int64 and idx.ndim == 1
            assert torch.equal(idx, expected), (r, w)
            assert (key.total_seqlen, key.total_seqlen_q, key.chunk_size) == (
                ref.total_seqlen, ref.total_seqlen_padded, ref.chunk_size)  # fmt: skip
            assert key.total_seqlen_k == key.total_seqlen_q and key.pad_size == ref.total_seqlen_padded - sum(lengths)
            assert (key.cp_size, key.cp_rank, key.window) == (cp, r, w)
            assert key.total_seqlen_q % (key.chunk_size * cp) == 0 and idx.numel() * cp == key.total_seqlen_q
        seen.append(expected)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(ref.total_seqlen_padded))  # once each
    again = flint._build_magi_plan(cu.clone(), config(window, chunk), testing.SimulatedGroup(cp, cp - 1))
    for w in (0, window):
        a, b = again.keys[w], plans[-1].keys[w]
        for name in ("local_token_global_indices", "send_idx", "recv_pos", "kv_pos", "kv_src"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.send_counts, a.recv_counts) == (b.send_counts, b.recv_counts)
        assert all(torch.equal(a.mask_host[n], b.mask_host[n]) for n in a.mask_host)


@given(lengths=st.lists(st.integers(1, 3), min_size=1, max_size=3), cp=st.sampled_from([2, 3, 4, 8]))
@HYP
def test_pack_too_short_for_cp_raises_like_the_oracle(lengths, cp):
    cu = pack_documents(lengths)
    if sum(lengths) >= cp:
        flint._build_magi_plan(cu, config(), testing.SimulatedGroup(cp, 0))
        return
    with pytest.raises(ValueError, match="fewer than cp_size"):
        rmagi.dispatch(cu, cp, 512)
    with pytest.raises(ValueError, match=f"too short for cp_size={cp}"):
        flint._build_magi_plan(cu, config(), testing.SimulatedGroup(cp, 0))


def test_worked_vectors(monkeypatch):
    # Spec §1.4.5: one causal document of 8 tokens, C=2; the cap ceil(8 / 16) forces chunk 1.
    p = all_plans(pack_documents([8]), 2, config(window=3))
    assert [x.keys[0].local_token_global_indices.tolist() for x in p] == [[0, 3, 4, 7], [1, 2, 5, 6]]
    assert p[0].keys[0].chunk_size == 1 and p[0].keys[3].local_token_global_indices.tolist() == [0, 3, 4, 7]
    # Spec §1.4.5 solver vector: docs [10, 6], chunk 4, C=2 -> rank 0 chunks [0, 1], rank 1 [2, 3]
    # (workloads [10, 26, 22, 18]). Reachable through the plan only when the cap allows chunk 4.
    monkeypatch.setenv(ENV, "2")
    p = all_plans(pack_documents([10, 6]), 2, config(chunk=4))
    assert [x.keys[0].local_token_global_indices.tolist() for x in p] == [list(range(8)), list(range(8, 16))]
    monkeypatch.delenv(ENV)
    # Spec §1.3 item 3: even C=1 pads to a chunk multiple (chunk = ceil(100 / 8) = 13 -> 104).
    k = flint._build_magi_plan(pack_documents([60, 40]), config(), None).keys[0]
    assert (k.chunk_size, k.total_seqlen_q, k.cp_size) == (13, 104, 1)
    assert k.local_token_global_indices.tolist() == list(range(104))
    # Chunk cap: ceil(45 / 32) = 2 with a request of 4, padded to 48.
    k = flint._build_magi_plan(pack_documents([30, 15]), config(chunk=4), testing.SimulatedGroup(4, 0)).keys[0]
    assert (k.chunk_size, k.total_seqlen, k.total_seqlen_q) == (2, 45, 48)
    # No window configured: only the full-causal key.
    assert list(flint._build_magi_plan(pack_documents([8]), config(window=0), None).keys) == [0]


@given(lengths=packs, cp=cps, mcr=st.integers(1, 4))
@HYP
def test_min_chunks_env_matches_oracle(lengths, cp, mcr, monkeypatch):
    monkeypatch.setenv(ENV, str(mcr))
    cu = pack_documents(lengths)
    try:
        ref = rmagi.dispatch(cu, cp, 64, min_chunks_per_rank=mcr)
    except ValueError:  # fewer chunks than ranks: the C build must refuse it too
        with pytest.raises(ValueError, match="too short for cp_size"):
            flint._build_magi_plan(cu, config(chunk=64), testing.SimulatedGroup(cp, 0))
        return
    for r, plan in enumerate(all_plans(cu, cp, config(chunk=64))):
        assert torch.equal(plan.keys[0].local_token_global_indices, ref.local_token_global_indices(r))


# ============================================================================ 2. exchange


@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=8), cp=st.sampled_from([2, 3, 4, 8]),
       chunk=chunks, window=windows)  # fmt: skip
@settings(HYP, max_examples=25)
def test_exchange_is_minimal_and_consistent(lengths, cp, chunk, window):
    assume(sum(lengths) >= cp)
    cu = pack_documents(lengths)
    ref = rmagi.dispatch(cu, cp, chunk)
    plans = all_plans(cu, cp, config(window, chunk))
    for w in (0, window):
        keys = [p.keys[w] for p in plans]
        vis = rmagi.visible_mask(cu, ref.total_seqlen_padded, w)
        for r, k in enumerate(keys):
            remote = rmagi.visible_remote_tokens(cu, ref.partitions, ref.chunk_size, ref.total_seqlen_padded, r, w)
            assert k.recv_counts[r] == 0 and k.send_counts[r] == 0
            assert list(k.recv_counts) == [0 if o == r else remote[o].numel() for o in range(cp)]
            want = torch.cat([remote[o] for o in range(cp) if o != r])
            assert torch.equal(k.recv_pos.long(), want), (r, w)
            local = k.local_token_global_indices
            union = torch.cat([local, want]).sort().values
            assert torch.equal(k.kv_pos.long(), union) and bool((union[1:] > union[:-1]).all())
            # buffer bookkeeping: kv_src orders [local; received] into kv_pos; slots invert it
            assert torch.equal(torch.cat([local, want])[k.kv_src.long()], union)
            assert torch.equal(union[k.local_slot.long()], local) and torch.equal(union[k.recv_slot.long()], want)
            assert k.visible_pairs == int(vis[local].sum())
            # what rank r sends to rank d is exactly what d receives from r, in d's order
            offs = [0]
            for n in k.send_counts:
                offs.append(offs[-1] + n)
            for d in range(cp):
                assert k.send_counts[d] == keys[d].recv_counts[r]
                sent = local[k.send_idx[offs[d] : offs[d + 1]].long()]
                start = sum(keys[d].recv_counts[:r])
                assert torch.equal(sent, keys[d].recv_pos[start : start + keys[d].recv_counts[r]].long()), (r, d, w)
    if window >= max(lengths):  # a window longer than every document is the full-causal mask
        assert torch.equal(plans[0].keys[window].recv_pos, plans[0].keys[0].recv_pos)


# ============================================================================ 3. row bounds (the kernels' table mask)


def _visible(cu: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Brute force [len(q_pos), len(k_pos)]: same document, key <= query, query - key < window."""
    T = int(cu[-1])
    doc = torch.full((int(max(q_pos.max(), k_pos.max())) + 1,), -1)
    for i, (s, e) in enumerate(zip(cu.tolist(), cu[1:].tolist())):
        doc[s:e] = i
    qi, kj = q_pos.long()[:, None], k_pos.long()[None, :]
    m = (doc[qi] == doc[kj]) & (qi < T) & (kj <= qi)
    return m & (qi - kj < window) if window else m


@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=6), cp=st.sampled_from([1, 2, 3, 4]),
       chunk=st.sampled_from([16, 64, 100, 200, 512]), window=st.sampled_from([0, 1, 63, 64, 129, 200]))  # fmt: skip
@settings(HYP, max_examples=25)
def test_row_bounds_match_brute_force(lengths, cp, chunk, window):
    assume(sum(lengths) >= cp)
    _check_row_bounds(pack_documents(lengths), cp, chunk, window)


def test_row_bounds_window_and_long_documents():
    _check_row_bounds(pack_documents([1000]), 1, 512, 129)
    _check_row_bounds(pack_documents([3000, 7, 900]), 3, 256, 700)


def _check_row_bounds(cu, cp, chunk, window):
    """Row i sees exactly the buffer slots [row_lo[i], row_hi[i]]; both bounds are non-decreasing
    (so any block of rows sees one contiguous slot range, every slot of which some row of the block
    sees: the kernels' tile ranges are exact); pad rows see nothing."""
    for plan in all_plans(cu, cp, config(window, chunk)):
        for w, k in plan.keys.items():
            mask = _visible(cu, k.local_token_global_indices, k.kv_pos, w)  # [L, Lkv]: row i sees slot j
            L, Lkv = mask.shape
            lo, hi = k.mask_host["row_lo"].long(), k.mask_host["row_hi"].long()
            slots = torch.arange(Lkv)
            rule = (slots[None, :] >= lo[:, None]) & (slots[None, :] <= hi[:, None])
            assert torch.equal(rule, mask), (k.cp_rank, w)
            assert bool((lo[1:] >= lo[:-1]).all()) and bool((hi[1:] >= hi[:-1]).all()), (k.cp_rank, w)
            # the kernels' own row rule (q_lo <= k_pos <= q_pos) agrees with the table
            pos_rule = (k.kv_pos[None, :] >= k.mask_host["q_lo"][:, None]) & (k.kv_pos[None, :].long() <= k.q_pos[:, None])
            assert torch.equal(pos_rule, mask)
            for bm in (64, 128):  # blocks of rows: the union of their ranges is [lo(first), hi(last)]
                for r0 in range(0, L, bm):
                    r1 = min(r0 + bm, L) - 1
                    seen = mask[r0 : r1 + 1].any(0)
                    if bool(seen.any()):
                        idx = seen.nonzero().flatten()
                        assert int(idx[0]) == int(lo[r0]) and int(idx[-1]) == int(hi[r1])
                        assert int(idx[-1]) - int(idx[0]) + 1 == int(seen.sum())
            assert int(k.visible_pairs) == int(mask.sum())


# ============================================================================ 4. bad input


@pytest.mark.parametrize(
    "cu,match",
    [
        (torch.tensor([0, 8], dtype=torch.int32, device="meta"), "CPU int32"),
        (torch.tensor([0, 8], dtype=torch.int64), "CPU int32"),
        ([0, 8], "CPU int32"),
        (torch.tensor([[0, 8]], dtype=torch.int32), "1-D"),
        (torch.tensor([1, 8], dtype=torch.int32), "start at 0"),
        (torch.tensor([0, 8, 8], dtype=torch.int32), "strictly increasing"),
        (torch.tensor([0, 8, 4], dtype=torch.int32), "strictly increasing"),
        (torch.tensor([0], dtype=torch.int32), "at least one document"),
        (torch.tensor([0, 3], dtype=torch.int32), "too short for cp_size=4"),
    ],
)
def test_build_rejects_bad_cu_seqlens(cu, match):
    with pytest.raises(ValueError, match=match):
        flint._build_magi_plan(cu, config(window=4), testing.SimulatedGroup(4, 1))


def test_build_rejects_bad_config():
    cu = pack_documents([64])
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        flint._build_magi_plan(cu, config(hq=4, hkv=3), None)
    with pytest.raises(ValueError, match="config.sliding_window must be a non-negative int"):
        flint._build_magi_plan(cu, config(window=-1), None)


def _cp1_case(T=200, hq=4, hkv=2, d=16, window=16):
    cu = pack_documents(doc_lengths(T, "window", window=window))
    plan = flint._build_magi_plan(cu, config(window, hq=hq, hkv=hkv, d=d), None)
    L = plan.keys[0].num_local_tokens
    q, k, v = torch.randn(L, hq, d), torch.randn(L, hkv, d), torch.randn(L, hkv, d)
    return plan, q, k, v, torch.randn(hq), cu


def test_attention_rejects_bad_input():
    plan, q, k, v, s, _ = _cp1_case(T=203)  # chunk ceil(203 / 8) = 26 -> 208 rows
    assert q.shape[0] == 208
    for w in (7, True, "16", None):
        with pytest.raises(ValueError, match="has no key in this FlintMagiPlan"):
            plan.attention(q, k, v, s, w, 0.25)
    with pytest.raises(ValueError, match=r"query must have shape \(208, 4, head_dim\)"):
        plan.attention(q[1:], k, v, s, 0, 0.25)
    with pytest.raises(ValueError, match="query must have shape"):
        plan.attention(q[:, :2], k, v, s, 16, 0.25)
    with pytest.raises(ValueError, match=r"key must have shape \(208, 2, 16\)"):
        plan.attention(q, k[:, :1], v, s, 0, 0.25)
    with pytest.raises(ValueError, match="value must match query's dtype"):
        plan.attention(q, k, v.double(), s, 0, 0.25)
    with pytest.raises(ValueError, match="sink must be float32 of shape"):
        plan.attention(q, k, v, s.double(), 0, 0.25)
    sim = flint._build_magi_plan(pack_documents([200]), config(16), testing.SimulatedGroup(2, 0))
    L = sim.keys[0].num_local_tokens
    with pytest.raises(ValueError, match="built for simulated ranks"):
        sim.attention(torch.randn(L, 4, 16), torch.randn(L, 2, 16), torch.randn(L, 2, 16), s, 0, 0.25)


def _local_variants(q, k, v, s):
    """(q, k, v, sink) with one or two things wrong or odd: shapes, dtypes, meta tensors, non-tensors,
    strides, sink dtype / shape; the plain call first."""
    def meta(t):
        return t.to("meta")

    edits = [
        lambda a: a, lambda a: (a[0][1:], *a[1:]), lambda a: (a[0][:, :2], *a[1:]), lambda a: (a[0][..., :8], *a[1:]),
        lambda a: (a[0][None], *a[1:]), lambda a: (a[0], a[1][:, :1], *a[2:]), lambda a: (a[0], a[1][..., :8], *a[2:]),
        lambda a: (*a[:2], a[2][1:], a[3]), lambda a: (a[0], a[1].double(), *a[2:]), lambda a: (*a[:2], a[2].half(), a[3]),
        lambda a: (*a[:3], a[3].double()), lambda a: (*a[:3], a[3][:2]), lambda a: (*a[:3], a[3][None]),
        lambda a: (meta(a[0]), *a[1:]), lambda a: (a[0], meta(a[1]), *a[2:]), lambda a: (*a[:3], meta(a[3])),
        lambda a: (a[0].tolist(), *a[1:]), lambda a: (*a[:3], None), lambda a: (a[0], a[1], 3.0, a[3]),
        lambda a: (a[0].double(), a[1].double(), a[2].double(), a[3]), lambda a: (a[0].transpose(0, 1).contiguous()
                                                                                   .transpose(0, 1), *a[1:]),
        lambda a: (a[0].to(torch.int32), a[1].to(torch.int32), a[2].to(torch.int32), a[3]),
    ]  # fmt: skip
    for i, e in enumerate(edits):
        for f in edits[: i + 1] if i < 4 else (edits[0],):  # a few pairs of edits too
            yield e(f((q, k, v, s)))


def test_local_checks_fast_path_agrees_with_the_explained_checks():
    """``FlintMagiPlan.attention`` checks its tensors with one expression (``flint._local_ok``) and
    walks the checks one by one (``flint._explain_local``) only to name what failed: both must
    accept exactly the same inputs."""
    plan, q, k, v, s, _ = _cp1_case(T=203)
    mkey = plan.keys[0]
    seen = {True: 0, False: 0}
    for args in _local_variants(q, k, v, s):
        ok = flint._local_ok(mkey, *args)
        try:
            flint._explain_local(mkey, *args)
            explained = True
        except (TypeError, ValueError):
            explained = False
        assert ok == explained, [getattr(a, "shape", a) for a in args]
        seen[ok] += 1
    assert seen[True] >= 2 and seen[False] >= 15, seen


def test_select():
    plans = [flint._build_magi_plan(pack_documents([n]), config(), None) for n in (40, 50, 60)]
    bp = flint.FlintMagiBatchPlans(plans=tuple(plans))
    for i in range(3):
        assert bp.select(torch.tensor([i])) is plans[i]
        assert bp.select(torch.arange(3)[i : i + 1]) is plans[i]  # a PP split of arange(chunks)
    assert bp.select(torch.tensor(2)) is plans[2]
    for bad, match in [(torch.tensor([1], dtype=torch.int32), "int64 tensor with one element"),
                       (torch.tensor([0, 1]), "int64 tensor with one element"), (1, "int64 tensor"),
                       (torch.tensor([3]), "3 is out of range for 3 plans"),
                       (torch.tensor([-1]), "-1 is out of range")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            bp.select(bad)


# ============================================================================ 5. attention vs oracle


def _window_docs(T, window, g):
    """Lengths summing to T around the window (W-1, W, W+1, 1, 2W, shuffled), always with one
    document shorter and one longer than W."""
    head = [2 * window + 1, window - 1]
    lengths = head + doc_lengths(T - sum(head), "window", window=window, generator=g)
    return [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]


def _max_rel_err(got: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    return float((got.detach().double() - ref).abs().max()) / scale


def test_cp1_plan_attention_matches_oracle(ncp_seed):
    plan, q, k, v, s, cu = _cp1_case(T=201 + ncp_seed % 50)
    key = plan.keys[16]
    T = key.total_seqlen
    leaves = [t.requires_grad_() for t in (q, k, v, s)]
    out = plan.attention(*leaves, 16, 0.3)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    d = rmagi.DispatchRef(T, key.total_seqlen_q, key.chunk_size, (tuple(range(key.total_seqlen_q // key.chunk_size)),))
    ref = rcp.cp_attention_ref(q[:T], k[:T], v[:T], s, cu, dout[:T], d, window=16, scale=0.3)
    r0 = ref.ranks[0]
    for name, got, want, full in [("out", out, r0.out, ref.out), ("dq", grads[0], r0.dq, ref.dq),
                                  ("dk", grads[1], r0.dk, ref.dk), ("dv", grads[2], r0.dv, ref.dv)]:  # fmt: skip
        assert _max_rel_err(got, want, float(full.abs().max())) <= 1e-5, name
    assert torch.all((grads[3].double() - ref.dsink).abs() <= 1e-5 * ref.dsink.abs().max() + 1e-6)


@pytest.mark.parametrize("cp", [2, 4])
def test_simulated_cp_matches_whole_sequence_oracle(cp, ncp_seed):
    """Every rank's out/dq/dk/dv against the float64 oracle, and the partial dsinks summed.

    Tolerance: both sides see the same fp32 inputs (the oracle upcasts them exactly) and the CPU
    kernels accumulate every sum in double, so the only errors are the final roundings to fp32
    (0.5 ulp, 2**-24 relative) and, for dK/dV, the fp32 sum of at most cp partials returned by
    other ranks (<= cp roundings). That is < 1e-6 of the largest magnitude; 1e-5 leaves 10x
    headroom and is still ~100x below the effect of a dropped or extra key (O(1/length)).
    """
    g = torch.Generator().manual_seed(ncp_seed)
    window = int(torch.randint(20, 60, (1,), generator=g))
    hd = [16, 24, 40, 64][int(torch.randint(0, 4, (1,), generator=g))]
    req = [8, 16, 512][int(torch.randint(0, 3, (1,), generator=g))]
    T = int(torch.randint(300, 700, (1,), generator=g))
    while rmagi.padded_length(T, rmagi.effective_chunk_size(T, cp, req), cp) == T:
        T += 1  # always some tail padding rows
    lengths = _window_docs(T, window, g)
    c = make_attention_case(lengths, 4, 2, hd, dtype=torch.float32, generator=g)
    cu, scale = c["cu_seqlens"], hd**-0.5
    plans = all_plans(cu, cp, config(window, req, d=hd))
    d = rmagi.dispatch(cu, cp, req)
    dout = torch.randn(c["q"].shape, generator=g)
    loc = [[rcp.local_rows(t, d, r) for r in range(cp)] for t in (c["q"], c["k"], c["v"], dout)]
    for w in (0, window):
        ref = rcp.cp_attention_ref(c["q"], c["k"], c["v"], c["sink"], cu, dout, d, cp, window=w, scale=scale)
        outs, grads = testing.simulate_cp_attention(plans, loc[0], loc[1], loc[2], c["sink"], w, scale, loc[3])
        mags = {n: float(getattr(ref, n).abs().max()) for n in ("out", "dq", "dk", "dv")}
        assert any(bool((rr.local_indices >= T).any()) for rr in ref.ranks)  # tail padding rows exist
        for r in range(cp):
            rr = ref.ranks[r]
            pad = rr.local_indices >= T
            for name, got in zip(("out", "dq", "dk", "dv"), (outs[r],) + grads[r][:3]):
                err = _max_rel_err(got, getattr(rr, name), mags[name])
                assert err <= 1e-5, f"window {w} rank {r} {name}: max err {err:.3g} of max |ref|"
                assert not bool(got[pad].any()), f"window {w} rank {r} {name}: pad rows not zero"
            # partial dsink of this rank == closed form over its real queries
            assert torch.allclose(grads[r][3].double(), rr.dsink, rtol=1e-5, atol=1e-6 * mags["out"])
        total = sum(gr[3].double() for gr in grads)
        p_sink = torch.exp(c["sink"].double()[:, None] - ref.lse)  # [Hq, T]
        budget = (p_sink * (dout.double() * ref.out).abs().sum(-1).T).sum(1)  # sum of |terms|
        assert torch.all((total - ref.dsink).abs() <= 1e-5 * budget + 1e-7), (w, total, ref.dsink)


# ============================================================================ 6. the rank step's exchange ops


def test_returned_rows_table_is_the_inverse_of_send_idx():
    cu = pack_documents([700, 33, 1200, 90])
    for plan in all_plans(cu, 4, config(window=129, chunk=64)):
        for k in plan.keys.values():
            off, idx = k.mask_host["ret_off"].tolist(), k.mask_host["ret_idx"].tolist()
            send = k.send_idx.tolist()
            assert len(off) == k.num_local_tokens + 1 and off[0] == 0 and off[-1] == len(send) == len(idx)
            for i in range(k.num_local_tokens):
                js = idx[off[i] : off[i + 1]]
                assert js == sorted(js) and all(send[j] == i for j in js)
            assert sorted(idx) == list(range(len(send)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exchange_ops_on_the_cpu(dtype):
    """kv_gather, kv_assemble and kv_grad_sum against torch indexing; out-of-range indices read zeros."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(10, 3, 8, generator=g).to(dtype) for _ in range(2))
    idx = torch.tensor([4, 0, 9, -1, 10], dtype=torch.int32)
    out = torch.empty(5, 3, 16, dtype=dtype)
    _C.kv_gather(a=dl(k), b=dl(v), idx=dl(idx), out=dl(out))
    want = torch.cat([k, v], -1)[idx.clamp(0, 9).long()]
    want[3:] = 0
    assert torch.equal(out, want)
    recv = torch.randn(4, 3, 16, generator=g).to(dtype)
    src = torch.tensor([10, 0, 13, 5, 11, 14, -2], dtype=torch.int32)
    kb, vb = torch.empty(7, 3, 8, dtype=dtype), torch.empty(7, 3, 8, dtype=dtype)
    _C.kv_assemble(k=dl(k), v=dl(v), recv=dl(recv), slot_src=dl(src), kbuf=dl(kb), vbuf=dl(vb))
    allkv = torch.cat([torch.cat([k, v], -1), recv, torch.zeros(1, 3, 16, dtype=dtype)])
    sel = allkv[torch.tensor([10, 0, 13, 5, 11, 14, 14])]
    assert torch.equal(kb, sel[..., :8]) and torch.equal(vb, sel[..., 8:])
    back = torch.randn(5, 3, 16, generator=g).to(dtype)
    slot = torch.tensor([2, 0, 6], dtype=torch.int32)
    off, ridx = torch.tensor([0, 2, 2, 5], dtype=torch.int32), torch.tensor([1, 4, 0, 2, 3], dtype=torch.int32)
    dk, dv = torch.empty(3, 3, 8, dtype=dtype), torch.empty(3, 3, 8, dtype=dtype)
    _C.kv_grad_sum(dkbuf=dl(kb), dvbuf=dl(vb), local_slot=dl(slot), back=dl(back), ret_off=dl(off), ret_idx=dl(ridx),
                   dk=dl(dk), dv=dl(dv))  # fmt: skip
    buf = torch.cat([kb, vb], -1).double()
    want = torch.stack([buf[2] + back[1].double() + back[4].double(), buf[0],
                        buf[6] + back[0].double() + back[2].double() + back[3].double()]).to(dtype)  # fmt: skip
    assert torch.equal(dk, want[..., :8]) and torch.equal(dv, want[..., 8:])
    with pytest.raises(ValueError, match="ret_off must have"):
        _C.kv_grad_sum(dkbuf=dl(kb), dvbuf=dl(vb), local_slot=dl(slot), back=dl(back), ret_off=dl(off[:3]),
                       ret_idx=dl(ridx), dk=dl(dk), dv=dl(dv))  # fmt: skip


# ============================================================================ 7. tables as runs


def test_runs_expand_matches_the_plain_loop_and_checks_its_runs():
    runs = torch.tensor([[0, 3, 1, 5, 1], [3, 2, 2, 9, 0], [4, 3, 2, -4, 3], [9, 0, 1, 0, 0]], dtype=torch.int32)
    big = torch.tensor([[0, 3, 1, -(2**31) + 5, 2**30]], dtype=torch.int32)  # t * step leaves int32, the values do not
    wide = torch.empty(3, dtype=torch.int32)
    _C.runs_expand(runs=dl(big), out=dl(wide))
    assert wide.tolist() == rmagi.expand_runs(big, 3).tolist() == [-(2**31) + 5, -(2**30) + 5, 5]
    out = torch.full((10,), -7, dtype=torch.int32)
    _C.runs_expand(runs=dl(runs), out=dl(out))
    want = rmagi.expand_runs(runs, 10, fill=-7)  # entries no run writes keep what out held
    assert out.tolist() == want.tolist() == [5, 6, 7, 9, -4, 9, -1, -7, 2, -7]
    bad = {
        "writes outside": [0, 11, 1, 0, 1],
        "len=-1 < 0": [0, -1, 1, 0, 1],
        "stride=0": [0, 2, 0, 0, 1],
        "writes outside a table of 10": [-1, 1, 1, 0, 1],
        "leaves int32": [0, 3, 1, 2**31 - 2, 1],
    }
    for match, run in bad.items():
        with pytest.raises(ValueError, match=re.escape(match)):
            _C.runs_expand(runs=dl(torch.tensor([run], dtype=torch.int32)), out=dl(out))
    with pytest.raises(ValueError, match=r"runs must be a host int32 tensor of shape \(runs, 5\)"):
        _C.runs_expand(runs=dl(runs[:, :4].contiguous()), out=dl(out))
    with pytest.raises(ValueError, match="runs_dev is only for a CUDA out"):
        _C.runs_expand(runs=dl(runs), out=dl(out), runs_dev=dl(runs))
    with pytest.raises(TypeError, match="missing required keyword argument 'out'"):
        _C.runs_expand(runs=dl(runs))


@pytest.mark.parametrize("cu, cp, window", [([0, 131072], 8, 513), (list(range(0, 131073, 8192)), 8, 513),
                                            ([0, 5, 700, 701, 4000, 9999], 4, 129)])  # fmt: skip
def test_plan_holds_runs_per_chunk_not_entries_per_token(cu, cp, window):
    """The plan is built as runs: their number grows with chunks x ranks and documents, not with
    tokens, and they expand to exactly the tables the attributes hold."""
    raw = _C.plan_build(dl(torch.tensor(cu, dtype=torch.int32)), cp, 0, 512, 8, (0, window))
    for w in raw["windows"]:
        runs = flint._runs(w["runs"])
        assert runs.shape[0] <= 12 * raw["n_chunks"] * cp + 8 * len(cu), (runs.shape, raw["n_chunks"])
        n = w["table_off"][-1]
        got = flint._expand(runs, n, torch.device("cpu"), [])
        assert torch.equal(got, rmagi.expand_runs(runs, n))


def test_plan_keys_are_the_dataclass_built_field_by_field():
    """The plan build makes its keys without the frozen dataclass's __init__ (flint._new_key): they
    must be the objects MagiAttentionKey(...) makes, every field set, a cache of their own."""
    import dataclasses

    plan = flint._build_magi_plan(pack_documents([300, 200]), config(window=33, chunk=64), testing.SimulatedGroup(2, 1))
    names = [f.name for f in dataclasses.fields(flint.MagiAttentionKey)]
    for w, key in plan.keys.items():
        assert type(key) is flint.MagiAttentionKey and key.window == w
        assert set(vars(key)) == set(names)
        made = flint.MagiAttentionKey(**{n: getattr(key, n) for n in names if n != "_cache"})
        assert all(getattr(made, n) == getattr(key, n) for n in names)
        with pytest.raises(dataclasses.FrozenInstanceError):
            key.window = 5
    assert plan.keys[0]._cache is not plan.keys[33]._cache  # each key writes out its own tables
    cpu = plan.keys[33].device_tables(torch.device("cpu"))
    assert plan.keys[33].device_tables(torch.device("cpu")) is cpu  # written out once per device, then cached
    assert torch.equal(cpu["send_idx"], plan.keys[33].send_idx) and cpu["mask"].window == 33
    assert not torch.equal(plan.keys[0].recv_pos, plan.keys[33].recv_pos)


def test_build_refuses_a_pack_of_too_many_chunks_before_allocating():
    cu = torch.tensor([0, 2**27], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens: a pack of 134217728 tokens in chunks of 1 needs 134217728 "
                                         r"chunks; at most 67108864 are supported \(raise config.magi_chunk_size\)"):
        flint._build_magi_plan(cu, config(chunk=1), None)
