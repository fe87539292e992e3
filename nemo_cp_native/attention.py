"""Learned-sink varlen attention: ``sink_attention`` and the custom ops under it.

Layering (FlashAttention's): ``torch.library.custom_op`` wraps each native entry point and has a
fake (meta) implementation for ``torch.compile``; ``SinkAttnFunc`` (autograd) saves
``(q, k, v, out, lse, sink)`` and calls the backward op; ``sink_attention`` validates and wraps.

Math (per query i, head h, kv head h // (Hq / Hkv), sink logit a_h, never scaled):
    lse_i = log(exp(a_h) + sum_{j visible} exp(scale <q_i, k_j>))
    out_i = sum_j exp(scale <q_i, k_j> - lse_i) v_j         (the sink has a zero value vector)
Visible: same document, key <= query, and query - key < window when window > 0 (the window
counts the current token). A row that sees nothing gets out = 0 and lse = a_h.
"""

from __future__ import annotations

from dataclasses import dataclass
import os
from typing import Optional

import torch
from torch import Tensor

from ._ops import _C, dl, stream_of

__all__ = ["AttnMask", "SinkAttnFunc", "sink_attention"]


@dataclass(frozen=True)
class AttnMask:
    """Which keys each query sees.

    Contiguous THD mode: ``cu_seqlens`` (int32 document boundaries) and ``window``; query i and
    key j sit at stream position i and j.
    Positions mode (context parallelism): query i sees key j iff
    ``q_lo[i] <= k_pos[j] <= q_pos[i]`` (int32, ``k_pos`` non-decreasing), and the CUDA kernels
    visit only the tiles listed in the CSR schedules built by the plan (``*_off`` / ``*_ent``).
    """

    cu_seqlens: Optional[Tensor] = None
    window: int = 0
    q_pos: Optional[Tensor] = None
    q_lo: Optional[Tensor] = None
    k_pos: Optional[Tensor] = None
    fwd_off: Optional[Tensor] = None
    fwd_ent: Optional[Tensor] = None
    dq_off: Optional[Tensor] = None
    dq_ent: Optional[Tensor] = None
    dkv_off: Optional[Tensor] = None
    dkv_ent: Optional[Tensor] = None

    def flat(self) -> tuple:
        return (self.cu_seqlens, self.window, self.q_pos, self.q_lo, self.k_pos, self.fwd_off, self.fwd_ent,
                self.dq_off, self.dq_ent, self.dkv_off, self.dkv_ent)  # fmt: skip


def _mask_capsules(flat: tuple, backward: bool) -> tuple:
    cu, window, q_pos, q_lo, k_pos, fwd_off, fwd_ent, dq_off, dq_ent, dkv_off, dkv_ent = flat
    if q_pos is None:
        return (dl(cu), int(window))
    if backward:
        return tuple(dl(t) for t in (q_pos, q_lo, k_pos, fwd_off, fwd_ent, dq_off, dq_ent, dkv_off, dkv_ent))
    return tuple(dl(t) for t in (q_pos, q_lo, k_pos, fwd_off, fwd_ent))


