"""The MiMo TE-THD context-parallel sharding path in plain PyTorch (the oracle).

Written from the behavioural spec ``mimo_te.md`` (section numbers below refer to it), checked
against the installed upstream nemo-automodel 0.7.0 by ``tests/test_reference_mimo.py``. It keeps the
reference's host syncs (boolean indexing, ``.item()``, ``torch.equal``), its key order, dtypes,
devices, error types and exact messages, quirks included. Two layers:

- framework helpers (``thd_utils.py`` / ``context_parallel/utils.py``, §7): ``_thd_padding_mask``,
  ``thd_padding_mask_from_token_ids``, ``process_input_for_thd``, ``split_batch_into_thd_chunks``,
  ``_shard_thd_chunk_for_te``, ``make_cp_batch_for_te``;
- the MiMo wrapper (``mimo_v2_flash/cp.py``, §1-§6).

Transformer Engine's partition is answered by :mod:`nemo_cp_native.reference.te_partition`, which
allocates on the device of ``cu_seqlens`` instead of TE's current CUDA device (§11.2).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from functools import partial
from typing import Any

import torch

from nemo_cp_native import _compat
from nemo_cp_native.reference.te_partition import thd_get_partitioned_indices

# §1 constants
_MIMO_GLOBAL_IMAGE_MASK = "_mimo_global_image_mask"
_MIMO_GLOBAL_VIDEO_MASK = "_mimo_global_video_mask"
_MIMO_THD_LOCAL_INDICES = "_mimo_thd_local_indices"
_VLM_PP_MEDIA_KEY = "_vlm_pp_media_chunks"
_SEQ_LENS_PADDING_VALUE = -1000

_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "padding_mask")  # §7.5 step 5
_MISSING = object()


# ---------------------------------------------------------------------------------------------
# Framework helpers (§7)
# ---------------------------------------------------------------------------------------------


def thd_padding_mask_from_token_ids(input_ids: torch.Tensor, padding_token_id: int) -> torch.Tensor:
    """§7.4: padding by token value; the pad id must fill exactly a contiguous tail."""
    is_pad = input_ids == padding_token_id
    n_real = int((~is_pad).sum().item())  # host sync
    tail = torch.arange(input_ids.shape[0], device=input_ids.device) >= n_real
    if not torch.equal(is_pad, tail):
        raise ValueError(
            f"padding_token_id={padding_token_id} also occurs as content, so padding cannot be inferred "
            "from token values. Supply seq_lens/seq_lens_padded (or an unused padding_token_id)."
        )
    return is_pad


def _thd_padding_mask(
    *,
    total_tokens: int,
    valid_seq_lens: torch.Tensor,
    valid_seq_lens_padded: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """§7.4: bool ``[T]``, True on the slots of each padded span beyond its real length and past the end."""
    real = valid_seq_lens.to(device=device, dtype=torch.long)
    if valid_seq_lens_padded is None:
        slots = real
    else:
        slots = valid_seq_lens_padded.to(device=device, dtype=torch.long)
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device=device), torch.cumsum(slots, dim=0)])
    pos = torch.arange(total_tokens, device=device)
    # Which document span each slot falls in; slots past the last span clamp to the last document.
    doc = torch.searchsorted(starts[1:], pos, right=True).clamp(max=real.numel() - 1)
    in_doc_pad = (pos - starts[doc]) >= real[doc]
    return in_doc_pad | (pos >= int(starts[-1].item()))  # host sync


def _drop_sentinel(lengths: torch.Tensor, sentinel: int) -> torch.Tensor:
    flat = lengths.reshape(-1)
    return flat[flat != sentinel]  # boolean index: host sync


def process_input_for_thd(
    batch: dict[str, torch.Tensor],
    seq_lens_padding_value: int = -1000,
    padding_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """§7.3: flatten ``[B, S]`` rows into one THD stream and derive its metadata.

    Reads the five keys by subscript (a missing one is a KeyError; ``position_ids`` and
    ``seq_lens`` may be None). Returns a new dict.
    """
    input_ids = batch["input_ids"]
    labels = batch["labels"]
    position_ids = batch["position_ids"]
    seq_lens = batch["seq_lens"]
    seq_lens_padded = batch["seq_lens_padded"]

    total = input_ids.shape[0] * input_ids.shape[1]
    # Token tensors: [T] for [B, S] input ([T, H] for [B, S, H]); may be views of the caller's storage.
    ids_thd = input_ids.reshape(total, -1).squeeze(-1)
    labels_thd = labels.reshape(total, -1).squeeze(-1)
    if position_ids is None:
        pos_thd = None
    elif position_ids.dim() == 3:  # mRoPE [n, B, S] -> [n, 1, T]
        pos_thd = position_ids.reshape(position_ids.shape[0], 1, -1)
    else:
        pos_thd = position_ids.reshape(-1)

    cu = cu_padded = max_seqlen = None
    real_lens = padded_lens = None
    if seq_lens is not None:
        real_lens = _drop_sentinel(seq_lens, seq_lens_padding_value)
        zero = torch.tensor([0], dtype=real_lens.dtype, device=real_lens.device)
        cu = torch.cat([zero, torch.cumsum(real_lens, dim=0)]).to(dtype=torch.int32)
        if seq_lens_padded is not None:
            padded_lens = _drop_sentinel(seq_lens_padded, seq_lens_padding_value)
            zero = torch.tensor([0], device=padded_lens.device)  # int64, as the reference has it
            cu_padded = torch.cat([zero, torch.cumsum(padded_lens, dim=0)]).to(dtype=torch.int32)

        # Absorption: only trailing padding (equal prefixes) -> both arrays end at T.
        if (
            cu_padded is not None
            and cu.numel() == cu_padded.numel()
            and cu.numel() > 1
            and torch.equal(cu[:-1], cu_padded[:-1])
        ):
            if int(cu[-1].item()) < int(total):  # host sync
                cu = cu.clone()
                cu[-1] = int(total)
                cu_padded = cu.clone()

        # max_seqlen from the final cu_seqlens (only when there is at least one document).
        if cu.numel() > 1:
            max_seqlen = (cu[1:] - cu[:-1]).max().to(dtype=torch.int32)

    if real_lens is None:
        padding_mask = thd_padding_mask_from_token_ids(ids_thd, padding_token_id)
    else:
        padding_mask = _thd_padding_mask(
            total_tokens=int(total),
            valid_seq_lens=real_lens,
            valid_seq_lens_padded=padded_lens,
            device=ids_thd.device,
        )

    out: dict[str, Any] = {
        "input_ids": ids_thd,
        "position_ids": pos_thd,
        "cu_seqlens": cu,
        "labels": labels_thd,
        "padding_mask": padding_mask,
    }
    if cu_padded is not None and not torch.equal(cu_padded, cu):
        out["cu_seqlens_padded"] = cu_padded
    if max_seqlen is not None:
        out["max_seqlen"] = max_seqlen
    # Everything else passes through untouched; an incoming key of the same name loses.
    for key, value in batch.items():
        if key not in out and key not in ("seq_lens", "seq_lens_padded"):
            out[key] = value
    return out


def _pad_rows_and_stack(rows: list[torch.Tensor], fill: int) -> torch.Tensor:
    """Right-pad 1-D rows with ``fill`` to the longest and stack them (``pad_and_stack``, §7.2)."""
    width = max(len(row) for row in rows)
    padded = []
    for row in rows:
        if len(row) < width:
            row = torch.cat([row, torch.full((width - len(row),), fill, dtype=row.dtype, device=row.device)])
        padded.append(row)
    return torch.stack(padded)


def split_batch_into_thd_chunks(
    batch: dict[str, torch.Tensor],
    num_chunks: int,
    seq_lens_padding_value: int = -1000,
    padding_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """§7.2: ``process_input_for_thd`` per group of ``B // num_chunks`` rows, stacked to ``[C, ...]``.

    No divisibility check here. Extra tensor keys are dropped; non-tensor keys come from chunk 0.
    """
    if num_chunks <= 1:
        return process_input_for_thd(batch, seq_lens_padding_value, padding_token_id)

    rows = batch["input_ids"].shape[0] // num_chunks
    chunks = []
    for c in range(num_chunks):
        piece = {k: (v[c * rows : (c + 1) * rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        chunks.append(process_input_for_thd(piece, seq_lens_padding_value, padding_token_id))

    out: dict[str, Any] = {}
    out["input_ids"] = torch.stack([ch["input_ids"] for ch in chunks])
    out["labels"] = torch.stack([ch["labels"] for ch in chunks])
    out["position_ids"] = torch.stack([ch["position_ids"] for ch in chunks])
    out["cu_seqlens"] = _pad_rows_and_stack([ch["cu_seqlens"] for ch in chunks], seq_lens_padding_value)
    out["padding_mask"] = torch.stack([ch["padding_mask"] for ch in chunks])
    if any("cu_seqlens_padded" in ch for ch in chunks):
        # A chunk that absorbed its padding contributes its (equal) cu_seqlens.
        out["cu_seqlens_padded"] = _pad_rows_and_stack(
            [ch.get("cu_seqlens_padded", ch["cu_seqlens"]) for ch in chunks], seq_lens_padding_value
        )
    if all("max_seqlen" in ch for ch in chunks):
        out["max_seqlen"] = torch.stack([ch["max_seqlen"] for ch in chunks])
    out.update({k: v for k, v in chunks[0].items() if not isinstance(v, torch.Tensor)})
    return out


def _shard_thd_chunk_for_te(batch, cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id):
    """§7.5: keep this rank's DualChunkSwap share of one THD stream; returns ``(out, indices)``.

    Index-selects the token keys of ``batch`` in place (the dict passed in is mutated), then
    builds ``out`` from a shallow copy.
    """
    # Step 1 (the reference's lazy ``import transformer_engine_torch``) has no equivalent here.

    # Step 2: note ``batch["cu_seqlens"]`` is evaluated even when cu_seqlens_padded is present.
    cu = batch.get("cu_seqlens", None)
    cu_padded = batch.get("cu_seqlens_padded", batch["cu_seqlens"])
    boundaries = cu_padded[cu_padded != seq_lens_padding_value]  # host sync; TypeError if None
    if cu is None or cu_padded is None:  # unreachable in practice (spec §7.5 step 2)
        raise ValueError(
            "BSHD format is not supported. Both 'cu_seqlens' and 'cu_seqlens_padded' must be present in the batch. "
            "Please use packed sequence format with cu_seqlens and cu_seqlens_padded."
        )

    # Step 3: no fallback; a process group must exist.
    cp_size = cp_mesh.size()
    cp_rank = torch.distributed.get_rank(group=cp_mesh.get_group()) if cp_mesh is not None else 0

    # Step 4-5: partition and gather the token-aligned keys.
    indices = thd_get_partitioned_indices(boundaries, batch["input_ids"].size(0), cp_size, cp_rank)
    for key in _TOKEN_KEYS:
        if key in batch:
            batch[key] = batch[key].index_select(0, indices)

    # Step 6-9.
    out = batch.copy()
    out.pop("attention_mask", None)
    out.pop("cu_seqlens_padded", None)
    longest = (boundaries[1:] - boundaries[:-1]).max().item()  # host sync: max padded length
    out.update(
        {
            "input_ids": batch["input_ids"].to(torch.int64).contiguous(),
            "labels": batch["labels"].to(torch.int64).contiguous(),
            "position_ids": batch["position_ids"].to(torch.int64).contiguous(),
            "cu_seqlens": cu_padded.to(torch.int32).contiguous(),  # padded, unfiltered
            "max_seqlen": torch.tensor(longest).to(torch.int32).to(device=cu_padded.device),
            "qkv_format": qkv_format,
            "cp_size": cp_size,
            "cp_rank": cp_rank,
        }
    )
    if "padding_mask" in batch:
        out["padding_mask"] = batch["padding_mask"].bool().contiguous()
    else:
        out["padding_mask"] = thd_padding_mask_from_token_ids(out["input_ids"], padding_token_id).contiguous()
    return out, indices


def make_cp_batch_for_te(
    cp_mesh,
    batch,
    qkv_format="thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
    return_local_indices: bool = False,
):
    """§7.1: THD-flatten ``batch`` (§7.2) and, when cp > 1, shard every chunk (§7.5)."""
    if qkv_format != "thd":
        raise ValueError(f"Currently only 'thd' format is supported, got: {qkv_format}")

    flat = split_batch_into_thd_chunks(
        batch,
        num_chunks=num_chunks,
        seq_lens_padding_value=seq_lens_padding_value,
        padding_token_id=padding_token_id,
    )

    if cp_mesh is None or cp_mesh.size() <= 1:
        if not return_local_indices:
            return flat
        ids = flat["input_ids"]
        identity = torch.arange(ids.shape[-1], device=ids.device, dtype=torch.long) if num_chunks <= 1 else None
        return flat, identity

    if num_chunks <= 1:
        out, indices = _shard_thd_chunk_for_te(flat, cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id)
        return (out, indices) if return_local_indices else out

    # Chunked: shard each [C, ...] row separately, then keep a fixed set of keys (all else dropped).
    shards = []
    for c in range(num_chunks):
        piece = {k: (v[c] if isinstance(v, torch.Tensor) else v) for k, v in flat.items()}
        shards.append(_shard_thd_chunk_for_te(piece, cp_mesh, qkv_format, seq_lens_padding_value, padding_token_id)[0])

    def stacked(key):
        return torch.stack([s[key] for s in shards])

    out = {
        "input_ids": stacked("input_ids"),
        "labels": stacked("labels"),
        "position_ids": stacked("position_ids"),
        "cu_seqlens": stacked("cu_seqlens"),
        "max_seqlen": stacked("max_seqlen"),
        "qkv_format": qkv_format,
        "padding_mask": stacked("padding_mask"),
        "cp_size": cp_mesh.size() if cp_mesh is not None else 1,
        "cp_rank": torch.distributed.get_rank(group=cp_mesh.get_group()) if cp_mesh is not None else 0,
    }
    return (out, None) if return_local_indices else out


# ---------------------------------------------------------------------------------------------
# MiMo wrapper (cp.py, §2-§6)
# ---------------------------------------------------------------------------------------------


_UPSTREAM_CP = "nemo_automodel.components.models.mimo_v2_flash.cp"
_no_upstream_cp: list = []


def ensure_mimo_te_context_parallel(model, cp_mesh) -> None:
    """§5 step 6 as upstream runs it: the ``ensure_mimo_te_context_parallel`` that upstream's ``cp``
    module holds at call time (a monkeypatch of ``cp.ensure_mimo_te_context_parallel`` applies);
    the package's stand-in when that module cannot be imported."""
    module = sys.modules.get(_UPSTREAM_CP)
    if module is None and not _no_upstream_cp:
        try:
            module = importlib.import_module(_UPSTREAM_CP)
        except Exception:  # noqa: BLE001 - any import failure means "no upstream"
            _no_upstream_cp.append(True)
    fn = getattr(module, "ensure_mimo_te_context_parallel", None)
    (fn if callable(fn) else _compat.ensure_mimo_te_context_parallel)(model, cp_mesh)


