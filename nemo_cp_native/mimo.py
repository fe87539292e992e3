"""Native drop-in for ``nemo_automodel.components.models.mimo_v2_flash.cp``.

Same names, signatures, return values and error messages as the reference (spec
``mimo_te.md``; upstream 0.7.0). What changes is how the work is done, in ONE call into C
(``_C.mimo_run``) per sharder call:

- the small ``seq_lens`` / ``seq_lens_padded`` tables are read on the host (one device-to-host
  copy when they live on a GPU, the call's only host sync; none when they are on the CPU);
- C (``csrc/core/mimo_layout.c``) does all validation, sentinel filtering, ``cu_seqlens``, the
  absorption rule, ``max_seqlen`` and the DualChunkSwap tables for every pipeline chunk;
- the compact table reaches the GPU inside the kernel's launch parameters (``seq_lens*`` on the
  host and a table of at most 30 KiB) or by one host-to-device copy from a pinned staging slot on
  the current stream; one fused pass (``csrc/{cpu,cuda}/thd_shard``) gathers ``input_ids``, ``labels``,
  ``position_ids``, builds the padding mask, the local-index map and both media masks for every
  chunk. The partition is computed once, not twice as in the reference.

Every output lives in one flat buffer allocated here (carving cached per shape), or for
``cu_seqlens*`` / ``max_seqlen`` in a host int32 block when the tokens are on a GPU and ``seq_lens*``
on the host. The returned tensors are views of these, made only for the outputs the call returns
(the host cost of a call is mostly the making of tensor objects): with one chunk, one
``unsafe_split_with_sizes`` of the int64 buffer (pieces sharing its storage without autograd view
tracking, which integer and bool tensors never use: 0.2 us less per piece than ``split_with_sizes``),
whose mask words are viewed as bool and split again and whose layout block is viewed as int32
(``cu_seqlens`` a slice of it, ``max_seqlen`` an element);
``as_strided`` otherwise. C reads the tensors through the DLPack C exchange API where torch
publishes it (``_C.mimo_run_x``: no capsule, no Python call per tensor; torch's current stream taken
in C), else as ``torch.utils.dlpack.to_dlpack`` capsules, and checks their dtypes (Python only those
of ``seq_lens*`` it copies off a GPU).

Inputs outside that fast path (3-D mRoPE position ids, no ``seq_lens``, token or length tensors of
a dtype other than int32 / int64, batches holding keys the framework would reinterpret, ...) run
the pure-PyTorch reference in ``nemo_cp_native.reference.mimo``, so behaviour stays exact for every
input. ``fast_path_info()`` tells which path the last call took.
"""

from __future__ import annotations

import contextlib
import operator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from torch.utils.dlpack import to_dlpack

from . import _compat
from ._ops import EXCHANGE as _X
from ._ops import Fallback, _C
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
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_CONSUMED = frozenset(("seq_lens", "seq_lens_padded"))
_DROPPED_TE = frozenset(("seq_lens", "seq_lens_padded", "attention_mask", "cu_seqlens_padded"))  # §7.3 + §7.5 step 6
# NCP_MIMO_* output bits of csrc/include/ncp/ncp.h
_OUT_TOKENS, _OUT_POS, _OUT_PAD, _OUT_IMAGE, _OUT_VIDEO = 1, 2, 4, 8, 16
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
    return _flatten_chunks(input_ids == int(token_id), num_chunks)  # `==`: the reference's error on None


def _resolve_rank(cp_mesh) -> tuple[int, int]:
    """MiMo's (cp_size, cp_rank) resolution (spec 4)."""
    if cp_mesh is None:
        return 1, 0
    size = cp_mesh.size()
    if dist.is_available() and dist.is_initialized():
        return size, dist.get_rank(group=cp_mesh.get_group())
    return size, getattr(cp_mesh, "get_local_rank", lambda: 0)()


# ------------------------------------------------------------------------------------------
# the native call
# ------------------------------------------------------------------------------------------


def _cut(views, at, end):
    """``split_with_sizes`` sizes and piece names covering ``[at, end)`` with the sorted
    ``(offset, size, name)`` views; the pieces between them are named "_gap"."""
    sizes, names = [], []
    for offset, size, name in views:
        if offset > at:
            sizes.append(offset - at)
            names.append("_gap")
        sizes.append(size)
        names.append(name)
        at = offset + size
    if end > at:
        sizes.append(end - at)
        names.append("_gap")
    return sizes, names