# ------------------------------------------------------------------------------------------
# custom ops
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("nemo_cp_native::sink_attn_fwd", mutates_args=())
def _sink_attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], scale: float,
    cu_seqlens: Optional[Tensor], window: int, q_pos: Optional[Tensor], q_lo: Optional[Tensor],
    k_pos: Optional[Tensor], fwd_off: Optional[Tensor], fwd_ent: Optional[Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if q.shape[0] == 0:  # no query rows: nothing to compute (and empty tensors carry NULL data pointers)
        return out, lse
    flat = (cu_seqlens, window, q_pos, q_lo, k_pos, fwd_off, fwd_ent, None, None, None, None)
    _C.sink_attn_fwd(dl(q), dl(k), dl(v), dl(sink), dl(out), dl(lse), float(scale), _mask_capsules(flat, False),
                     stream_of(q.device))  # fmt: skip
    return out, lse


@_sink_attn_fwd.register_fake
def _(q, k, v, sink, scale, cu_seqlens, window, q_pos, q_lo, k_pos, fwd_off, fwd_ent):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("nemo_cp_native::sink_attn_bwd", mutates_args=())
def _sink_attn_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sink: Optional[Tensor], out: Tensor, lse: Tensor, scale: float,
    cu_seqlens: Optional[Tensor], window: int, q_pos: Optional[Tensor], q_lo: Optional[Tensor],
    k_pos: Optional[Tensor], fwd_off: Optional[Tensor], fwd_ent: Optional[Tensor], dq_off: Optional[Tensor],
    dq_ent: Optional[Tensor], dkv_off: Optional[Tensor], dkv_ent: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    Hq, Tq = q.shape[1], q.shape[0]
    dsink = torch.empty_like(sink) if sink is not None else q.new_zeros((0,), dtype=torch.float32)
    if Tq == 0:  # no query rows: every gradient is zero
        return dq, dk.zero_(), dv.zero_(), dsink.zero_()
    cuda = q.device.type == "cuda"
    delta = torch.empty((Hq, Tq), dtype=torch.float32, device=q.device)
    part = None
    if cuda and sink is not None:
        part = torch.empty((Hq, _C.sink_attn_bwd_n_part(Tq)), dtype=torch.float32, device=q.device)
    flat = (cu_seqlens, window, q_pos, q_lo, k_pos, fwd_off, fwd_ent, dq_off, dq_ent, dkv_off, dkv_ent)
    det = backward_is_deterministic()
    acc = None
    if cuda and not det and q_pos is None and _C.sink_attn_bwd_variant() == 4:
        acc = torch.empty((Hq, (Tq + 63) // 64 * 64, q.shape[2]), dtype=torch.float32, device=q.device)  # zeroed there
    _C.sink_attn_bwd(
        dl(q), dl(k), dl(v), dl(sink), dl(out), dl(lse), dl(dout.contiguous()), dl(dq), dl(dk), dl(dv),
        dl(dsink if sink is not None else None), dl(delta), dl(part), float(scale), _mask_capsules(flat, True),
        int(det), stream_of(q.device), dl(acc),
    )  # fmt: skip
    return dq, dk, dv, dsink


@_sink_attn_bwd.register_fake
def _(dout, q, k, v, sink, out, lse, scale, cu_seqlens, window, q_pos, q_lo, k_pos, fwd_off, fwd_ent, dq_off,
      dq_ent, dkv_off, dkv_ent):  # fmt: skip
    dsink = torch.empty_like(sink) if sink is not None else q.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def backward_is_deterministic() -> bool:
    """Whether the next backward must be bitwise repeatable: ``torch.use_deterministic_algorithms(True)``
    or ``NCP_DETERMINISTIC=1``. Otherwise the Hopper backward (contiguous mode) accumulates dq with
    atomic reductions (5 MMAs per tile instead of 7), so the last bits of dq may differ between runs;
    dk, dv and dsink are repeatable either way, and every other path is deterministic."""
    return torch.are_deterministic_algorithms_enabled() or os.environ.get("NCP_DETERMINISTIC", "") == "1"


def attn_forward(q, k, v, sink, mask: AttnMask, scale: float) -> tuple[Tensor, Tensor]:
    """Forward of the native op (no autograd): ``(out, lse)``."""
    f = mask.flat()
    return _sink_attn_fwd(q, k, v, sink, scale, *f[:7])


def attn_backward(dout, q, k, v, sink, out, lse, mask: AttnMask, scale: float):
    """Backward of the native op: ``(dq, dk, dv, dsink or None)``; see ``backward_is_deterministic``."""
    dq, dk, dv, dsink = _sink_attn_bwd(dout, q, k, v, sink, out, lse, scale, *mask.flat())
    return dq, dk, dv, (dsink if sink is not None else None)


class SinkAttnFunc(torch.autograd.Function):
    """Autograd over the native forward/backward ops; the mask rides on ctx."""

    @staticmethod
    def forward(ctx, q, k, v, sink, mask: AttnMask, scale: float):
        out, lse = attn_forward(q, k, v, sink, mask, scale)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.mask, ctx.scale = mask, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv, dsink = attn_backward(dout, q, k, v, sink, out, lse, ctx.mask, ctx.scale)
        return dq, dk, dv, dsink, None, None


# ------------------------------------------------------------------------------------------
# public op
# ------------------------------------------------------------------------------------------

_GPU_DTYPES = (torch.bfloat16, torch.float16)
_CPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_inputs(q, k, v, sink, cu_seqlens, window, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(f"{name} must be 3-D (tokens, heads, head_dim); got shape {tuple(t.shape)}")
    dev = q.device
    for name, t in (("k", k), ("v", v), ("sink", sink), ("cu_seqlens", cu_seqlens)):
        if isinstance(t, Tensor) and t.device != dev:
            raise ValueError(f"{name} must be on the device of q ({dev}); got {t.device}")
    allowed = _GPU_DTYPES if dev.type == "cuda" else _CPU_DTYPES
    if q.dtype not in allowed:
        raise ValueError(f"q must be one of {[str(d) for d in allowed]} on {dev.type}; got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must have the dtype of q ({q.dtype}); got {k.dtype} and {v.dtype}")
    T, Hq, D = q.shape
    if D == 0:
        raise ValueError(f"head_dim must be > 0; got q of shape {tuple(q.shape)}")
    if k.shape[2] != D or v.shape[2] != D:
        raise ValueError(f"q, k and v must share head_dim ({D}); got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != T:
        raise ValueError(f"k must have as many tokens as q ({T}); got {k.shape[0]}")
    if Hq == 0 or k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"the query heads ({Hq}) must be a positive multiple of the kv heads ({k.shape[1]})")
    if dev.type == "cuda" and D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 on CUDA; got {D}")
    if sink is not None:
        if not isinstance(sink, Tensor) or sink.shape != (Hq,):
            raise ValueError(f"sink must be a tensor of shape ({Hq},); got {getattr(sink, 'shape', sink)}")
        ok = sink.dtype == torch.float32 or (dev.type == "cpu" and q.dtype == torch.float64 and sink.dtype == q.dtype)
        if not ok:
            raise ValueError(f"sink must be float32; got {sink.dtype}")
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a non-empty 1-D int32 tensor; got {cu_seqlens.ndim}-D {cu_seqlens.dtype}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = full causal); got {window!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and float(scale) == float(scale)):
        raise ValueError(f"scale must be a finite float or None; got {scale!r}")


def _check_cu_seqlens(cu_seqlens: Tensor, total: int) -> None:
    """Host check: starts at 0, non-decreasing, ends at the token count (one D2H copy on CUDA)."""
    cu = cu_seqlens.cpu() if cu_seqlens.device.type != "cpu" else cu_seqlens
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {int(cu[0])}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must end at the number of tokens ({total}); got {int(cu[-1])}")


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
    validate: bool = True,
):
    """Learned-sink attention over packed documents (THD), differentiable.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: query head h uses kv
            head ``h // (Hq // Hkv)``). CUDA: bf16/fp16, D in {64, 128}; CPU: also fp32/fp64.
        sink: fp32 ``[Hq]`` learned logits (an extra softmax term with a zero value), or None.
        cu_seqlens: int32 ``[documents + 1]`` boundaries, from 0 to T.
        window: keys a query sees counting itself; 0 = the whole causal document.
        scale: score scale, default ``D ** -0.5`` (the sink is not scaled).
        return_lse: also return the fp32 ``[Hq, T]`` log-sum-exp (sink included).
        validate: check ``cu_seqlens`` on the host; on CUDA this is one device-to-host copy.

    Returns:
        ``out`` ``[T, Hq, D]`` in q's dtype, or ``(out, lse)``. Gradients flow to q, k, v and
        sink (fp32). The backward is bitwise repeatable except dq on the Hopper kernels, which
        accumulate it with atomics unless ``torch.use_deterministic_algorithms(True)`` or
        ``NCP_DETERMINISTIC=1`` (see ``backward_is_deterministic``).
    """
    _check_inputs(q, k, v, sink, cu_seqlens, window, scale)
    if validate or q.device.type == "cpu":
        _check_cu_seqlens(cu_seqlens, q.shape[0])
    scale = float(q.shape[2] ** -0.5 if scale is None else scale)
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    mask = AttnMask(cu_seqlens=cu_seqlens.contiguous(), window=int(window))
    out, lse = SinkAttnFunc.apply(q, k, v, sink, mask, scale)
    return (out, lse) if return_lse else out