def _flatten_chunks(tensor: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """§2: ``[B, S]`` -> ``[T]`` (one chunk) or ``[C, T/C]`` (chunk c = rows of group c, row-major)."""
    if tensor.ndim != 2:
        raise ValueError(f"MiMo THD token metadata must have shape [batch, sequence], got {tuple(tensor.shape)}")
    rows = tensor.shape[0]
    if num_chunks <= 0 or rows % num_chunks:
        raise ValueError(f"MiMo THD num_chunks={num_chunks} must evenly divide batch size {rows}")
    if num_chunks == 1:
        return tensor.reshape(-1).contiguous()
    return tensor.reshape(num_chunks, (rows // num_chunks) * tensor.shape[1]).contiguous()


def _media_mask(input_ids: torch.Tensor, token_id: int | None, num_chunks: int) -> torch.Tensor | None:
    """§3: global bool placeholder mask in THD stream order, or None when the modality has no id."""
    if token_id is None:
        return None
    return _flatten_chunks(input_ids == int(token_id), num_chunks)


def _resolve_cp_rank(cp_mesh) -> int:
    """§4 rank resolution: process group when initialized, else the mesh's local rank, else 0."""
    if cp_mesh is None:
        return 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=cp_mesh.get_group())
    get_local_rank = getattr(cp_mesh, "get_local_rank", _MISSING)
    return 0 if get_local_rank is _MISSING else get_local_rank()


def _chunk_partition_indices(
    batch: dict[str, Any],
    *,
    cp_mesh,
    num_chunks: int,
    seq_lens_padding_value: int,
) -> torch.Tensor:
    """§4: this rank's token indices per chunk, int64 ``[L]`` (C == 1) or ``[C, L]``.

    Indices count from the start of each chunk's own flattened stream.
    """
    input_ids = batch.get("input_ids")
    padded = batch.get("seq_lens_padded")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError("MiMo TE THD sharding requires input_ids [batch, sequence]")
    if not isinstance(padded, torch.Tensor) or padded.ndim != 2:  # checked even at cp 1
        raise ValueError("MiMo TE THD sharding requires seq_lens_padded [batch, documents]")
    n_rows = input_ids.shape[0]
    if n_rows % num_chunks:  # ZeroDivisionError at num_chunks == 0, as in the reference
        raise ValueError(f"MiMo THD num_chunks={num_chunks} must evenly divide batch size {n_rows}")

    cp_size = 1 if cp_mesh is None else cp_mesh.size()
    cp_rank = _resolve_cp_rank(cp_mesh)
    rows = n_rows // num_chunks
    chunk_tokens = rows * input_ids.shape[1]

    per_chunk = []
    for c in range(num_chunks):
        if cp_size == 1:
            per_chunk.append(torch.arange(chunk_tokens, device=input_ids.device, dtype=torch.long))
            continue
        # Sentinel filtered in the original dtype, then int32 (host sync).
        lens = _drop_sentinel(padded[c * rows : (c + 1) * rows], seq_lens_padding_value).to(torch.int32)
        if lens.numel() == 0 or bool((lens <= 0).any().item()):
            raise ValueError("MiMo TE THD padded document lengths must be positive")
        covered = int(lens.sum().item())
        if covered != chunk_tokens:
            raise ValueError(
                "MiMo TE THD seq_lens_padded must cover each pipeline chunk: "
                f"got {covered} slots for {chunk_tokens} tokens"
            )
        if bool((lens % (2 * cp_size) != 0).any().item()):
            raise ValueError(
                "MiMo TE context parallelism requires every padded document length "
                f"to be divisible by 2 * cp_size ({2 * cp_size}); got {lens.tolist()}"
            )
        cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=lens.device), lens.cumsum(0, dtype=torch.int32)])
        # The reference imports TE lazily here; our oracle answers instead.
        per_chunk.append(thd_get_partitioned_indices(cu, chunk_tokens, cp_size, cp_rank).to(torch.long))
    return per_chunk[0] if num_chunks == 1 else torch.stack(per_chunk)


