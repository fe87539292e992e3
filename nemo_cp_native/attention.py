"""Learned-sink varlen attention: ``sink_attention`` and the ops under it.

Layering (FlashAttention's): ``torch.library.custom_op`` wraps each native entry point and has a
fake (meta) implementation for ``torch.compile``; ``SinkAttnFunc`` (autograd) saves
``(q, k, v, out, lse, sink)`` and calls the backward op; ``sink_attention`` wraps both. In eager
mode the autograd function calls the native entry points directly (the custom-op dispatch costs
more host time than the kernels' launch); under ``torch.compile`` it calls the custom ops.

Math (per query i, head h, kv head h // (Hq / Hkv), sink logit a_h, never scaled):
    lse_i = log(exp(a_h) + sum_{j visible} exp(scale <q_i, k_j>))
    out_i = sum_j exp(scale <q_i, k_j> - lse_i) v_j         (the sink has a zero value vector)
Visible: same document, key <= query, and query - key < window when window > 0 (the window
counts the current token). A row that sees nothing gets out = 0 and lse = a_h.

Every fact about the tensors that C can check (shapes, dtypes, devices, strides, head dims) is
checked once, in C (``csrc/core/attn_args.c``); Python checks only what C cannot see (argument
types, autograd state).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.utils.dlpack import to_dlpack

from ._ops import EXCHANGE, _C, capsules, dl, dl_named, stream_of

__all__ = ["AttnMask", "SinkAttnFunc", "attn_backward", "attn_forward", "backward_is_deterministic", "sink_attention",
           "sink_attn_autograd"]


@dataclass(frozen=True)
class AttnMask:
    """Which keys each query row sees: row i sees keys ``[lo(i), hi(i)]``, both non-decreasing in i.

    Documents (single device): ``cu_seqlens`` (int32 boundaries) and ``window``; query i and key j
    sit at stream position i and j, ``lo(i) = max(doc_start(i), i - window + 1)``, ``hi(i) = i``.
    Table (context parallelism): ``row_lo`` / ``row_hi`` (int32 ``[Tq]``), rows of the K/V buffer
    sorted by global position (built by the Flint plan); ``window`` is then the window the table was
    built with, a hint (0: none) that picks the Hopper backward kernels which skip the work a window
    leaves out. The results do not depend on it.
    """

    cu_seqlens: Optional[Tensor] = None
    window: int = 0
    row_lo: Optional[Tensor] = None
    row_hi: Optional[Tensor] = None

    def kwargs(self) -> dict:
        """The mask's fields as keyword arguments of the native entry points."""
        if self.cu_seqlens is not None:
            return {"cu_seqlens": dl_named("cu_seqlens", self.cu_seqlens), "window": self.window}
        return {"row_lo": dl(self.row_lo), "row_hi": dl(self.row_hi), "window": self.window}


def _doc_mask(cu_seqlens: Tensor, window: int, _new=object.__new__) -> AttnMask:
    """``AttnMask(cu_seqlens=cu_seqlens, window=window)`` without the frozen dataclass's per-field
    ``object.__setattr__`` (0.3 us against 0.95 on ``sink_attention``'s host path): the same object,
    its fields in its ``__dict__`` (tests/test_sink_attention.py compares the two)."""
    m = _new(AttnMask)
    d = m.__dict__
    d["cu_seqlens"], d["window"], d["row_lo"], d["row_hi"] = cu_seqlens, window, None, None
    return m


# NCP_DETERMINISTIC is read at every backward (a change at run time takes effect). os.environ.get
# of an absent name costs 0.9 us (a KeyError inside); the mapping's own dict of encoded names,
# which os.environ updates on every set and delete, answers in 0.05 us. Where os.environ has no such
# dict (another Python), the plain lookup.
try:
    _ENV_DATA = os.environ._data
    _DET_KEY, _DET_ON = os.environ.encodekey("NCP_DETERMINISTIC"), os.environ.encodevalue("1")
