"""Prove the MagiAttention dispatch oracle right (spec flint_magi.md §1.3–1.4).

Worked vectors from the spec and Magi's docstring, an independent linear-scan re-implementation of
the greedy, brute-force vs closed-form workloads, partition invariants under hypothesis, the chunk
cap, and the remote K/V sets a rank needs (checked against a double loop and against attention).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nemo_cp_native.reference.cp_attention import local_rows
from nemo_cp_native.reference.magi import (
    DispatchRef,
    chunk_workloads,
    chunk_workloads_closed_form,
    dispatch,
    effective_chunk_size,
    load_per_rank,
    minheap_dispatch,
    padded_length,
    visible_remote_tokens,
)
from nemo_cp_native.reference.sink_attention import attention_positions_ref, attention_ref

HYP = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def cu_from_lengths(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


doc_lengths = st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=6)


def greedy_linear_scan(workloads, cp):
    """Independent restatement of the MinHeap greedy: heaviest first (ties: higher id first);
    each chunk to the non-full rank with the least (load, rank)."""
    n = len(workloads)
    limit = math.ceil(n / cp)
    order = sorted(range(n), key=lambda c: (-workloads[c], -c))
    loads, parts = [0] * cp, [[] for _ in range(cp)]
    for c in order:
        r = min((r for r in range(cp) if len(parts[r]) < limit), key=lambda r: (loads[r], r))
        parts[r].append(c)
        loads[r] += workloads[c]
    return [sorted(p) for p in parts]


# ---------------------------------------------------------------------------- worked vectors


def test_single_causal_doc_chunk1_cp2():
    d = dispatch(torch.tensor([0, 8], dtype=torch.int32), 2, requested_chunk=1)
    assert d == DispatchRef(8, 8, 1, ((0, 3, 4, 7), (1, 2, 5, 6)))
    assert load_per_rank(chunk_workloads([0, 8], 1, 8), d.partitions) == [18, 18]
    # The chunk cap alone gives chunk 1 here too: ceil(8 / (8 * 2)) = 1.
    assert dispatch([0, 8], 2, requested_chunk=512) == d
    assert d.local_token_global_indices(1).tolist() == [1, 2, 5, 6]


def test_two_docs_chunk4_cp2_solver_level():
    w = chunk_workloads([0, 10, 16], 4, 16)
    assert w == [10, 26, 22, 18]
    parts = minheap_dispatch(w, 2)
    assert parts == [[0, 1], [2, 3]]
    assert load_per_rank(w, parts) == [36, 40]


def test_magi_docstring_example():
    w = [8, 7, 6, 5, 4, 2, 2, 2]
    parts = minheap_dispatch(w, 2)
    assert parts == [[0, 3, 4, 5], [1, 2, 6, 7]]
    assert load_per_rank(w, parts) == [19, 17]


def test_ties_go_to_higher_chunk_id_first_and_lower_rank():
    # All equal: order 3,2,1,0; rank 0 gets 3, rank 1 gets 2, then (load 1, rank 0) wins: 1, then 0.
    assert minheap_dispatch([1, 1, 1, 1], 2) == [[1, 3], [0, 2]]
    assert minheap_dispatch([0, 0, 0], 3) == [[2], [1], [0]]
    # A full rank is dropped even when it has the least load.
    # Order 0, 3, 2, 1: rank 1 takes 3 and 2 (load 2, full) and is dropped, so 1 goes to rank 0.
    assert minheap_dispatch([10, 1, 1, 1], 2) == [[0, 1], [2, 3]]


# ---------------------------------------------------------------------------- chunk size, padding


def test_chunk_cap():
    assert effective_chunk_size(4096, 2) == 256  # ceil(4096 / 16)
    assert effective_chunk_size(100_000, 2) == 512  # requested wins
    assert effective_chunk_size(100_000, 2, requested=None) == 6250
    assert effective_chunk_size(4096, 2, requested=100) == 100
    assert effective_chunk_size(10, 2) == 1
    assert effective_chunk_size(100, 1) == 13  # ceil(100 / 8); C=1 still chunks
    assert effective_chunk_size(100, 2, min_chunks_per_rank=1) == 50
    with pytest.raises(ValueError, match="fewer than cp_size"):
        effective_chunk_size(1, 2)
    with pytest.raises(ValueError, match="fewer than cp_size"):
        effective_chunk_size(3, 4)
    with pytest.raises(ValueError):
        effective_chunk_size(0, 2)
    with pytest.raises(ValueError):
        effective_chunk_size(16, 2, requested=0)


def test_padded_length():
    assert padded_length(8, 1, 2) == 8
    assert padded_length(100, 13, 1) == 104
    assert padded_length(4097, 256, 2) == 4608
    assert padded_length(4096, 256, 2) == 4096
    d = dispatch([0, 30, 45], 4, requested_chunk=4)  # cap ceil(45/32) = 2
    assert (d.chunk_size, d.total_seqlen, d.total_seqlen_padded) == (2, 45, 48)


@given(lengths=doc_lengths, cp=st.sampled_from([1, 2, 3, 4, 8]), req=st.sampled_from([None, 1, 2, 3, 5, 16, 512]))
@HYP
def test_dispatch_invariants(lengths, cp, req):
    cu = cu_from_lengths(lengths)
    total = int(cu[-1])
    cap = math.ceil(total / (8 * cp))
    chunk = cap if req is None else min(req, cap)
    if math.ceil(total / chunk) < cp:
        with pytest.raises(ValueError):
            dispatch(cu, cp, req)
        return
    d = dispatch(cu, cp, req)
    assert d.chunk_size == chunk and d.total_seqlen == total
    t_pad = d.total_seqlen_padded
    assert t_pad % (chunk * cp) == 0 and total <= t_pad < total + chunk * cp
    n = t_pad // chunk
    # Each chunk exactly once; equal chunk counts; ascending per rank.
    flat = [c for p in d.partitions for c in p]
    assert sorted(flat) == list(range(n))
    assert all(len(p) == n // cp for p in d.partitions)
    assert all(list(p) == sorted(p) for p in d.partitions)
    idx = torch.cat([d.local_token_global_indices(r) for r in range(cp)])
    assert torch.equal(idx.sort().values, torch.arange(t_pad))
    # The greedy, restated independently.
    w = chunk_workloads(cu, chunk, t_pad)
    assert [list(p) for p in d.partitions] == greedy_linear_scan(w, cp)
    # Pure function of its inputs.
    assert dispatch(cu.tolist(), cp, req) == d


@given(lengths=doc_lengths, chunk=st.integers(1, 17), extra=st.integers(0, 3))
@HYP
def test_workloads_brute_force_equals_closed_form(lengths, chunk, extra):
    cu = cu_from_lengths(lengths)
    total = int(cu[-1])
    t_pad = (math.ceil(total / chunk) + extra) * chunk
    w = chunk_workloads(cu, chunk, t_pad)
    assert w == chunk_workloads_closed_form(cu, chunk, t_pad)
    assert sum(w) == sum(n * (n + 1) // 2 for n in lengths)  # all visible full-causal pairs
    assert all(x == 0 for x in w[math.ceil(total / chunk):])  # pure pad chunks


def test_zero_length_documents_change_nothing():
    assert chunk_workloads([0, 5, 5, 9], 2, 10) == chunk_workloads([0, 5, 9], 2, 10)
    assert dispatch([0, 0, 5, 5, 40], 2, 3) == dispatch([0, 5, 40], 2, 3)


# ---------------------------------------------------------------------------- remote K/V sets


def test_remote_tokens_worked_example():
    d = dispatch([0, 8], 2, requested_chunk=1)
    p = d.partitions
    assert {o: t.tolist() for o, t in visible_remote_tokens([0, 8], p, 1, 8, 0, 0).items()} == {1: [1, 2, 5, 6]}
    assert {o: t.tolist() for o, t in visible_remote_tokens([0, 8], p, 1, 8, 1, 0).items()} == {0: [0, 3, 4]}
    assert {o: t.tolist() for o, t in visible_remote_tokens([0, 8], p, 1, 8, 0, 2).items()} == {1: [2, 6]}
    assert {o: t.tolist() for o, t in visible_remote_tokens([0, 8], p, 1, 8, 1, 2).items()} == {0: [0, 4]}
    # Two documents: rank 1's tokens 5, 6 start a new document and never need token 4.
    p2 = minheap_dispatch(chunk_workloads([0, 5, 8], 1, 8), 2)
    got = visible_remote_tokens([0, 5, 8], p2, 1, 8, 1, 0)
    owner0 = set(p2[0])
    want = sorted(j for i in p2[1] for j in range(8) if j in owner0 and ((j <= i < 5) or (5 <= j <= i)))
    assert got[0].tolist() == want


small_doc_lengths = st.lists(st.integers(min_value=1, max_value=15), min_size=1, max_size=4)


@given(
    lengths=small_doc_lengths,
    cp=st.sampled_from([2, 3, 4]),
    req=st.sampled_from([1, 2, 4]),
    window=st.integers(0, 9),
)
@HYP
def test_remote_tokens_against_double_loop(lengths, cp, req, window):
    cu = cu_from_lengths(lengths)
    total = int(cu[-1])
    assume(total >= cp)
    d = dispatch(cu, cp, req)
    doc = [n for n, length in enumerate(lengths) for _ in range(length)]
    owner = {t: r for r in range(cp) for t in d.local_token_global_indices(r).tolist()}
    for rank in range(cp):
        got = visible_remote_tokens(cu, d.partitions, d.chunk_size, d.total_seqlen_padded, rank, window)
        assert sorted(got) == [o for o in range(cp) if o != rank]
        for o in got:
            want = set()
            for i in d.local_token_global_indices(rank).tolist():
                for j in range(total):
                    if i < total and owner[j] == o and doc[i] == doc[j] and j <= i and (window == 0 or i - j < window):
                        want.add(j)
            assert got[o].tolist() == sorted(want)
            assert all(j < total for j in got[o].tolist())  # pads are nobody's keys


@given(lengths=doc_lengths, window=st.integers(1, 6))
@HYP
def test_sliding_window_reaches_only_preceding_chunks(lengths, window):
    """Spec §1.6: a local chunk's windows reach at most ceil((W-1)/chunk) preceding chunks."""
    cu = cu_from_lengths(lengths)
    assume(int(cu[-1]) >= 16)
    d = dispatch(cu, 2, 3)
    c = d.chunk_size
    reach = math.ceil((window - 1) / c)
    for rank in range(2):
        mine = set(d.partitions[rank])
        allowed = {k for ch in mine for k in range(ch - reach, ch)} - mine
        got = visible_remote_tokens(cu, d.partitions, c, d.total_seqlen_padded, rank, window)
        for keys in got.values():
            assert {j // c for j in keys.tolist()} <= allowed


@pytest.mark.parametrize("window", [0, 1, 4])
def test_local_plus_remote_keys_suffice_for_attention(window):
    """Attention of a rank's queries over [its own keys + visible remote keys] equals the full oracle."""
    lengths = [int(x) for x in torch.randint(1, 20, (4,))]
    cu = cu_from_lengths(lengths)
    total, hq, hkv, dim, cp = int(cu[-1]), 4, 2, 4, 3
    q = torch.randn(total, hq, dim, dtype=torch.float64)
    k = torch.randn(total, hkv, dim, dtype=torch.float64)
    v = torch.randn(total, hkv, dim, dtype=torch.float64)
    sink = torch.randn(hq)
    out, lse = attention_ref(q, k, v, sink, cu, window=window)
    d = dispatch(cu, cp, 2)
    starts = torch.tensor([s for n, s in zip(lengths, cu.tolist()) for _ in range(n)])
    for rank in range(cp):
        idx = d.local_token_global_indices(rank)
        real = idx < total
        remote = visible_remote_tokens(cu, d.partitions, d.chunk_size, d.total_seqlen_padded, rank, window)
        keys = torch.cat([idx[real]] + list(remote.values()))
        lo = torch.where(real, starts[idx.clamp(max=total - 1)], idx + 1)
        if window:
            lo = torch.maximum(lo, idx - window + 1)
        o_r, l_r = attention_positions_ref(local_rows(q, d, rank), k[keys], v[keys], sink, idx, lo, keys)
        torch.testing.assert_close(o_r[real], out[idx[real]], rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(l_r[:, real], lse[:, idx[real]], rtol=1e-13, atol=1e-13)
        assert torch.equal(o_r[~real], torch.zeros_like(o_r[~real]))