def shard_batch_for_mimo_te(
    cp_mesh,
    tp_mesh,
    batch: dict[str, Any],
    *,
    model: torch.nn.Module | None = None,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    num_chunks: int = 1,
    image_token_id: int | None = None,
    video_token_id: int | None = None,
):
    """§5: framework TE-THD sharding plus MiMo's local index map and global media masks.

    Returns ``(contextlib.nullcontext, prepared, layout)``; ``layout`` is None when num_chunks > 1.
    """
    del tp_mesh  # step 1
    if loss_mask is not None:
        raise ValueError("MiMo TE THD sharding does not support an external loss_mask; encode it in labels")
    if batch.get("qkv_format") != "thd":
        raise ValueError(
            "MiMo packed context parallelism requires qkv_format='thd'; "
            "packed NEAT masks cannot be represented by TE context parallelism"
        )
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError("MiMo TE THD sharding requires input_ids [batch, sequence]")
    position_ids = batch.get("position_ids")
    if num_chunks > 1 and isinstance(position_ids, torch.Tensor) and position_ids.ndim != 2:
        # Quirk kept: the message says one-dimensional, the check wants [B, S].
        raise ValueError("MiMo THD pipeline parallelism currently requires one-dimensional position_ids")
    if model is not None:  # step 6: side effect before the partition checks (§13.9)
        ensure_mimo_te_context_parallel(model, cp_mesh)

    row_shape = tuple(input_ids.shape)
    image_mask = _media_mask(input_ids, image_token_id, num_chunks)
    video_mask = _media_mask(input_ids, video_token_id, num_chunks)
    local = _chunk_partition_indices(
        batch, cp_mesh=cp_mesh, num_chunks=num_chunks, seq_lens_padding_value=_SEQ_LENS_PADDING_VALUE
    )
    pp_media = batch.get(_VLM_PP_MEDIA_KEY)  # same object, re-attached below

    prepared = make_cp_batch_for_te(
        cp_mesh,
        batch,
        qkv_format="thd",
        padding_token_id=padding_token_id,
        num_chunks=num_chunks,
        seq_lens_padding_value=_SEQ_LENS_PADDING_VALUE,
        return_local_indices=False,
    )
    prepared[_MIMO_THD_LOCAL_INDICES] = local
    if image_mask is not None:
        prepared[_MIMO_GLOBAL_IMAGE_MASK] = image_mask
    if video_mask is not None:
        prepared[_MIMO_GLOBAL_VIDEO_MASK] = video_mask
    if pp_media is not None:
        prepared[_VLM_PP_MEDIA_KEY] = pp_media

    layout = None
    if num_chunks == 1:
        layout = _compat.ShardLayout(
            local_token_global_indices=local,
            padded_seq_len=row_shape[0] * row_shape[1],
            input_row_shape=row_shape,
        )
    return contextlib.nullcontext, prepared, layout


def make_mimo_te_cp_sharder(
    *,
    model: torch.nn.Module,
    num_chunks: int,
    image_token_id: int | None,
    video_token_id: int | None,
):
    """§6: an unresolved direct-mode sharder; the framework rebinds it to the real mesh (§8.3)."""
    return _compat.ContextParallelSharder(
        shard_batch=partial(
            shard_batch_for_mimo_te,
            model=model,
            num_chunks=num_chunks,
            image_token_id=image_token_id,
            video_token_id=video_token_id,
        ),
        local_token_global_indices=None,
    )


__all__ = [
    "_MIMO_GLOBAL_IMAGE_MASK",
    "_MIMO_GLOBAL_VIDEO_MASK",
    "_MIMO_THD_LOCAL_INDICES",
    "make_mimo_te_cp_sharder",
    "shard_batch_for_mimo_te",
]
