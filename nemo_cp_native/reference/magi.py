"""MagiAttention's default dispatch (token partition) for a packed full-causal mask, pure Python.

Written from the behavioural spec ``flint_magi.md`` §1.3–1.4, not from MagiAttention's source.

1. Chunk size: ``cap = ceil(T / (min_chunks_per_rank * C))`` (Magi's
   ``MAGI_ATTENTION_MIN_CHUNKS_PER_RANK``, default 8), ``chunk = min(requested, cap)``; require
   ``ceil(T / chunk) >= C``.
2. Tail padding: ``T_pad = T + ((-T) mod (chunk * C))``; pad tokens belong to no document, see
   nothing and are nobody's keys. ``N = T_pad / chunk`` chunks, chunk ``c`` = ``[c*chunk, (c+1)*chunk)``.
3. Workload of a chunk = number of visible (query, key) pairs whose query lies in the chunk under
   the per-document full-causal mask: ``sum_{p in chunk, p < T} (p - doc_start(p) + 1)``.
4. MinHeap greedy: buckets = ranks with capacity ``ceil(N / C)``; chunks taken in the order of a
   stable ascending argsort of the workloads, reversed (heaviest first; among equal workloads the
   higher chunk id first); each goes to the bucket with the least ``(load, rank)`` among those not
   yet full (a full bucket popped from the heap is dropped). Each rank's chunk ids are then sorted
   ascending; its local token order is those chunks concatenated.

Also ``visible_remote_tokens``: for one rank, the keys owned by each other rank that its queries
can see under a (windowed) per-document causal mask, by brute force over the whole mask.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "DispatchRef",
    "chunk_workloads",
    "chunk_workloads_closed_form",
    "dispatch",
    "effective_chunk_size",
    "load_per_rank",
    "minheap_dispatch",
    "padded_length",
    "visible_mask",
    "visible_remote_tokens",
]


def _cu_list(cu_seqlens) -> list[int]:
    """cu_seqlens (tensor or sequence) as a validated Python list: starts at 0, non-decreasing."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(x) for x in cu_seqlens]
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing; got {cu}")
    return [int(x) for x in cu]


def _doc_start_of_each_token(cu: list[int]) -> list[int]:
    """doc_start(p) for every real token p < cu[-1], by walking the documents."""
    starts = []
    for s, e in zip(cu, cu[1:]):
        starts.extend([s] * (e - s))
    return starts