except AttributeError:  # pragma: no cover - CPython's os._Environ has all three
    _ENV_DATA = None


def backward_is_deterministic() -> bool:
    """Whether the next backward must be bitwise repeatable: ``torch.use_deterministic_algorithms(True)``
    or ``NCP_DETERMINISTIC=1``. Otherwise the Hopper backward accumulates dq with atomic
    reductions (5 MMAs per tile instead of 7), so the last bits of dq may differ between runs; dk,
    dv and dsink are repeatable either way, and every other path is deterministic."""
    if torch.are_deterministic_algorithms_enabled():
        return True
    if _ENV_DATA is not None and getattr(os.environ, "_data", None) is _ENV_DATA:  # os.environ not swapped out
        return _ENV_DATA.get(_DET_KEY) == _DET_ON
    return os.environ.get("NCP_DETERMINISTIC", "") == "1"


# ------------------------------------------------------------------------------------------
# native calls (eager) and the custom ops around them (torch.compile)
# ------------------------------------------------------------------------------------------


_F32 = torch.float32
# The native calls read the tensors through the DLPack C exchange API where torch publishes it
# (``_ops.EXCHANGE``): no capsule per tensor, no keyword parsing, the current stream from torch in C
# (_C.sink_attn_fwd_x / _bwd_x). Older torch, tensor subclasses and tensors torch will not export
# (meta) take the capsule calls, whose errors name the argument.
_X = EXCHANGE


def _fwd(q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], scale: float, mask: AttnMask) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_F32)
    if q.shape[0] == 0:  # no query rows: nothing to compute (empty tensors carry NULL data pointers)
        return out, lse
    cu = mask.cu_seqlens
    if _X and _C.sink_attn_fwd_x(q, k, v, out, lse, sink, cu, mask.row_lo, mask.row_hi, scale, mask.window) is None:
        return out, lse
    stream = stream_of(q.device)
    try:  # capsules made inline (the dict of ``capsules`` and a ** call cost host time before the launch)
        if cu is not None:  # documents (sink_attention): only the keywords it needs (each one costs C parsing)
            _C.sink_attn_fwd(q=to_dlpack(q), k=to_dlpack(k), v=to_dlpack(v),
                             sink=None if sink is None else to_dlpack(sink), out=to_dlpack(out), lse=to_dlpack(lse),
                             scale=scale, stream=stream, cu_seqlens=to_dlpack(cu), window=mask.window)  # fmt: skip
        else:  # a table (the Flint step)
            lo, hi = mask.row_lo, mask.row_hi
            _C.sink_attn_fwd(q=to_dlpack(q), k=to_dlpack(k), v=to_dlpack(v),
                             sink=None if sink is None else to_dlpack(sink), out=to_dlpack(out), lse=to_dlpack(lse),
                             scale=scale, stream=stream, row_lo=None if lo is None else to_dlpack(lo),
                             row_hi=None if hi is None else to_dlpack(hi), window=mask.window)  # fmt: skip
    except BufferError:  # which argument DLPack refused (meta tensors), with its name
        capsules({"q": q, "k": k, "v": v, "sink": sink, "out": out, "lse": lse, "cu_seqlens": cu,
                  "row_lo": mask.row_lo, "row_hi": mask.row_hi})  # fmt: skip
        raise
    return out, lse


