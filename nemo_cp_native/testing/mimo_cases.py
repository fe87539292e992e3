"""Shared case generators for the tests and the benchmarks.

Everything here is deterministic given a ``torch.Generator`` (``generator=None`` draws from torch's
global RNG, which the test suite seeds per test). Each family keeps its generators in its own
clearly marked section below.
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["SEQ_LENS_SENTINEL", "make_mimo_batch", "flat_cases", "random_case"]


# =============================================================================================
# MiMo TE-THD packed batches (spec mimo_te.md)
# =============================================================================================

SEQ_LENS_SENTINEL = -1000  # fills the ragged tail of seq_lens / seq_lens_padded rows

_MATRIX_B = tuple(range(1, 9))
_MATRIX_CHUNKS = (1, 2, 4)
_MATRIX_CP = (1, 2, 4, 8)


def _randint(lo: int, hi: int, generator) -> int:
    """Uniform integer in ``[lo, hi]`` (inclusive)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=generator).item())


def _composition(total: int, parts: int, generator) -> list[int]:
    """``total`` split into ``parts`` positive integers, uniformly over the cut positions."""
    if parts <= 1:
        return [total]
    cuts = (torch.randperm(total - 1, generator=generator)[: parts - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


def _row_units(units: int, n_docs: int, min_doc: bool, generator) -> list[int]:
    """Padded document lengths of one row, in units of 2*cp."""
    if not min_doc or n_docs == 1:
        return _composition(units, n_docs, generator)
    n_min = max(1, n_docs // 2)  # these documents get the minimum legal length 2*cp
    rest = _composition(units - n_min, n_docs - n_min, generator)
    docs = [1] * n_min + rest
    order = torch.randperm(len(docs), generator=generator).tolist()
    return [docs[i] for i in order]


def make_mimo_batch(
    B: int,
    S: int,
    *,
    num_chunks: int,
    cp_size: int,
    docs_per_row: tuple[int, int] = (1, 4),
    device="cpu",
    dtype: torch.dtype = torch.long,
    image_token_id: int | None = None,
    video_token_id: int | None = None,
    media_fraction: float = 0.05,
    with_position_ids: bool | str = True,
    absorption: bool = False,
    min_doc: bool = False,
    generator: torch.Generator | None = None,
    padding_token_id: int = 0,
    vocab_size: int = 32000,
    lens_dtype: torch.dtype = torch.long,
) -> dict:
    """Draw a realistic packed MiMo batch that ``shard_batch_for_mimo_te`` accepts.

    Layout, per row of ``S`` slots: 1 to ``docs_per_row`` documents (clamped to what fits) whose
    padded lengths are positive multiples of ``2 * cp_size`` summing to exactly ``S``; each
    document's real length is ``1 .. padded`` (padding up to ``2*cp - 1`` slots, or more on a row's
    last document, which absorbs pack padding half the time).

    Keys, in order:
    - ``input_ids`` ``[B, S]`` (``dtype``): random content in ``[1, vocab_size)``, placeholder ids on
      about ``media_fraction`` of the real slots (image/video evenly when both ids are given),
      ``padding_token_id`` on pad slots;
    - ``labels`` ``[B, S]`` (``dtype``): next token inside the document, -100 on each document's last
      real token and on every pad slot;
    - ``position_ids`` ``[B, S]`` (``dtype``), 0.. within each padded document span. Controlled by
      ``with_position_ids``: True gives the tensor, False gives the key with value **None** (upstream
      accepts that at cp 1 only), ``"omit"`` leaves the key out (upstream raises KeyError);
    - ``seq_lens``, ``seq_lens_padded`` ``[B, Nmax]`` (``lens_dtype``), ragged rows right-filled with
      -1000;
    - ``qkv_format = "thd"``.

    ``absorption=True``: every document is unpadded except the last document of each chunk's
    stream (the last row of each group of ``B // num_chunks`` rows), so each chunk takes the
    framework's absorption path (§7.3). ``min_doc=True``: about half of each row's documents (at
    least one, when a row has two or more) have the minimum legal length ``2 * cp_size``.
    All tensors are drawn on the CPU and moved to ``device``.
    """
    if B <= 0 or num_chunks <= 0 or B % num_chunks:
        raise ValueError(f"num_chunks={num_chunks} must evenly divide B={B}")
    unit = 2 * cp_size
    if S <= 0 or S % unit:
        raise ValueError(f"S={S} must be a positive multiple of 2 * cp_size ({unit})")
    lo, hi = docs_per_row
    if not 1 <= lo <= hi:
        raise ValueError(f"docs_per_row must satisfy 1 <= lo <= hi, got {docs_per_row}")
    g = generator
    units = S // unit
    rows_per_chunk = B // num_chunks

    padded_rows: list[list[int]] = []
    real_rows: list[list[int]] = []
    for b in range(B):
        n_docs = min(_randint(lo, hi, g), units)
        padded = [u * unit for u in _row_units(units, n_docs, min_doc, g)]
        chunk_last_row = (b + 1) % rows_per_chunk == 0
        real = []
        for d, p in enumerate(padded):
            last = d == len(padded) - 1
            if absorption:
                pad = _randint(1, p - 1, g) if (last and chunk_last_row) else 0
            elif last and _randint(0, 1, g):
                pad = _randint(0, p - 1, g)  # pack padding absorbed by the row's last document
            else:
                pad = _randint(0, min(unit - 1, p - 1), g)
            real.append(p - pad)
        padded_rows.append(padded)
        real_rows.append(real)

    ids = torch.randint(1, vocab_size, (B, S), generator=g, dtype=torch.long)
    media_ids = [t for t in (image_token_id, video_token_id) if t is not None]
    if media_ids and media_fraction > 0:
        is_media = torch.rand((B, S), generator=g) < media_fraction
        which = torch.randint(0, len(media_ids), (B, S), generator=g)
        ids = torch.where(is_media, torch.tensor(media_ids, dtype=torch.long)[which], ids)
    labels = torch.full((B, S), -100, dtype=torch.long)
    positions = torch.zeros((B, S), dtype=torch.long)
    is_pad = torch.zeros((B, S), dtype=torch.bool)
    for b in range(B):
        start = 0
        for p, r in zip(padded_rows[b], real_rows[b]):
            positions[b, start : start + p] = torch.arange(p)
            is_pad[b, start + r : start + p] = True
            labels[b, start : start + r - 1] = ids[b, start + 1 : start + r]
            start += p
    ids = ids.masked_fill(is_pad, padding_token_id)

    n_max = max(len(r) for r in padded_rows)

    def lens_tensor(rows: list[list[int]]) -> torch.Tensor:
        out = torch.full((B, n_max), SEQ_LENS_SENTINEL, dtype=lens_dtype)
        for b, row in enumerate(rows):
            out[b, : len(row)] = torch.tensor(row, dtype=lens_dtype)
        return out.to(device)

    batch: dict = {"input_ids": ids.to(device=device, dtype=dtype), "labels": labels.to(device=device, dtype=dtype)}
    if with_position_ids is True:
        batch["position_ids"] = positions.to(device=device, dtype=dtype)
    elif with_position_ids is False:
        batch["position_ids"] = None
    elif with_position_ids != "omit":
        raise ValueError(f"with_position_ids must be True, False or 'omit', got {with_position_ids!r}")
    batch["seq_lens"] = lens_tensor(real_rows)
    batch["seq_lens_padded"] = lens_tensor(padded_rows)
    batch["qkv_format"] = "thd"
    return batch


def flat_cases(units: tuple[int, ...] = (1, 3, 8)) -> Iterator[tuple[int, int, int, int]]:
    """Every ``(B, S, num_chunks, cp_size)`` of the test matrix, with ``S = 2 * cp * u`` for u in units.

    Matrix: B in 1..8, num_chunks in {1, 2, 4} dividing B, cp_size in {1, 2, 4, 8}.
    """
    for B in _MATRIX_B:
        for num_chunks in _MATRIX_CHUNKS:
            if B % num_chunks:
                continue
            for cp in _MATRIX_CP:
                for u in units:
                    yield B, 2 * cp * u, num_chunks, cp


def random_case(rng: torch.Generator | None = None, max_units: int = 8) -> tuple[int, int, int, int]:
    """One ``(B, S, num_chunks, cp_size)`` drawn from the matrix, ``S = 2 * cp * (1..max_units)``."""
    B = _MATRIX_B[_randint(0, len(_MATRIX_B) - 1, rng)]
    chunk_choices = [c for c in _MATRIX_CHUNKS if B % c == 0]
    num_chunks = chunk_choices[_randint(0, len(chunk_choices) - 1, rng)]
    cp = _MATRIX_CP[_randint(0, len(_MATRIX_CP) - 1, rng)]
    return B, 2 * cp * _randint(1, max_units, rng), num_chunks, cp


# ==========================================================================================
# CUDA host-sync counting (tests and benchmarks)
# ==========================================================================================


def count_syncs(fn) -> int:
    """Synchronizing CUDA operations torch reports while ``fn()`` runs (sync debug mode "warn").

    Only syncs made through torch are seen; the sync debug mode is restored to 0 afterwards."""
    import re
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum(bool(re.search(r"synchronizing CUDA operation", str(w.message))) for w in caught)