class _Plan:
    """Carving of the flat output buffer for one shape (``_C.mimo_plan``), with the view specs."""

    __slots__ = ("out_words", "lay_off", "lay_words", "views", "C", "cut64", "names64", "cutb", "namesb")

    def __init__(self, key):
        B, S, n_real, n_pad, C, W, outputs = key
        (L, Tc, local, ids, lab, pos, pad, img, vid, self.lay_off, self.lay_words, self.out_words) = _C.mimo_plan(
            B, S, n_real, n_pad, C, W, outputs
        )
        self.C = C
        tok = ((L,), (1,)) if C == 1 else ((C, L), (L, 1))
        mask = ((Tc,), (1,)) if C == 1 else ((C, Tc), (Tc, 1))
        # (name, dtype view, size, stride, offset in elements of that dtype); absent outputs skipped
        specs = [("local", 0, *tok, local), ("ids", 0, *tok, ids), ("labels", 0, *tok, lab), ("pos", 0, *tok, pos),
                 ("pad", 1, *tok, pad), ("image", 1, *mask, img), ("video", 1, *mask, vid)]  # fmt: skip
        self.views = tuple(spec for spec in specs if spec[-1] >= 0)
        # One chunk: every view is 1-D and contiguous, so all of them come from unsafe_split_with_sizes
        # (one op for several tensors: half the host cost of as many as_strided calls; sizes as tuples, which
        # torch parses faster than lists). The int64 split ends with the words of the masks ("_bools",
        # viewed as bool and split again unless it is one mask filling them: cutb None) and the layout
        # block ("_lay", viewed as int32 for cu_seqlens / max_seqlen).
        self.cut64 = self.names64 = self.cutb = self.namesb = None
        if C == 1:
            ints, bools = (sorted((v[-1], v[2][0], v[0]) for v in self.views if v[1] == b) for b in (0, 1))
            if bools:
                first = bools[0][0] // 8  # the masks follow the int64 outputs, from a word boundary
                cutb, namesb = _cut(bools, first * 8, self.lay_off * 8)
                self.cutb, self.namesb = tuple(cutb) if len(cutb) > 1 else None, tuple(namesb)
                ints.append((first, self.lay_off - first, "_bools"))
            cut64, names64 = _cut(ints, 0, self.lay_off)
            self.cut64, self.names64 = (*cut64, self.out_words - self.lay_off), (*names64, "_lay")


_plans: dict = {}


def _plan(key) -> _Plan:
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= 256:  # shapes vary per step in some recipes: keep the cache bounded
            _plans.clear()
        plan = _plans[key] = _Plan(key)
    return plan


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # CUDA builds of torch: no Stream object per call

    def _stream(device: torch.device):
        return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None

else:

    def _stream(device: torch.device):
        return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def _host_metadata(tensors, device):
    """The ``seq_lens*`` tables of a GPU batch on the host, in ONE device-to-host copy (the call's
    only host sync); Fallback when they are not integer tables on the device of the tokens."""
    for t in tensors:
        if t.device != device or t.dtype not in _INT_DTYPES or t.ndim != 2:
            raise Fallback("seq_lens / seq_lens_padded live on another device or are not integer tables")
    host = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).cpu()
    views, start = [], 0
    for t in tensors:
        views.append(host[start : start + t.numel()].view(t.shape))
        start += t.numel()
    return views


# the layout outputs _run returns: none, cu_seqlens + max_seqlen (TE), also cu_seqlens_padded when
# emitted (THD, cp_size 1); views nobody returns are not made
_LAY_NONE, _LAY_TE, _LAY_THD = 0, 1, 2


def _buffers(input_ids, sl, slp, C, W, outputs, dev, host_layout: bool):
    """The call's plan (cached per shape) and fresh buffers: the flat int64 output on the tokens'
    device, and with ``host_layout`` the layout block on the host (int32: its outputs' dtype)."""
    key = (*input_ids.shape, sl.shape[1], slp.shape[1], C, W, outputs)
    plan = _plans.get(key) or _plan(key)
    out = torch.empty(plan.out_words, dtype=torch.int64, device=dev)
    host = torch.empty(2 * plan.lay_words, dtype=torch.int32) if host_layout else None
    return plan, out, host


