"""Native drop-in for ``nemo_automodel.components.models.mimo_v2_flash.cp``.

Same names, signatures, return values and error messages as the reference (spec
``mimo_te.md``; upstream 0.7.0). What changes is how the work is done:

- the small ``seq_lens`` / ``seq_lens_padded`` tables come to the host once (one device-to-host
  copy when they live on a GPU, none when they are on the CPU);
- C (``csrc/core/mimo_layout.c``) does all validation, sentinel filtering, ``cu_seqlens``, the
  absorption rule, ``max_seqlen`` and the DualChunkSwap tables for every pipeline chunk;
- one host-to-device copy of that compact table, then one fused pass
  (``csrc/{cpu,cuda}/thd_shard``) gathers ``input_ids``, ``labels``, ``position_ids``, builds the
  padding mask, the local-index map and both media masks for every chunk. The partition is
  computed once, not twice as in the reference.

Inputs outside that fast path (3-D mRoPE position ids, no ``seq_lens``, float token ids, batches
holding keys the framework would reinterpret, ...) run the pure-PyTorch reference in
``nemo_cp_native.reference.mimo``, so behaviour stays exact for every input. ``fast_path_info()``
tells which path the last call took.
"""

from __future__ import annotations

import contextlib
import operator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from . import _compat
from ._ops import Fallback, _C, dl, stream_of
from .reference import mimo as _ref

_MIMO_GLOBAL_IMAGE_MASK = "_mimo_global_image_mask"
_MIMO_GLOBAL_VIDEO_MASK = "_mimo_global_video_mask"
_MIMO_THD_LOCAL_INDICES = "_mimo_thd_local_indices"
_VLM_PP_MEDIA_KEY = "_vlm_pp_media_chunks"
_SEQ_LENS_PADDING_VALUE = -1000

__all__ = [
    "_MIMO_GLOBAL_IMAGE_MASK",
    "_MIMO_GLOBAL_VIDEO_MASK",
    "_MIMO_THD_LOCAL_INDICES",
    "make_mimo_te_cp_sharder",
    "shard_batch_for_mimo_te",
]

_INT_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1
_CONSUMED = ("seq_lens", "seq_lens_padded")
_last_path = {"path": None, "reason": None}


def fast_path_info() -> dict:
    """``{"path": "native" | "reference", "reason": str | None}`` of the last sharding call."""
    return dict(_last_path)


# ------------------------------------------------------------------------------------------
# small reference-identical helpers
# ------------------------------------------------------------------------------------------


