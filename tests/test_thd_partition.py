"""``nemo_cp_native.thd_partition_indices`` is Transformer Engine's DualChunkSwap partition, bit for bit.

1. Bit-identical to the oracle ``reference.te_partition.thd_get_partitioned_indices`` on random
   layouts (``validate=False``: TE's exact answer on any input, including slots past
   ``cu_seqlens[-1]``, documents past ``total_tokens``, lengths not divisible by ``2 * cp``,
   non-monotone and negative boundaries), the worked examples of spec ``mimo_te.md`` §11.4/§11.6,
   the closed form on valid layouts, and the union over ranks being a permutation.
2. int32 output on the device of ``cu_seqlens``, every element written and nothing outside it.
3. Every validation error, with a message naming the argument.
4. A hypothesis property test.
5. CUDA (``@pytest.mark.cuda``): CUDA == CPU == oracle, output device, host syncs.
6. Integer hygiene (issue 17): the binary search past 2^30 entries (a segfault before), TE's int32
   wraparound on boundaries near the int32 limits, ``thd_partition_validate`` with ``total_tokens``,
   arguments beyond int64 named in the error.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nemo_cp_native.testing import count_syncs as _count_syncs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_cp_native import _C, thd_partition_indices
from nemo_cp_native._ops import dl
from nemo_cp_native.reference.te_partition import thd_get_partitioned_indices as te_oracle

HYP = settings(
    max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
POISON = -0x7FFFFFFF  # int32 sentinel (STYLE 12)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pick(g, choices):
    return choices[int(torch.randint(0, len(choices), (), generator=g))]


def _valid_lengths(g, cp, max_docs=6, max_units=5):
    n = int(torch.randint(1, max_docs + 1, (), generator=g))
    return (torch.randint(1, max_units + 1, (n,), generator=g) * 2 * cp).tolist()


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _random_layout(g, mode):
    """(cu_seqlens int32, total_tokens, cp) for one of the layout families below."""
    cp = _pick(g, [1, 2, 3, 4, 8])
    unit = 2 * cp
    if mode == "valid":  # divisible lengths, cu[-1] == total: a true partition
        cu = _cu(_valid_lengths(g, cp))
        return i32(cu), cu[-1], cp
    if mode == "past_end":  # total_tokens beyond cu[-1]: TE continues the last document's tail
        cu = _cu(_valid_lengths(g, cp))
        return i32(cu), cu[-1] + unit * int(torch.randint(1, 4, (), generator=g)), cp
    if mode == "short_total":  # documents past total_tokens are never reached
        cu = _cu(_valid_lengths(g, cp))
        total = unit * int(torch.randint(1, cu[-1] // unit + 1, (), generator=g))
        return i32(cu), total, cp
    if mode == "nondivisible":  # any positive lengths: TE silently mis-partitions, we must too
        cu = _cu(torch.randint(1, 4 * unit, (int(torch.randint(1, 6, (), generator=g)),), generator=g).tolist())
        return i32(cu), unit * int(torch.randint(1, 8, (), generator=g)), cp
    if mode == "garbage":  # non-monotone, negative, zero-length documents, a non-zero start
        n = int(torch.randint(2, 8, (), generator=g))
        cu = torch.randint(-50, 200, (n,), generator=g, dtype=torch.int32)
        return cu, unit * int(torch.randint(1, 12, (), generator=g)), cp
    raise AssertionError(mode)


MODES = ["valid", "past_end", "short_total", "nondivisible", "garbage"]


# =============================================================================================
# 1. Bit-identical to the TE oracle
# =============================================================================================


@pytest.mark.parametrize("mode", MODES)
def test_matches_te_oracle_on_any_input(mode, ncp_seed):
    g = gen(ncp_seed)
    for _ in range(40):
        cu, total, cp = _random_layout(g, mode)
        for rank in range(cp):
            want = te_oracle(cu, total, cp, rank)
            got = thd_partition_indices(cu, total, cp, rank, validate=False)
            assert got.dtype == torch.int32 and got.device == cu.device and got.shape == (total // cp,)
            assert torch.equal(got, want), (cu.tolist(), total, cp, rank, got.tolist(), want.tolist())
            if mode == "valid":  # validation passes and changes nothing
                assert torch.equal(thd_partition_indices(cu, total, cp, rank), want)


TE_EXAMPLES = [  # (cu_seqlens, total_tokens, cp, [indices per rank]): spec §11.4 and §11.6
    ([0, 8], 16, 2, [[0, 1, 6, 7, 8, 9, 10, 11], [2, 3, 4, 5, 6, 7, 8, 9]]),  # slots past cu[-1]
    ([0, 6, 8], 8, 2, [[0, 3, 4, 6], [1, 2, 3, 6]]),  # non-divisible lengths
    ([0, 8, 16], 16, 2, [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),  # TE's own unit test
    ([0, 4, 12], 12, 2, [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]),
    ([0, 16], 16, 4, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
    ([0, 8, 16], 16, 4, [[0, 7, 8, 15], [1, 6, 9, 14], [2, 5, 10, 13], [3, 4, 11, 12]]),
]


@pytest.mark.parametrize("cu,total,cp,expected", TE_EXAMPLES)
def test_worked_examples(cu, total, cp, expected):
    valid = all((b - a) % (2 * cp) == 0 for a, b in zip(cu, cu[1:]))
    for rank in range(cp):
        assert thd_partition_indices(i32(cu), total, cp, rank, validate=False).tolist() == expected[rank]
        if valid:
            assert thd_partition_indices(i32(cu), total, cp, rank).tolist() == expected[rank]


def test_documents_past_total_are_ignored():
    assert torch.equal(thd_partition_indices(i32([0, 8, 16]), 8, 2, 0, validate=False),
                       thd_partition_indices(i32([0, 8]), 8, 2, 0))


def test_closed_form_and_permutation(ncp_seed):
    """Valid layouts: rank r holds chunk r then chunk 2W-1-r of each document; ranks partition 0..T-1."""
    g = gen(ncp_seed)
    for _ in range(40):
        cp = _pick(g, [1, 2, 3, 4, 8])
        lengths = _valid_lengths(g, cp, max_docs=8)
        cu = _cu(lengths)
        seen = []
        for rank in range(cp):
            expected = []
            for start, n in zip(cu, lengths):
                c = n // (2 * cp)
                expected += list(range(start + rank * c, start + (rank + 1) * c))
                expected += list(range(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c))
            got = thd_partition_indices(i32(cu), cu[-1], cp, rank).tolist()
            assert got == expected, (cu, cp, rank)
            seen += got
        assert sorted(seen) == list(range(cu[-1]))


def test_input_layout_variants(ncp_seed):
    """Non-contiguous cu_seqlens (a strided view) and Python-int-like arguments give the same answer."""
    import numpy as np

    g = gen(ncp_seed)
    cu = _cu(_valid_lengths(g, 2))
    want = te_oracle(i32(cu), cu[-1], 2, 1)
    strided = torch.stack([i32(cu), i32(cu) * 0 - 7], dim=1)[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(thd_partition_indices(strided, cu[-1], 2, 1), want)
    assert torch.equal(thd_partition_indices(i32(cu), np.int64(cu[-1]), np.int32(2), torch.tensor(1)), want)


def test_writes_every_slot_and_nothing_else(ncp_seed):
    """The kernel writes all of ``out`` and nothing around it (sentinel-guarded buffer, STYLE 12)."""
    g = gen(ncp_seed)
    for mode in MODES:
        cu, total, cp = _random_layout(g, mode)
        n, pad = total // cp, 5
        buf = torch.full((n + 2 * pad,), POISON, dtype=torch.int32)
        out = buf[pad : pad + n]
        rank = int(torch.randint(0, cp, (), generator=g))
        _C.thd_partition(dl(cu), dl(out), total, cp, rank, None)
        assert torch.equal(out, te_oracle(cu, total, cp, rank))
        assert (buf[:pad] == POISON).all() and (buf[pad + n :] == POISON).all()


# =============================================================================================
# 3. Validation errors
# =============================================================================================

ERRORS = [  # (id, cu_seqlens, total, cp, rank, validate, type, message regex)
    ("cp_size_0", i32([0, 8]), 8, 0, 0, False, ValueError, r"cp_size must be > 0; got 0"),
    ("cp_size_negative", i32([0, 8]), 8, -2, 0, True, ValueError, r"cp_size must be > 0; got -2"),
    ("rank_negative", i32([0, 8]), 8, 2, -1, False, ValueError, r"cp_rank must be in \[0, cp_size=2\); got -1"),
    ("rank_too_big", i32([0, 8]), 8, 2, 2, True, ValueError, r"cp_rank must be in \[0, cp_size=2\); got 2"),
    ("total_0", i32([0, 8]), 0, 2, 0, False, ValueError,
     r"total_tokens must be positive and divisible by 2 \* cp_size \(4\); got 0"),
    ("total_negative", i32([0, 8]), -8, 2, 0, False, ValueError, r"total_tokens must be positive .*got -8"),
    ("total_not_divisible", i32([0, 8]), 6, 2, 0, False, ValueError,
     r"total_tokens must be positive and divisible by 2 \* cp_size \(4\); got 6"),
    ("total_too_big", i32([0, 8]), 2**40, 2, 0, False, ValueError, r"total_tokens / cp_size must fit in int32"),
    ("dtype_int64", torch.tensor([0, 8]), 8, 2, 0, False, ValueError,
     r"cu_seqlens must be a 1-D int32 tensor; got 1-D torch.int64"),
    ("dtype_float", torch.tensor([0.0, 8.0]), 8, 2, 0, False, ValueError, r"1-D int32 tensor; got 1-D torch.float32"),
    ("ndim_2", i32([[0, 8]]), 8, 2, 0, False, ValueError, r"1-D int32 tensor; got 2-D torch.int32"),
    ("ndim_0", torch.tensor(8, dtype=torch.int32), 8, 2, 0, False, ValueError, r"got 0-D torch.int32"),
    ("one_entry", i32([8]), 8, 2, 0, False, ValueError, r"cu_seqlens must have at least 2 entries; got 1"),
    ("one_entry_validate", i32([8]), 8, 2, 0, True, ValueError, r"cu_seqlens must have at least 2 entries; got 1"),
    ("empty", i32([]), 8, 2, 0, True, ValueError, r"cu_seqlens must have at least 2 entries; got 0"),
    ("non_monotone", i32([0, 8, 4, 16]), 16, 1, 0, True, ValueError,
     r"cu_seqlens must be non-decreasing; cu_seqlens\[2\]=4 < cu_seqlens\[1\]=8"),
    ("negative_start", i32([-4, 8]), 8, 1, 0, True, ValueError, r"cu_seqlens\[0\] must be >= 0; got -4"),
    ("not_divisible_doc", i32([0, 6, 8]), 8, 2, 0, True, ValueError,
     r"every document length in cu_seqlens must be divisible by 2 \* cp_size \(4\); document 0 has length 6"),
    ("not_a_tensor", [0, 8], 8, 2, 0, False, TypeError, r"cu_seqlens must be a torch.Tensor, got list"),
    ("total_float", i32([0, 8]), 8.0, 2, 0, False, TypeError, r"total_tokens must be an int, got float"),
    ("cp_size_str", i32([0, 8]), 8, "2", 0, False, TypeError, r"cp_size must be an int, got str"),
    ("rank_none", i32([0, 8]), 8, 2, None, False, TypeError, r"cp_rank must be an int, got NoneType"),
]  # fmt: skip


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_validation_errors(case):
    _, cu, total, cp, rank, validate, exc, message = case
    with pytest.raises(exc, match=message):
        thd_partition_indices(cu, total, cp, rank, validate=validate)


def test_validate_false_accepts_what_te_accepts():
    """The checks that only ``validate=True`` makes; TE itself would run (and mis-partition)."""
    for cu, total, cp in [([0, 8, 4, 16], 16, 1), ([0, 6, 8], 8, 2), ([-4, 8], 8, 1)]:
        want = te_oracle(i32(cu), total, cp, 0)
        assert torch.equal(thd_partition_indices(i32(cu), total, cp, 0, validate=False), want)


# =============================================================================================
# 4. Property test
# =============================================================================================


@HYP
@given(
    units=st.lists(st.integers(1, 6), min_size=1, max_size=10),
    cp=st.sampled_from([1, 2, 3, 4, 5, 8]),
    extra=st.integers(0, 3),
    garbage=st.lists(st.integers(-64, 256), min_size=2, max_size=8),
)
def test_property_matches_oracle_and_partitions(units, cp, extra, garbage):
    cu = _cu([u * 2 * cp for u in units])
    owned = []
    for rank in range(cp):
        got = thd_partition_indices(i32(cu), cu[-1], cp, rank)
        assert torch.equal(got, te_oracle(i32(cu), cu[-1], cp, rank))
        owned.append(got)
        # Past the end (``extra`` more chunks of slots): still TE, never out of range.
        total = cu[-1] + extra * 2 * cp
        past = thd_partition_indices(i32(cu), total, cp, rank, validate=False)
        assert torch.equal(past, te_oracle(i32(cu), total, cp, rank))
        assert past.min() >= 0 and past.max() < total
    assert torch.equal(torch.cat(owned).sort().values, torch.arange(cu[-1], dtype=torch.int32))
    total = 2 * cp * (1 + extra)
    for rank in range(cp):  # any boundaries at all, validate=False
        assert torch.equal(thd_partition_indices(i32(garbage), total, cp, rank, validate=False),
                           te_oracle(i32(garbage), total, cp, rank))  # fmt: skip


# =============================================================================================
# 5. CUDA
# =============================================================================================




@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_cpu_and_oracle(mode, ncp_seed):
    g = gen(ncp_seed)
    for _ in range(20):
        cu, total, cp = _random_layout(g, mode)
        for rank in range(cp):
            want = te_oracle(cu, total, cp, rank)
            cpu = thd_partition_indices(cu, total, cp, rank, validate=False)
            got = thd_partition_indices(cu.cuda(), total, cp, rank, validate=False)
            assert got.dtype == torch.int32 and got.device == cu.cuda().device
            assert torch.equal(got.cpu(), cpu) and torch.equal(cpu, want)


@pytest.mark.cuda
def test_cuda_large_layout_and_sentinel_buffer(ncp_seed):
    """A stream of ~1M tokens with thousands of documents (many blocks, grid-stride) and a guarded output."""
    g = gen(ncp_seed)
    cp = 8
    lengths = (torch.randint(1, 64, (8000,), generator=g) * 2 * cp).tolist()
    cu = i32(_cu(lengths))
    total = cu[-1].item() + 2 * cp * 3
    for rank in (0, 3, cp - 1):
        n, pad = total // cp, 256
        buf = torch.full((n + 2 * pad,), POISON, dtype=torch.int32, device="cuda")
        out = buf[pad : pad + n]
        _C.thd_partition(dl(cu.cuda()), dl(out), total, cp, rank, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), thd_partition_indices(cu, total, cp, rank, validate=False))
        assert (buf[:pad] == POISON).all().item() and (buf[pad + n :] == POISON).all().item()


@pytest.mark.cuda
def test_cuda_on_another_current_device():
    """Output on the device of cu_seqlens even when another CUDA device is current (TE's trap avoided)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    cu = i32([0, 8, 16]).to("cuda:1")
    with torch.cuda.device(0):
        out = thd_partition_indices(cu, 16, 2, 0)
    assert out.device == cu.device and out.cpu().tolist() == [0, 1, 6, 7, 8, 9, 14, 15]


@pytest.mark.cuda
def test_cuda_host_syncs():
    """validate=False never syncs; validate=True copies cu_seqlens to the host once."""
    cu = i32(_cu([16, 32, 8, 64])).cuda()
    thd_partition_indices(cu, 120, 4, 1)  # warm up
    assert _count_syncs(lambda: thd_partition_indices(cu, 120, 4, 1, validate=False)) == 0
    assert _count_syncs(lambda: thd_partition_indices(cu, 120, 4, 1)) <= 1
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = thd_partition_indices(cu, 120, 4, 1, validate=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(out.cpu(), te_oracle(cu.cpu(), 120, 4, 1))
    with pytest.raises(ValueError, match="divisible by 2 \\* cp_size"):
        thd_partition_indices(i32([0, 6, 8]).cuda(), 8, 2, 0)


# =============================================================================================
# 6. Integer hygiene (issue 17)
# =============================================================================================

# The smallest table whose int32 midpoint overflows: with n_cu = 2^30 + 2 entries the search bounds
# reach left + right >= 2^31 (all-zero boundaries make TE's search climb to the last entry). The
# 4 GiB table is a private read-only anonymous mapping: its pages all read as the kernel's shared
# zero page, so it costs no memory. The old code read ~4 GiB before the table and crashed.
_HUGE_CU_CPU = r"""
import mmap, warnings, torch
import nemo_cp_native as ncp
n = 2**30 + 2
buf = mmap.mmap(-1, 4 * n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # frombuffer warns that the mapping is read-only: we only read it
    cu = torch.frombuffer(buf, dtype=torch.int32)
assert cu.numel() == n
print(ncp.thd_partition_indices(cu, 8, 2, 1, validate=False).tolist())
"""

_HUGE_CU_CUDA = r"""
import torch
import nemo_cp_native as ncp
cu = torch.zeros(2**30 + 2, dtype=torch.int32, device="cuda")  # 4 GiB on the device
out = ncp.thd_partition_indices(cu, 8, 2, 1, validate=False)
torch.cuda.synchronize()
print(out.cpu().tolist())
"""


def _run_isolated(code):
    """``code`` in a fresh interpreter: a crash fails the test instead of taking the suite down."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def test_search_past_2_pow_30_entries():
    """A 2^30 + 2 entry ``cu_seqlens``: the int64 midpoint finds the last document, as a short
    all-zero table does (the search ends on the last entry either way)."""
    want = te_oracle(i32([0] * 7), 8, 2, 1).tolist()
    assert _run_isolated(_HUGE_CU_CPU) == str(want)


@pytest.mark.cuda
def test_cuda_search_past_2_pow_30_entries():
    want = te_oracle(i32([0] * 7), 8, 2, 1).tolist()
    assert _run_isolated(_HUGE_CU_CUDA) == str(want)


I32_MIN, I32_MAX = -(2**31), 2**31 - 1
EXTREME = [  # (cu_seqlens, total_tokens, cp): boundaries where TE's int32 arithmetic wraps
    ([I32_MIN, I32_MAX], 2, 1),
    ([I32_MAX, I32_MIN], 4, 1),
    ([0, I32_MAX, I32_MIN, I32_MAX], 8, 2),
    ([I32_MIN, 0, I32_MAX], 2**31 - 2, 2**30 - 1),
    ([I32_MIN, I32_MAX, I32_MAX], 12, 3),
    ([2**30, I32_MIN + 6, 2**31 - 8, -8], 16, 4),
]


@pytest.mark.parametrize("case", EXTREME, ids=[str(c[0]) for c in EXTREME])
def test_int32_wraparound_is_tes(case):
    """``validate=False`` on boundaries near the int32 limits: TE's answer (its ``int`` arithmetic wraps
    mod 2^32; the oracle wraps at the same steps), computed in C with explicit unsigned wraparound
    (no signed overflow, so no reliance on -fwrapv). Wrapping once at the end of an int64
    computation gives the same bits: a span can pass int32 only at cp = 1, where the tail offset,
    the one factor that meets a division, is 0."""
    cu, total, cp = case
    for rank in sorted({0, cp // 2, cp - 1}):
        got = thd_partition_indices(i32(cu), total, cp, rank, validate=False)
        assert torch.equal(got, te_oracle(i32(cu), total, cp, rank)), (cu, rank)


def test_validate_with_total_tokens():
    """``_C.thd_partition_validate(cu, cp_size, total_tokens)`` (the call behind
    ``thd_partition_indices(..., validate=True)``) rejects ``cu_seqlens[-1] > total_tokens``,
    which TE answers with indices past the stream; the 2-argument form keeps its old checks."""
    cu = i32([0, 8, 16])
    _C.thd_partition_validate(dl(cu), 2)
    for total in (16, 24, 2**40):
        _C.thd_partition_validate(dl(cu), 2, total)
    for total in (8, 0, -16):
        with pytest.raises(ValueError, match=rf"cu_seqlens\[-1\] must not exceed total_tokens: cu_seqlens\[-1\]=16 "
                                             rf"> total_tokens={total}"):  # fmt: skip
            _C.thd_partition_validate(dl(cu), 2, total)
    with pytest.raises(ValueError, match=r"divisible by 2 \* cp_size \(4\)"):  # the old checks come first
        _C.thd_partition_validate(dl(i32([0, 6, 64])), 2, 8)
    with pytest.raises(ValueError, match=r"total_tokens=.* does not fit in int64"):
        _C.thd_partition_validate(dl(cu), 2, 2**63)
    with pytest.raises(TypeError, match=r"takes 2 or 3 arguments \(4 given\)"):
        _C.thd_partition_validate(dl(cu), 2, 16, 1)


@pytest.mark.parametrize("arg", ["total_tokens", "cp_size", "cp_rank"])
@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**100])
def test_out_of_range_ints_name_their_argument(arg, value):
    """An int beyond int64 is a ValueError naming the argument (was ``OverflowError: int too big to
    convert``), both through the public function and at the C boundary."""
    cu, out = i32([0, 8]), torch.empty(4, dtype=torch.int32)
    kw = {"total_tokens": 8, "cp_size": 2, "cp_rank": 0, arg: value}
    with pytest.raises((ValueError, TypeError), match=arg):
        thd_partition_indices(cu, kw["total_tokens"], kw["cp_size"], kw["cp_rank"])
    with pytest.raises(ValueError, match=rf"^{arg}=.* does not fit in int(32|64)$"):
        _C.thd_partition(dl(cu), dl(out), kw["total_tokens"], kw["cp_size"], kw["cp_rank"], None)