def _run(input_ids, labels, pos, sl, slp, C, W, rank, image_id, video_id, outputs, sentinel, lay=_LAY_TE):
    """One ``_C.mimo_run``: returns the named views of the output buffer ("local", "ids", "labels",
    "pos", "pad", "image", "video" as ``outputs`` asks; "cu", "max" and "cup" as ``lay`` asks)."""
    dev, cuda, host = input_ids.device, input_ids.is_cuda, None
    meta_on_gpu = sl.is_cuda or slp.is_cuda
    if meta_on_gpu:
        sl, slp = _host_metadata((sl, slp), dev)
    res, plan = NotImplemented, None
    if _X:  # the tensors read in C through the DLPack C exchange API (_ops.EXCHANGE): no capsules
        try:
            plan, out, host = _buffers(input_ids, sl, slp, C, W, outputs, dev, cuda and not meta_on_gpu)
        except (BufferError, RuntimeError):  # a shape torch will not give (a nested tensor): as by capsules
            pass
        else:
            res = _C.mimo_run_x(input_ids, labels, pos, sl, slp, out, host, C, W, rank, image_id, video_id, sentinel,
                                outputs)  # fmt: skip
    if res is NotImplemented:  # an older torch, or a tensor that path does not read: capsules
        try:  # the inputs first (C checks their dtypes, shapes and devices: Fallback for any it does not take)
            c_ids, c_lab, c_pos, c_sl, c_slp = (
                to_dlpack(input_ids), to_dlpack(labels), None if pos is None else to_dlpack(pos), to_dlpack(sl),
                to_dlpack(slp),
            )  # fmt: skip
        except (BufferError, RuntimeError) as exc:  # e.g. a meta, sparse or nested tensor: the reference decides
            raise Fallback(f"a tensor cannot cross DLPack: {exc}") from None
        if plan is None:
            plan, out, host = _buffers(input_ids, sl, slp, C, W, outputs, dev, cuda and not meta_on_gpu)
        res = _C.mimo_run(
            input_ids=c_ids, labels=c_lab, position_ids=c_pos, seq_lens=c_sl, seq_lens_padded=c_slp,
            out=to_dlpack(out), host=None if host is None else to_dlpack(host), num_chunks=C, cp_size=W, cp_rank=rank,
            image_token_id=image_id, video_token_id=video_id, sentinel=sentinel, outputs=outputs,
            stream=_stream(dev) if cuda else None,
        )  # fmt: skip
    cu_off, cu_w, cup_off, cup_w, max_off, emit = res
    # out and host are fresh (storage offset 0), so plan offsets are storage offsets
    if C == 1:
        views = dict(zip(plan.names64, out.unsafe_split_with_sizes(plan.cut64)))
        if plan.namesb:
            bools = views["_bools"].view(torch.bool)
            if plan.cutb is None:  # one mask filling its words: the bool view is the mask itself
                views[plan.namesb[0]] = bools
            else:
                views.update(zip(plan.namesb, bools.unsafe_split_with_sizes(plan.cutb)))
    else:
        views, as_bool = {}, out.view(torch.bool) if outputs & (_OUT_PAD | _OUT_IMAGE | _OUT_VIDEO) else None
        for name, is_bool, size, stride, offset in plan.views:
            views[name] = (as_bool if is_bool else out).as_strided(size, stride, offset)
    if lay == _LAY_NONE:
        return views
    # int32 offsets of the layout outputs: in host, in the "_lay" piece (one chunk), or in out
    if host is not None:
        i32, base = host, 0
    elif C == 1:
        i32, base = views["_lay"].view(torch.int32), 0
    else:
        i32, base = out.view(torch.int32), 2 * plan.lay_off
    cu, mx = base + 2 * cu_off, base + 2 * max_off
    if C == 1:  # 1-D slice and 0-d element: cheaper than as_strided, same sizes, strides and offsets
        views["cu"], views["max"] = i32[cu : cu + cu_w], i32[mx]
    else:
        views["cu"], views["max"] = i32.as_strided((C, cu_w), (cu_w, 1), cu), i32[mx : mx + C]
    if lay == _LAY_THD and emit:
        cup = base + 2 * cup_off
        views["cup"] = i32[cup : cup + cup_w] if C == 1 else i32.as_strided((C, cup_w), (cup_w, 1), cup)
    return views