def _flatten_chunks(tensor: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Flatten batch rows into one token stream per pipeline chunk (``[T]`` or ``[C, T/C]``)."""
    if tensor.ndim != 2:
        raise ValueError(f"MiMo THD token metadata must have shape [batch, sequence], got {tuple(tensor.shape)}")
    if num_chunks <= 0 or tensor.shape[0] % num_chunks:
        raise ValueError(f"MiMo THD num_chunks={num_chunks} must evenly divide batch size {tensor.shape[0]}")
    if num_chunks == 1:
        return tensor.reshape(-1).contiguous()
    return tensor.reshape(num_chunks, (tensor.shape[0] // num_chunks) * tensor.shape[1]).contiguous()


def _media_mask(input_ids: torch.Tensor, token_id: int | None, num_chunks: int) -> torch.Tensor | None:
    """Global placeholder mask in THD stream order, or None when ``token_id`` is None."""
    if token_id is None:
        return None
    return _flatten_chunks(input_ids.eq(int(token_id)), num_chunks)


def _resolve_rank(cp_mesh) -> tuple[int, int]:
    """MiMo's (cp_size, cp_rank) resolution (spec 4)."""
    if cp_mesh is None:
        return 1, 0
    size = cp_mesh.size()
    if dist.is_available() and dist.is_initialized():
        return size, dist.get_rank(group=cp_mesh.get_group())
    return size, getattr(cp_mesh, "get_local_rank", lambda: 0)()


# ------------------------------------------------------------------------------------------
# the native pass
# ------------------------------------------------------------------------------------------


class _Layout:
    """Host tables of one call: the C layout pass plus its packed outputs on the right devices."""

    def __init__(self, seq_lens, seq_lens_padded, S, num_chunks, cp_size, sentinel, token_device):
        meta_device = seq_lens_padded.device
        B = seq_lens_padded.shape[0]
        if meta_device.type == "cuda":  # the one allowed device-to-host copy
            n = seq_lens.numel()
            host = torch.cat([seq_lens.reshape(-1).to(torch.int64), seq_lens_padded.reshape(-1).to(torch.int64)]).cpu()
            sl_h, slp_h = host[:n].reshape(seq_lens.shape), host[n:].reshape(seq_lens_padded.shape)
        else:
            sl_h = seq_lens.to(torch.int64).contiguous()
            slp_h = seq_lens_padded.to(torch.int64).contiguous()
        words = _C.mimo_layout_words(B, sl_h.shape[1], slp_h.shape[1], num_chunks)
        pinned = token_device.type == "cuda" and torch.cuda.is_available()
        buf = torch.empty(words, dtype=torch.int64, pin_memory=pinned)
        info = _C.mimo_layout(dl(sl_h), dl(slp_h), dl(buf), S, num_chunks, cp_size, sentinel)
        (self.kernel_words, cu_off, cu_width, cup_off, cup_width, maxlen_off, emit, total) = info
        self.emit_padded = bool(emit)
        # One host-to-device copy carries the kernel table and, when the metadata lives on the
        # GPU, the host-computed outputs too.
        if meta_device.type == "cuda":
            dev_buf = buf[:total].to(meta_device, non_blocking=True)
            out_buf = dev_buf
            self.table = dev_buf[: self.kernel_words] if token_device == meta_device else None
        else:
            out_buf = buf
            self.table = None
        if self.table is None:
            self.table = buf[: self.kernel_words].to(token_device, non_blocking=True) if token_device.type == "cuda" else buf
        C = num_chunks

        def i32(off, n, shape):
            t = out_buf[off : off + (n + 1) // 2].view(torch.int32)[:n].reshape(shape)
            return t if meta_device.type == "cuda" else t.clone()

        self.cu = i32(cu_off, C * cu_width, (C, cu_width))
        self.cup = i32(cup_off, C * cup_width, (C, cup_width)) if self.emit_padded else None
        self.max_seqlen = i32(maxlen_off, C, (C,))


def _fallback_reason(batch, num_chunks, cp_mesh, cp_size, token_ids) -> str | None:
    """Why this call cannot take the native path (None: it can)."""
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        return "num_chunks is not a positive int"
    input_ids = batch["input_ids"]
    B, S = input_ids.shape
    if B % num_chunks or B * S == 0 or input_ids.dtype not in _INT_DTYPES:
        return "input_ids is empty, not integer, or not divisible into num_chunks"
    dev = input_ids.device
    for key in ("labels", "position_ids", "seq_lens"):
        if key not in batch:
            return f"batch has no {key!r}"
    labels, pos, sl, slp = batch["labels"], batch["position_ids"], batch["seq_lens"], batch["seq_lens_padded"]
    if not isinstance(labels, torch.Tensor) or labels.dtype not in _INT_DTYPES or tuple(labels.shape) != (B, S):
        return "labels is not an integer [batch, sequence] tensor"
    if pos is None:
        if cp_size > 1 or num_chunks > 1:
            return "position_ids is None"
    elif not isinstance(pos, torch.Tensor) or pos.dtype not in _INT_DTYPES or tuple(pos.shape) != (B, S):
        return "position_ids is not an integer [batch, sequence] tensor"
    if any(t is not None and t.device != dev for t in (labels, pos)):
        return "token tensors live on different devices"
    if not isinstance(sl, torch.Tensor) or sl.ndim != 2 or sl.shape[0] != B or sl.dtype not in _INT_DTYPES:
        return "seq_lens is not an integer [batch, documents] tensor"
    if slp.shape[0] != B or slp.dtype not in _INT_DTYPES:
        return "seq_lens_padded is not an integer [batch, documents] tensor"
    if sl.device != slp.device or slp.device not in (dev, torch.device("cpu")):
        return "seq_lens / seq_lens_padded live on another device"
    if "cu_seqlens_padded" in batch:
        return "the batch already carries cu_seqlens_padded"
    if num_chunks > 1 and any(isinstance(v, torch.Tensor) and v.ndim == 0 for v in batch.values()):
        return "a 0-d tensor in the batch (the reference slices every tensor per chunk)"
    if cp_size > 1 and not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialized"
    if cp_size > _INT32_MAX:
        return "cp_size does not fit in int32"
    info = torch.iinfo(input_ids.dtype)
    if any(t is not None and not info.min <= t <= info.max for t in token_ids):
        return "a media token id does not fit the dtype of input_ids"
    return None


def _native_outputs(batch, num_chunks, cp_size, cp_rank, image_id, video_id, sentinel):
    """Runs the layout pass and the fused shard pass; returns tensors for the output dict."""
    input_ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    dev = input_ids.device
    B, S = input_ids.shape
    C = num_chunks
    Tc = B // C * S
    L = Tc // cp_size if cp_size > 1 else Tc
    lay = _Layout(batch["seq_lens"], batch["seq_lens_padded"], S, C, cp_size, sentinel, dev)
    sharded = cp_size > 1
    new = partial(torch.empty, device=dev)
    out = {
        "ids": new((C, L), dtype=torch.int64) if sharded else None,
        "labels": new((C, L), dtype=torch.int64) if sharded else None,
        "pos": new((C, L), dtype=torch.int64) if sharded and pos is not None else None,
        "pad": new((C, L), dtype=torch.bool),
        "local": new((C, L), dtype=torch.int64),
        "image": new((C, Tc), dtype=torch.bool) if image_id is not None else None,
        "video": new((C, Tc), dtype=torch.bool) if video_id is not None else None,
    }
    _C.mimo_shard(
        dl(input_ids), dl(labels), dl(pos if sharded else None), dl(lay.table),
        dl(out["ids"]), dl(out["labels"]), dl(out["pos"]), dl(out["pad"]), dl(out["local"]),
        dl(out["image"]), dl(out["video"]), C, cp_size, cp_rank, image_id, video_id, stream_of(dev),
    )  # fmt: skip
    return lay, out


def _squeeze_chunks(t, num_chunks):
    return t.reshape(-1) if num_chunks == 1 and t is not None else t


def _process_input_view(batch, lay, pad, num_chunks):
    """``process_input_for_thd`` / ``split_batch_into_thd_chunks`` at cp_size <= 1 (spec 7.2-7.3)."""
    input_ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    B, S = input_ids.shape
    if num_chunks == 1:
        T = B * S
        result = {
            "input_ids": input_ids.reshape(T, -1).squeeze(-1),
            "position_ids": None if pos is None else pos.reshape(-1),
            "cu_seqlens": lay.cu.reshape(-1),
            "labels": labels.reshape(T, -1).squeeze(-1),
            "padding_mask": pad.reshape(-1),
        }
        if lay.emit_padded:
            result["cu_seqlens_padded"] = lay.cup.reshape(-1)
        result["max_seqlen"] = lay.max_seqlen.reshape(())
        for key, value in batch.items():
            if key not in result and key not in _CONSUMED:
                result[key] = value
        return result
    C, Tc = num_chunks, B // num_chunks * S
    stacked = {
        "input_ids": input_ids.reshape(C, Tc).clone(),
        "labels": labels.reshape(C, Tc).clone(),
        "position_ids": pos.reshape(C, Tc).clone(),
        "cu_seqlens": lay.cu,
        "padding_mask": pad,
    }
    if lay.emit_padded:
        stacked["cu_seqlens_padded"] = lay.cup
    stacked["max_seqlen"] = lay.max_seqlen
    chunk0_keys = {"input_ids", "position_ids", "cu_seqlens", "labels", "padding_mask", "max_seqlen"}
    if lay.emit_padded:
        chunk0_keys.add("cu_seqlens_padded")
    for key, value in batch.items():  # non-tensor keys of chunk 0's result
        if key not in chunk0_keys and key not in _CONSUMED and not isinstance(value, torch.Tensor):
            stacked[key] = value
            chunk0_keys.add(key)
    return stacked


def _sharded_view(batch, lay, out, num_chunks, cp_size, cp_rank):
    """``make_cp_batch_for_te`` output at cp_size > 1 (spec 7.5-7.6)."""
    if num_chunks > 1:
        return {
            "input_ids": out["ids"],
            "labels": out["labels"],
            "position_ids": out["pos"],
            "cu_seqlens": lay.cu,
            "max_seqlen": lay.max_seqlen,
            "qkv_format": "thd",
            "padding_mask": out["pad"],
            "cp_size": cp_size,
            "cp_rank": cp_rank,
        }
    b = _process_input_view(batch, lay, out["pad"], 1)  # key order of process_input_for_thd
    b.pop("attention_mask", None)
    b.pop("cu_seqlens_padded", None)
    b.update(
        {
            "input_ids": out["ids"].reshape(-1),
            "labels": out["labels"].reshape(-1),
            "position_ids": out["pos"].reshape(-1),
            "cu_seqlens": lay.cu.reshape(-1),
            "max_seqlen": lay.max_seqlen.reshape(()),
            "qkv_format": "thd",
            "cp_size": cp_size,
            "cp_rank": cp_rank,
        }
    )
    b["padding_mask"] = out["pad"].reshape(-1)
    return b


# ------------------------------------------------------------------------------------------
# public names
# ------------------------------------------------------------------------------------------


def _chunk_partition_indices(
    batch: dict[str, Any], *, cp_mesh, num_chunks: int, seq_lens_padding_value: int
) -> torch.Tensor:
    """TE's DualChunkSwap partition for every chunk: int64 ``[L]`` (one chunk) or ``[C, L]``."""
    input_ids = batch.get("input_ids")
    padded = batch.get("seq_lens_padded")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise ValueError("MiMo TE THD sharding requires input_ids [batch, sequence]")
    if not isinstance(padded, torch.Tensor) or padded.ndim != 2:
        raise ValueError("MiMo TE THD sharding requires seq_lens_padded [batch, documents]")
    if input_ids.shape[0] % num_chunks:
        raise ValueError(f"MiMo THD num_chunks={num_chunks} must evenly divide batch size {input_ids.shape[0]}")
    cp_size, cp_rank = _resolve_rank(cp_mesh)
    simple = (
        isinstance(num_chunks, int) and not isinstance(num_chunks, bool) and num_chunks >= 1
        and padded.dtype in _INT_DTYPES and input_ids.dtype in _INT_DTYPES
        and isinstance(seq_lens_padding_value, int) and cp_size <= _INT32_MAX
        and padded.shape[0] == input_ids.shape[0] and input_ids.numel() > 0
        and padded.device in (input_ids.device, torch.device("cpu"))
    )  # fmt: skip
    if not simple:
        return _ref._chunk_partition_indices(
            batch, cp_mesh=cp_mesh, num_chunks=num_chunks, seq_lens_padding_value=seq_lens_padding_value
        )
    B, S = input_ids.shape
    L = (B // num_chunks * S) // max(cp_size, 1)
    dev = input_ids.device
    if cp_size == 1:
        idx = torch.arange(L, device=dev, dtype=torch.long)
        return idx if num_chunks == 1 else idx.expand(num_chunks, L).clone()
    try:
        lay = _Layout(padded, padded, S, num_chunks, cp_size, seq_lens_padding_value, dev)
    except Fallback:
        return _ref._chunk_partition_indices(
            batch, cp_mesh=cp_mesh, num_chunks=num_chunks, seq_lens_padding_value=seq_lens_padding_value
        )
    local = torch.empty((num_chunks, L), dtype=torch.int64, device=dev)
    _partition_only(input_ids, lay, local, num_chunks, cp_size, cp_rank)
    return local[0] if num_chunks == 1 else local


def _partition_only(input_ids, lay, local, num_chunks, cp_size, cp_rank):
    """Fills ``local`` with the DualChunkSwap indices of every chunk (one fused pass)."""
    dev = input_ids.device
    C, L = local.shape
    ids = torch.empty((C, L), dtype=torch.int64, device=dev)
    pad = torch.empty((C, L), dtype=torch.bool, device=dev)
    _C.mimo_shard(
        dl(input_ids), dl(input_ids), None, dl(lay.table), dl(ids), dl(ids), None, dl(pad), dl(local),
        None, None, num_chunks, cp_size, cp_rank, None, None, stream_of(dev),
    )  # fmt: skip


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
    """Native ``shard_batch_for_mimo_te``: ``(contextlib.nullcontext, prepared_batch, layout)``.

    At most one blocking host sync per call (the copy of ``seq_lens*`` when they live on a GPU).
    """
    del tp_mesh
    _last_path.update(path=None, reason=None)  # an error raised before a path is chosen reports None
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
        raise ValueError("MiMo THD pipeline parallelism currently requires one-dimensional position_ids")
    if model is not None:
        _compat.ensure_mimo_te_context_parallel(model, cp_mesh)

    def reference(reason):
        _last_path.update(path="reference", reason=reason)
        return _ref.shard_batch_for_mimo_te(
            cp_mesh, None, batch, model=None, loss_mask=None, padding_token_id=padding_token_id,
            num_chunks=num_chunks, image_token_id=image_token_id, video_token_id=video_token_id,
        )  # fmt: skip

    padded = batch.get("seq_lens_padded")
    if not isinstance(padded, torch.Tensor) or padded.ndim != 2:
        return reference("seq_lens_padded is not a 2-D tensor")
    try:
        token_ids = tuple(None if t is None else operator.index(t) for t in (image_token_id, video_token_id))
    except TypeError:
        return reference("a media token id is not an int")
    cp_size, cp_rank = _resolve_rank(cp_mesh)
    reason = _fallback_reason(batch, num_chunks, cp_mesh, cp_size, token_ids)
    if reason is not None:
        return reference(reason)
    if cp_size > 1:
        cp_rank = dist.get_rank(group=cp_mesh.get_group())
    pp_media = batch.get(_VLM_PP_MEDIA_KEY)
    _last_path.update(path="native", reason=None)  # also when the native validation raises
    try:
        lay, out = _native_outputs(batch, num_chunks, cp_size, cp_rank, *token_ids, _SEQ_LENS_PADDING_VALUE)
    except Fallback as exc:
        return reference(str(exc))
    if cp_size > 1:
        prepared = _sharded_view(batch, lay, out, num_chunks, cp_size, cp_rank)
    else:
        prepared = _process_input_view(batch, lay, _squeeze_chunks(out["pad"], num_chunks), num_chunks)
    local = _squeeze_chunks(out["local"], num_chunks)
    prepared[_MIMO_THD_LOCAL_INDICES] = local
    if out["image"] is not None:
        prepared[_MIMO_GLOBAL_IMAGE_MASK] = _squeeze_chunks(out["image"], num_chunks)
    if out["video"] is not None:
        prepared[_MIMO_GLOBAL_VIDEO_MASK] = _squeeze_chunks(out["video"], num_chunks)
    if pp_media is not None:
        prepared[_VLM_PP_MEDIA_KEY] = pp_media
    layout = None
    if num_chunks == 1:
        B, S = input_ids.shape
        layout = _compat.ShardLayout(local_token_global_indices=local, padded_seq_len=B * S, input_row_shape=(B, S))
    return contextlib.nullcontext, prepared, layout


def make_mimo_te_cp_sharder(
    *, model: torch.nn.Module, num_chunks: int, image_token_id: int | None, video_token_id: int | None
):
    """MiMo's sharder around the native ``shard_batch_for_mimo_te`` (resolved by the framework)."""
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
