"""Transformer Engine's ``thd_get_partitioned_indices`` as a plain Python loop (the oracle).

Written from the behavioural spec ``mimo_te.md`` §11, not from TE's source. One output slot at a
time, exactly as the CUDA kernel computes it (§11.3):

    cs[i] = cu_seqlens[i] / W                      (C integer division)
    for t in 0 .. total_tokens/W - 1:
        s    = bsearch(t, cs)                      (left=1, right=batch; s = left - 1)
        len  = cs[s+1] - cs[s];  i = t - cs[s];  half = len / 2
        off  = r if i < half else 2W - 2 - r
        out[t] = i + cs[s]*W + half*off

Every document of padded length n is cut into 2W chunks of n/(2W) tokens; rank r owns chunk r and
chunk 2W-1-r (DualChunkSwap). Nothing beyond the kernel is added: slots past ``cu_seqlens[-1]``
continue the last document's tail offset (duplicates and gaps across ranks, §11.4), documents past
``total_tokens`` are ignored, and lengths not divisible by 2W give the kernel's silently wrong
answer (the device ``assert`` is compiled out of release builds, §11.4, and is not emulated).

TE's kernel computes in ``int`` (int32): on absurd boundaries (values near the int32 limits) its
intermediate sums wrap mod 2^32. The oracle wraps at the same steps (``_i32``), so it answers as TE
does on any int32 input.

One deliberate difference: real TE allocates its output on the **current CUDA device** whatever
the device of ``cu_seqlens`` (§11.2, a trap); this oracle returns its int32 result on the device
of ``cu_seqlens``.
"""

from __future__ import annotations

import torch

__all__ = ["thd_get_partitioned_indices"]


def _c_div(a: int, b: int) -> int:
    """Integer division with C semantics (truncation toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _i32(x: int) -> int:
    """``x`` wrapped to int32 (two's complement), as TE's ``int`` arithmetic does on the GPU."""
    return (x + 2**31) % 2**32 - 2**31


def _check_args(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int) -> None:
    """The host checks of spec §11.1 (TE's NVTE_CHECK surfaces as RuntimeError)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise RuntimeError(f"thd_get_partitioned_indices: cu_seqlens must be a tensor, got {type(cu_seqlens)}")
    if cu_seqlens.dtype != torch.int32:
        raise RuntimeError(f"thd_get_partitioned_indices: cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise RuntimeError(f"thd_get_partitioned_indices: cu_seqlens must be 1-D, got {cu_seqlens.dim()}-D")
    if cu_seqlens.size(0) < 2:
        raise RuntimeError(
            f"thd_get_partitioned_indices: cu_seqlens needs at least 2 entries, got {cu_seqlens.size(0)}"
        )
    if world_size <= 0:
        raise RuntimeError(f"thd_get_partitioned_indices: world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise RuntimeError(f"thd_get_partitioned_indices: rank must be in [0, {world_size}), got {rank}")
    if total_tokens <= 0:
        raise RuntimeError(f"thd_get_partitioned_indices: total_tokens must be positive, got {total_tokens}")
    if total_tokens % (2 * world_size) != 0:
        raise RuntimeError(
            f"thd_get_partitioned_indices: total_tokens ({total_tokens}) must be divisible by "
            f"2 * world_size ({2 * world_size})"
        )


def _find_document(t: int, cs: list[int]) -> int:
    """The kernel's binary search (§11.3): index of the document holding local slot ``t``.

    Searches ``cs[1 .. batch-1]`` for the first entry greater than ``t``; past ``cs[-1]`` it sticks
    at the last document (``batch - 1``).
    """
    left, right = 1, len(cs) - 1  # right = batch
    while left < right:
        mid = (left + right) // 2  # both non-negative: C and Python division agree
        if cs[mid] <= t:
            left = mid + 1
        else:
            right = mid
    return left - 1


def thd_get_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """Global token indices owned by ``rank``, in local order: int32 ``[total_tokens // world_size]``.

    ``cu_seqlens`` is an int32 ``[batch + 1]`` tensor of (padded) document boundaries. Raises
    RuntimeError when a host check of spec §11.1 fails. The result lives on ``cu_seqlens.device``
    (real TE: the current CUDA device).
    """
    total_tokens = int(total_tokens)
    world_size = int(world_size)
    rank = int(rank)
    _check_args(cu_seqlens, total_tokens, world_size, rank)

    cs = [_c_div(int(v), world_size) for v in cu_seqlens.tolist()]  # local document starts
    out = []
    for t in range(total_tokens // world_size):
        s = _find_document(t, cs)
        local_len = _i32(cs[s + 1] - cs[s])  # = doc_len / W for divisible documents
        i = _i32(t - cs[s])  # position inside this document's local share
        half = _c_div(local_len, 2)  # = doc_len / (2W)
        offset = rank if i < half else _i32(2 * world_size - 2 - rank)
        out.append(_i32(i + _i32(cs[s] * world_size) + _i32(half * offset)))
    return torch.tensor(out, dtype=torch.int32, device=cu_seqlens.device)