def _fallback_reason(batch, num_chunks, cp_size) -> str | None:
    """Why this call cannot take the native path, as far as Python must tell (None: it may). C checks
    the rest (dtypes, shapes, devices, token ids) and raises ``Fallback`` with its reason."""
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        return "num_chunks is not a positive int"
    if batch["input_ids"].shape[0] % num_chunks:
        return "input_ids is not divisible into num_chunks"
    for key in ("labels", "position_ids", "seq_lens"):
        if key not in batch:
            return f"batch has no {key!r}"
    if not isinstance(batch["labels"], torch.Tensor):
        return "labels is not an integer [batch, sequence] tensor"
    pos = batch["position_ids"]
    if pos is not None and not isinstance(pos, torch.Tensor):
        return "position_ids is not an integer [batch, sequence] tensor"
    sl = batch["seq_lens"]
    if not isinstance(sl, torch.Tensor) or sl.ndim != 2:
        return "seq_lens is not an integer [batch, documents] tensor"
    if "cu_seqlens_padded" in batch:
        return "the batch already carries cu_seqlens_padded"
    if num_chunks > 1:
        for v in batch.values():  # a loop: no generator object per call
            if isinstance(v, torch.Tensor) and v.ndim == 0:
                return "a 0-d tensor in the batch (the reference slices every tensor per chunk)"
    if cp_size > 1 and not (dist.is_available() and dist.is_initialized()):
        return "torch.distributed is not initialized"
    if cp_size > _INT32_MAX:
        return "cp_size does not fit in int32"
    return None


# ------------------------------------------------------------------------------------------
# the output dict (spec 7.2-7.6)
# ------------------------------------------------------------------------------------------


def _flat(t, n):
    """``t.reshape(n, -1).squeeze(-1)`` (the reference's flattening of a 2-D tensor of n elements) in
    one op where it is a view: the same sizes, strides, storage and base."""
    try:
        return t.view(n)
    except RuntimeError:  # not viewable: the reference's copy, as it makes it
        return t.reshape(n, -1).squeeze(-1)


def _process_input_view(batch, views, num_chunks):
    """``process_input_for_thd`` / ``split_batch_into_thd_chunks`` at cp_size <= 1 (spec 7.2-7.3)."""
    input_ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    B, S = input_ids.shape
    if num_chunks == 1:
        T = B * S
        result = {
            "input_ids": _flat(input_ids, T),
            "position_ids": None if pos is None else pos.reshape(-1),
            "cu_seqlens": views["cu"],
            "labels": _flat(labels, T),
            "padding_mask": views["pad"],
        }
        if "cup" in views:
            result["cu_seqlens_padded"] = views["cup"]
        result["max_seqlen"] = views["max"]
        for key, value in batch.items():
            if key not in result and key not in _CONSUMED:
                result[key] = value
        return result
    C, Tc = num_chunks, B // num_chunks * S
    stacked = {
        "input_ids": input_ids.reshape(C, Tc).clone(),
        "labels": labels.reshape(C, Tc).clone(),
        "position_ids": pos.reshape(C, Tc).clone(),
        "cu_seqlens": views["cu"],
        "padding_mask": views["pad"],
    }
    if "cup" in views:
        stacked["cu_seqlens_padded"] = views["cup"]
    stacked["max_seqlen"] = views["max"]
    for key, value in batch.items():  # non-tensor keys of chunk 0's result
        if key not in stacked and key not in _CONSUMED and not isinstance(value, torch.Tensor):
            stacked[key] = value
    return stacked