def effective_chunk_size(
    total_seqlen: int, cp_size: int, requested: int | None = 512, min_chunks_per_rank: int = 8
) -> int:
    """Magi's chunk size: ``min(requested, ceil(T / (min_chunks_per_rank * cp)))`` (the cap alone
    when ``requested`` is None). Raises ValueError if the result leaves fewer than ``cp`` chunks."""
    if total_seqlen <= 0:
        raise ValueError(f"total_seqlen must be positive; got {total_seqlen}")
    if cp_size <= 0:
        raise ValueError(f"cp_size must be positive; got {cp_size}")
    if min_chunks_per_rank <= 0:
        raise ValueError(f"min_chunks_per_rank must be positive; got {min_chunks_per_rank}")
    if requested is not None and requested <= 0:
        raise ValueError(f"requested chunk size must be positive; got {requested}")
    cap = -(-total_seqlen // (min_chunks_per_rank * cp_size))
    chunk = cap if requested is None else min(requested, cap)
    if -(-total_seqlen // chunk) < cp_size:
        raise ValueError(
            f"total_seqlen {total_seqlen} gives only {-(-total_seqlen // chunk)} chunks of size {chunk}, "
            f"fewer than cp_size {cp_size}: every CP rank needs at least one chunk"
        )
    return chunk


def padded_length(total_seqlen: int, chunk: int, cp_size: int) -> int:
    """``T + ((-T) mod (chunk * cp))``: the smallest multiple of ``chunk * cp`` that is ``>= T``."""
    return total_seqlen + (-total_seqlen) % (chunk * cp_size)


def _check_layout(cu: list[int], chunk: int, total_padded: int) -> None:
    if chunk <= 0 or total_padded % chunk != 0 or total_padded < cu[-1]:
        raise ValueError(
            f"need chunk > 0, T_pad % chunk == 0 and T_pad >= T; got chunk={chunk}, T_pad={total_padded}, T={cu[-1]}"
        )


def chunk_workloads(cu_seqlens, chunk: int, total_padded: int) -> list[int]:
    """Full-causal workload of each chunk, by brute force, one token at a time:
    ``work(c) = sum_{p in chunk c, p < T} (p - doc_start(p) + 1)``; pad tokens add 0."""
    cu = _cu_list(cu_seqlens)
    _check_layout(cu, chunk, total_padded)
    total = cu[-1]
    starts = _doc_start_of_each_token(cu)
    work = [0] * (total_padded // chunk)
    for p in range(total_padded):
        if p < total:
            work[p // chunk] += p - starts[p] + 1
    return work


def chunk_workloads_closed_form(cu_seqlens, chunk: int, total_padded: int) -> list[int]:
    """Same as ``chunk_workloads`` from the trapezoid area: a document ``[s, e)`` overlapping a chunk
    in ``[lo, hi)`` contributes ``sum_{i=lo-s+1}^{hi-s} i = tri(hi - s) - tri(lo - s)``."""
    cu = _cu_list(cu_seqlens)
    _check_layout(cu, chunk, total_padded)

    def tri(n: int) -> int:
        return n * (n + 1) // 2

    work = []
    for c in range(total_padded // chunk):
        a, b = c * chunk, (c + 1) * chunk
        w = 0
        for s, e in zip(cu, cu[1:]):
            lo, hi = max(s, a), min(e, b)
            if lo < hi:
                w += tri(hi - s) - tri(lo - s)
        work.append(w)
    return work


def minheap_dispatch(workloads: Sequence[int], cp_size: int) -> list[list[int]]:
    """Magi's MinHeap greedy solver; returns each rank's chunk ids, sorted ascending.

    ``limit = ceil(n / cp)``; jobs heaviest first (stable ascending argsort, reversed); the heap
    holds ``(load, rank)``, initially ``(0.0, r)`` for every rank; a popped full rank is dropped.
    """
    if cp_size <= 0:
        raise ValueError(f"cp_size must be positive; got {cp_size}")
    n = len(workloads)
    limit = -(-n // cp_size)
    order = sorted(range(n), key=lambda i: workloads[i])[::-1]  # sorted() is stable
    heap = [(0.0, r) for r in range(cp_size)]
    heapq.heapify(heap)
    buckets: list[list[int]] = [[] for _ in range(cp_size)]
    for job in order:
        while True:
            load, r = heapq.heappop(heap)
            if len(buckets[r]) < limit:
                break
        buckets[r].append(job)
        heapq.heappush(heap, (load + workloads[job], r))
    return [sorted(b) for b in buckets]


@dataclass(frozen=True)
class DispatchRef:
    """One token partition: ``partitions[r]`` = rank r's chunk ids (ascending)."""

    total_seqlen: int  # T, unpadded
    total_seqlen_padded: int  # T_pad, a multiple of chunk_size * cp_size
    chunk_size: int
    partitions: tuple[tuple[int, ...], ...]

    @property
    def cp_size(self) -> int:
        return len(self.partitions)

    def local_token_global_indices(self, rank: int) -> torch.Tensor:
        """Global stream index of each of ``rank``'s local tokens (int64), in local (dispatched)
        order: its chunks' token ranges concatenated; unclamped, so pad tokens report ``>= T``."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}); got {rank}")
        c = self.chunk_size
        ranges = [torch.arange(i * c, (i + 1) * c, dtype=torch.int64) for i in self.partitions[rank]]
        return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.int64)


def dispatch(
    cu_seqlens, cp_size: int, requested_chunk: int | None = 512, min_chunks_per_rank: int = 8
) -> DispatchRef:
    """Magi's default dispatch for the full-causal varlen mask of ``cu_seqlens`` (T = cu[-1])."""
    cu = _cu_list(cu_seqlens)
    total = cu[-1]
    chunk = effective_chunk_size(total, cp_size, requested_chunk, min_chunks_per_rank)
    total_padded = padded_length(total, chunk, cp_size)
    parts = minheap_dispatch(chunk_workloads(cu, chunk, total_padded), cp_size)
    return DispatchRef(total, total_padded, chunk, tuple(tuple(p) for p in parts))


def visible_mask(cu_seqlens, total_padded: int, window: int = 0) -> torch.Tensor:
    """Bool ``[T_pad, T_pad]``: ``mask[i, j]`` iff query i sees key j (same document, ``j <= i``,
    and ``i - j < window`` when ``window > 0``). Pad positions ``>= T`` see nothing, are seen by none."""
    cu = _cu_list(cu_seqlens)
    if window < 0:
        raise ValueError(f"window must be >= 0; got {window}")
    if total_padded < cu[-1]:
        raise ValueError(f"total_padded {total_padded} < T {cu[-1]}")
    doc = torch.full((total_padded,), -1, dtype=torch.int64)
    for d, (s, e) in enumerate(zip(cu, cu[1:])):
        doc[s:e] = d
    pos = torch.arange(total_padded)
    i, j = pos[:, None], pos[None, :]
    mask = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0) & (j <= i)
    if window > 0:
        mask &= i - j < window
    return mask


def visible_remote_tokens(
    cu_seqlens, partitions, chunk: int, total_padded: int, rank: int, window: int = 0
) -> dict[int, torch.Tensor]:
    """For every other rank ``o``: sorted global positions (int64) of keys owned by ``o`` that at
    least one of ``rank``'s real queries can see. Every other rank appears (possibly empty)."""
    cp_size = len(partitions)
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, {cp_size}); got {rank}")
    _check_layout(_cu_list(cu_seqlens), chunk, total_padded)
    owner = torch.full((total_padded // chunk,), -1, dtype=torch.int64)
    for r, chunks in enumerate(partitions):
        for c in chunks:
            owner[c] = r
    if bool((owner < 0).any()):
        raise ValueError("partitions must cover every chunk")
    token_owner = owner.repeat_interleave(chunk)  # [T_pad]
    mask = visible_mask(cu_seqlens, total_padded, window)
    seen = mask[token_owner == rank].any(dim=0)  # keys seen by at least one of rank's queries
    return {o: torch.nonzero(seen & (token_owner == o)).reshape(-1) for o in range(cp_size) if o != rank}


def load_per_rank(workloads: Sequence[int], partitions) -> list[int]:
    """Sum of chunk workloads per rank (diagnostics and tests)."""
    return [sum(workloads[c] for c in p) for p in partitions]



def expand_runs(runs, n: int, fill: int = -1):
    """The int32 table a plan's runs describe: ``out[o + t * stride] = val + t * step`` for every
    run ``(o, len, stride, val, step)`` and ``t < len``; entries no run writes hold ``fill``. The oracle of
    ``_C.runs_expand`` (plans hold their tables as runs, ``csrc/core/plan.c``)."""
    import torch

    out = [fill] * n
    for o, length, stride, val, step in (runs.tolist() if hasattr(runs, "tolist") else runs):
        for t in range(length):
            out[o + t * stride] = val + t * step
    return torch.tensor(out, dtype=torch.int32)