def _bwd(dout, q, k, v, sink, out, lse, scale: float, mask: AttnMask):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsink = torch.empty_like(sink) if sink is not None else None
    if q.shape[0] == 0:  # no query rows: every gradient is zero
        return dq, dk.zero_(), dv.zero_(), (dsink.zero_() if dsink is not None else None)
    det = int(backward_is_deterministic())
    ws = None
    if q.device.type == "cuda":
        key = (q.shape[0], k.shape[0], q.shape[1], q.shape[2], sink is not None, det, q.device.index or 0, mask.window)
        nbytes = _ws_bytes.get(key)
        if nbytes is None:
            nbytes = _C.sink_attn_bwd_workspace(Tq=key[0], Tk=key[1], Hq=key[2], D=key[3], has_sink=int(key[4]),
                                                deterministic=det, device=key[6], window=key[7])  # fmt: skip
            if len(_ws_bytes) >= 256:  # shapes vary per step in some recipes: keep the cache bounded
                _ws_bytes.clear()
            _ws_bytes[key] = nbytes
        ws = torch.empty(((nbytes + 3) // 4,), dtype=torch.float32, device=q.device)
    dout, cu, lo, hi = dout.contiguous(), mask.cu_seqlens, mask.row_lo, mask.row_hi
    if _X and _C.sink_attn_bwd_x(q, k, v, out, lse, dout, dq, dk, dv, sink, dsink, ws, cu, lo, hi, scale, mask.window,
                                 det) is None:  # fmt: skip
        return dq, dk, dv, dsink
    stream = stream_of(q.device)
    try:  # capsules made inline, as in _fwd (a dict of them and a ** call cost host time per call)
        _C.sink_attn_bwd(q=to_dlpack(q), k=to_dlpack(k), v=to_dlpack(v), out=to_dlpack(out), lse=to_dlpack(lse),
                         dout=to_dlpack(dout), dq=to_dlpack(dq), dk=to_dlpack(dk), dv=to_dlpack(dv),
                         sink=None if sink is None else to_dlpack(sink),
                         dsink=None if dsink is None else to_dlpack(dsink),
                         workspace=None if ws is None else to_dlpack(ws), scale=scale, deterministic=det, stream=stream,
                         cu_seqlens=None if cu is None else to_dlpack(cu), row_lo=None if lo is None else to_dlpack(lo),
                         row_hi=None if hi is None else to_dlpack(hi), window=mask.window)  # fmt: skip
    except BufferError:  # which argument DLPack refused (meta tensors), with its name
        capsules({"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "dq": dq, "dk": dk, "dv": dv,
                  "sink": sink, "dsink": dsink, "workspace": ws, "cu_seqlens": cu, "row_lo": lo, "row_hi": hi})
        raise
    return dq, dk, dv, dsink


_ws_bytes: dict = {}  # (Tq, Tk, Hq, D, has_sink, deterministic, device, window) -> _C.sink_attn_bwd_workspace bytes


@torch.library.custom_op("nemo_cp_native::sink_attn_fwd", mutates_args=())
def _sink_attn_fwd_op(
    q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], scale: float, cu_seqlens: Optional[Tensor], window: int,
    row_lo: Optional[Tensor], row_hi: Optional[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _fwd(q, k, v, sink, scale, AttnMask(cu_seqlens, window, row_lo, row_hi))


@_sink_attn_fwd_op.register_fake
def _(q, k, v, sink, scale, cu_seqlens, window, row_lo, row_hi):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("nemo_cp_native::sink_attn_bwd", mutates_args=())
def _sink_attn_bwd_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], out: Tensor, lse: Tensor, scale: float,
    cu_seqlens: Optional[Tensor], window: int, row_lo: Optional[Tensor], row_hi: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    dq, dk, dv, dsink = _bwd(dout, q, k, v, sink, out, lse, scale, AttnMask(cu_seqlens, window, row_lo, row_hi))
    return dq, dk, dv, (dsink if dsink is not None else q.new_zeros((0,), dtype=torch.float32))


@_sink_attn_bwd_op.register_fake
def _(dout, q, k, v, sink, out, lse, scale, cu_seqlens, window, row_lo, row_hi):
    dsink = torch.empty_like(sink) if sink is not None else q.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def attn_forward(q, k, v, sink, mask: AttnMask, scale: float) -> tuple[Tensor, Tensor]:
    """Forward of the native op (no autograd): ``(out, lse)``."""
    if torch.compiler.is_compiling():
        return _sink_attn_fwd_op(q, k, v, sink, scale, mask.cu_seqlens, mask.window, mask.row_lo, mask.row_hi)
    return _fwd(q, k, v, sink, scale, mask)


def attn_backward(dout, q, k, v, sink, out, lse, mask: AttnMask, scale: float):
    """Backward of the native op: ``(dq, dk, dv, dsink or None)``; see ``backward_is_deterministic``."""
    if torch.compiler.is_compiling():
        dq, dk, dv, dsink = _sink_attn_bwd_op(dout, q, k, v, sink, out, lse, scale, mask.cu_seqlens, mask.window,
                                              mask.row_lo, mask.row_hi)  # fmt: skip
        return dq, dk, dv, (dsink if sink is not None else None)
    return _bwd(dout, q, k, v, sink, out, lse, scale, mask)


class SinkAttnFunc(torch.autograd.Function):
    """Autograd over the native forward/backward ops; the mask rides on ctx.

    ``launched``: the ``(out, lse)`` of a forward the caller already launched on these inputs
    (``sink_attn_autograd``), so the node's bookkeeping runs while the kernel does; None: the
    forward runs here."""

    @staticmethod
    def forward(ctx, q, k, v, sink, mask: AttnMask, scale: float, launched: Optional[tuple] = None):
        out, lse = attn_forward(q, k, v, sink, mask, scale) if launched is None else launched
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.mask, ctx.scale = mask, scale
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled dlse for the non-differentiable lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # only lse was used: nothing flows back
            return None, None, None, None, None, None, None
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = attn_backward(dout, q, k, v, sink, out, lse, ctx.mask, ctx.scale)
        return dq, dk, dv, dsink, None, None, None


class _SinkAttnOutFunc(torch.autograd.Function):
    """``SinkAttnFunc`` for callers that do not return lse (``sink_attention`` without
    ``return_lse``, the Flint step at cp = 1): out is its one output and lse a saved intermediate,
    so there is no non-differentiable output to mark and wrap (about 0.5 us less host time a call on
    the development machine). The forward ran before (``launched``), as in ``sink_attn_autograd``."""

    @staticmethod
    def forward(ctx, q, k, v, sink, mask: AttnMask, scale: float, launched: tuple):
        out, lse = launched
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = attn_backward(dout, q, k, v, sink, out, lse, ctx.mask, ctx.scale)
        return dq, dk, dv, dsink, None, None, None


def sink_attn_out(q, k, v, sink, mask: AttnMask, scale: float) -> Tensor:
    """``sink_attn_autograd(...)[0]`` with a node of one output (``_SinkAttnOutFunc``)."""
    if torch.compiler.is_compiling():
        return SinkAttnFunc.apply(q, k, v, sink, mask, scale)[0]
    return _SinkAttnOutFunc.apply(q, k, v, sink, mask, scale, _fwd(q, k, v, sink, scale, mask))


def sink_attn_autograd(q, k, v, sink, mask: AttnMask, scale: float) -> tuple[Tensor, Tensor]:
    """``SinkAttnFunc.apply`` with the kernel launched first: in eager mode the native forward is
    called before the autograd node is built (a Python ``Function.apply`` costs tens of
    microseconds of host time before its ``forward`` runs), so on an idle GPU the kernel starts
    that much sooner and the node's bookkeeping overlaps it. Same outputs, same graph."""
    if torch.compiler.is_compiling():
        return SinkAttnFunc.apply(q, k, v, sink, mask, scale)
    return SinkAttnFunc.apply(q, k, v, sink, mask, scale, _fwd(q, k, v, sink, scale, mask))


# ------------------------------------------------------------------------------------------
# public op
# ------------------------------------------------------------------------------------------


def _check_types(q, k, v, sink, cu_seqlens, window, scale) -> None:
    """What C cannot check: argument types (and so Python ints and floats that C would coerce)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if sink is not None and not isinstance(sink, Tensor):
        raise TypeError(f"sink must be a torch.Tensor or None, got {type(sink).__name__}")
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < 2**31:
        raise ValueError(f"window must be an int in [0, 2^31) (0 = full causal); got {window!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None; got {type(scale).__name__}")


def check_cu_seqlens(cu_seqlens: Tensor, total: int) -> None:
    """Host check of document boundaries: int32, starts at 0, non-decreasing, ends at ``total``.
    On a CUDA tensor this copies it to the host (one device-to-host sync)."""
    cu = cu_seqlens.detach()
    if cu.device.type == "meta":
        raise ValueError("cu_seqlens is a meta tensor; sink_attention needs real data")
    if cu.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError("validate=True copies cu_seqlens to the host, which CUDA-graph capture forbids; check the "
                         "table before the capture (check_cu_seqlens) and capture with validate=None or False")
    cu = cu.cpu() if cu.device.type != "cpu" else cu
    if cu.dtype != torch.int32 or cu.ndim != 1:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor; got {cu.ndim}-D {cu.dtype}")
    _C.sink_attn_check_mask(Tq=int(total), Tk=int(total), cu_seqlens=dl(cu.contiguous()))


def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sink: Optional[Tensor],
    cu_seqlens: Tensor,
    *,
    window: int = 0,
    scale: Optional[float] = None,
    return_lse: bool = False,
    validate: Optional[bool] = None,
):
    """Learned-sink attention over packed documents (THD), differentiable.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: query head h uses kv
            head ``h // (Hq // Hkv)``). CUDA: bf16/fp16, D in {64, 128}; CPU: also fp32/fp64.
        sink: fp32 ``[Hq]`` learned logits (an extra softmax term with a zero value), or None.
        cu_seqlens: int32 ``[documents + 1]`` boundaries, from 0 to T, on the device of q.
        window: keys a query sees counting itself; 0 = the whole causal document.
        scale: score scale, default ``D ** -0.5`` (the sink is not scaled).
        return_lse: also return the fp32 ``[Hq, T]`` log-sum-exp (sink included).
        validate: True: check ``cu_seqlens`` on the host before the call (one device-to-host sync
            on CUDA). None (default) or False: no such check and no sync; the CPU path always
            checks its (host) table, and the CUDA kernels never read or write out of bounds
            whatever ``cu_seqlens`` holds, but a table that is not a valid boundary list gives
            unspecified values there.

    Returns:
        ``out`` ``[T, Hq, D]`` in q's dtype, or ``(out, lse)``. Gradients flow to q, k, v and
        sink (fp32). The backward is bitwise repeatable except dq on the Hopper kernels, which
        accumulate it with atomics unless ``torch.use_deterministic_algorithms(True)`` or
        ``NCP_DETERMINISTIC=1`` (see ``backward_is_deterministic``).
    """
    _check_types(q, k, v, sink, cu_seqlens, window, scale)
    if validate:
        check_cu_seqlens(cu_seqlens, q.shape[0] if q.ndim == 3 else 0)
    D = q.shape[-1] if q.ndim == 3 else 0
    scale = float((D**-0.5 if D > 0 else 1.0) if scale is None else scale)
    if q.ndim == 3 and q.stride(-1) != 1:
        q = q.contiguous()
    if k.ndim == 3 and k.stride(-1) != 1:
        k = k.contiguous()
    if v.ndim == 3 and v.stride(-1) != 1:
        v = v.contiguous()
    mask = _doc_mask(cu_seqlens, window)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sink is not None and sink.requires_grad)):  # fmt: skip
        if not return_lse:
            return sink_attn_out(q, k, v, sink, mask, scale)
        out, lse = sink_attn_autograd(q, k, v, sink, mask, scale)
    else:  # nothing to differentiate: no autograd node (its Python machinery is most of the host cost)
        out, lse = attn_forward(q, k, v, sink, mask, scale)
    return (out, lse) if return_lse else out