def _sharded_view(batch, views, num_chunks, cp_size, cp_rank):
    """``make_cp_batch_for_te`` output at cp_size > 1 (spec 7.5-7.6)."""
    if num_chunks > 1:
        return {
            "input_ids": views["ids"],
            "labels": views["labels"],
            "position_ids": views["pos"],
            "cu_seqlens": views["cu"],
            "max_seqlen": views["max"],
            "qkv_format": "thd",
            "padding_mask": views["pad"],
            "cp_size": cp_size,
            "cp_rank": cp_rank,
        }
    # process_input_for_thd's keys (cu_seqlens_padded popped), then _shard_thd_chunk_for_te's updates
    b = {
        "input_ids": views["ids"],
        "position_ids": views["pos"],
        "cu_seqlens": views["cu"],
        "labels": views["labels"],
        "padding_mask": views["pad"],
        "max_seqlen": views["max"],
    }
    for key, value in batch.items():
        if key not in b and key not in _DROPPED_TE:
            b[key] = value
    b["qkv_format"] = "thd"
    b["cp_size"] = cp_size
    b["cp_rank"] = cp_rank
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
    kwargs = {"cp_mesh": cp_mesh, "num_chunks": num_chunks, "seq_lens_padding_value": seq_lens_padding_value}
    simple = (
        isinstance(num_chunks, int) and not isinstance(num_chunks, bool) and num_chunks >= 1
        and isinstance(seq_lens_padding_value, int) and _INT64_MIN <= seq_lens_padding_value <= _INT64_MAX
        and cp_size <= _INT32_MAX
    )  # fmt: skip
    if not simple:
        return _ref._chunk_partition_indices(batch, **kwargs)
    B, S = input_ids.shape
    L = (B // num_chunks * S) // max(cp_size, 1)
    if cp_size == 1:
        idx = torch.arange(L, device=input_ids.device, dtype=torch.long)
        return idx if num_chunks == 1 else idx.expand(num_chunks, L).clone()
    try:  # local indices only; input_ids stands in for the token inputs that are not gathered
        views = _run(input_ids, input_ids, input_ids, padded, padded, num_chunks, cp_size, cp_rank, None, None, 0,
                     seq_lens_padding_value, _LAY_NONE)  # fmt: skip
    except Fallback:
        return _ref._chunk_partition_indices(batch, **kwargs)
    return views["local"]


def _reference(reason, cp_mesh, batch, padding_token_id, num_chunks, image_token_id, video_token_id):
    """The reference's ``shard_batch_for_mimo_te`` (model and loss_mask are handled by the caller),
    recorded in ``fast_path_info``; a module function, not a closure (none made per call)."""
    _last_path["path"], _last_path["reason"] = "reference", reason
    return _ref.shard_batch_for_mimo_te(
        cp_mesh, None, batch, model=None, loss_mask=None, padding_token_id=padding_token_id,
        num_chunks=num_chunks, image_token_id=image_token_id, video_token_id=video_token_id,
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

    One call into C. Host syncs: none with ``seq_lens*`` on the CPU, one (their copy to the host)
    when they live on a GPU.
    """
    del tp_mesh
    _last_path["path"] = _last_path["reason"] = None  # an error raised before a path is chosen reports None
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
    if model is not None:  # looked up on upstream's cp module at call time, as upstream does
        _ref.ensure_mimo_te_context_parallel(model, cp_mesh)

    padded = batch.get("seq_lens_padded")
    if not isinstance(padded, torch.Tensor) or padded.ndim != 2:
        return _reference("seq_lens_padded is not a 2-D tensor", cp_mesh, batch, padding_token_id, num_chunks,
                          image_token_id, video_token_id)  # fmt: skip
    try:
        image_id = None if image_token_id is None else operator.index(image_token_id)
        video_id = None if video_token_id is None else operator.index(video_token_id)
    except TypeError:
        return _reference("a media token id is not an int", cp_mesh, batch, padding_token_id, num_chunks,
                          image_token_id, video_token_id)  # fmt: skip
    cp_size, cp_rank = _resolve_rank(cp_mesh)
    reason = _fallback_reason(batch, num_chunks, cp_size)
    if reason is not None:
        return _reference(reason, cp_mesh, batch, padding_token_id, num_chunks,
                          image_token_id, video_token_id)  # fmt: skip
    pp_media = batch.get(_VLM_PP_MEDIA_KEY)
    sharded = cp_size > 1
    outputs = _OUT_PAD | (0 if image_id is None else _OUT_IMAGE) | (0 if video_id is None else _OUT_VIDEO)
    if sharded:
        outputs |= _OUT_TOKENS | (0 if position_ids is None else _OUT_POS)
    _last_path["path"] = "native"  # also when the native validation raises
    try:
        views = _run(input_ids, batch["labels"], position_ids, batch["seq_lens"], padded, num_chunks, cp_size, cp_rank,
                     image_id, video_id, outputs, _SEQ_LENS_PADDING_VALUE,
                     _LAY_TE if sharded else _LAY_THD)  # fmt: skip
    except Fallback as exc:
        return _reference(str(exc), cp_mesh, batch, padding_token_id, num_chunks,
                          image_token_id, video_token_id)  # fmt: skip
    if sharded:
        prepared = _sharded_view(batch, views, num_chunks, cp_size, cp_rank)
    else:
        prepared = _process_input_view(batch, views, num_chunks)
    local = views["local"]
    prepared[_MIMO_THD_LOCAL_INDICES] = local
    if image_id is not None:
        prepared[_MIMO_GLOBAL_IMAGE_MASK] = views["image"]
    if video_id is not None:
        prepared[_MIMO_GLOBAL_VIDEO_MASK] = views["video"]
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
