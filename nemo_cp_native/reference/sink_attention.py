"""Learned-sink attention over packed documents, in float64, plain and obviously right (the oracle).

Written from the behavioural spec ``flint_magi.md`` §5, not from any kernel. For query row ``i``
and query head ``h`` (kv head ``g = h // (Hq // Hkv)``, contiguous GQA groups):

    V(i)   = { j : q_lo[i] <= k_pos[j] <= q_pos[i] }           (general, position-based form)
    z_ij   = scale * <q_i^h, k_j^g>                              (scale defaults to D**-0.5)
    lse_i  = log( exp(a_h) + sum_{j in V(i)} exp(z_ij) )         (the sink a_h is NOT scaled)
    O_i    = sum_{j in V(i)} exp(z_ij - lse_i) * v_j^g           (the sink's value vector is zero)

A row that sees no key gets ``O = 0`` and ``lse = a_h``; without a sink it gets ``O = 0`` and
``lse = -inf`` (never NaN, spec §5.6). Gradients, including the one of the sink, come from torch
autograd through these functions; ``sink_grad_closed_form`` is the closed form of spec §5.4 for
cross-checks.

``attention_ref`` is the packed-document (THD varlen) form: ``cu_seqlens`` holds document
boundaries, query ``p`` sees keys of its own document with ``key <= p`` and, when ``window > 0``,
``p - key < window`` (the window counts the current token). It is ``attention_positions_ref`` with
``q_pos = k_pos = arange(T)`` and ``q_lo = max(doc_start, p - window + 1)``.

``attention_table_ref`` is the table form the CP kernels take: query ``i`` sees the key rows
``[row_lo[i], row_hi[i]]``; it is ``attention_positions_ref`` with ``k_pos = arange(Tk)``,
``q_lo = row_lo`` and ``q_pos = row_hi``.

``upcast=True`` computes everything in float64 (the reference). ``upcast=False`` mimics a naive
low-precision reference step by step (FlashAttention's ``attention_ref(..., upcast=False)``):
QK^T in the input dtype, softmax statistics in float32, P rounded to the input dtype before P@V in
the input dtype. Its error against the float64 reference sets the tolerance of kernel tests
(``nemo_cp_native.reference.tolerance``).
"""

from __future__ import annotations

import torch

__all__ = [
    "attention_positions_ref",
    "attention_table_ref",
    "attention_ref",
    "document_starts",
    "sink_grad_closed_form",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be 3-D THD tensors; got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    if k.shape[2] != d:
        raise ValueError(f"k must have head dim {d}; got shape {tuple(k.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq ({hq}) must be a positive multiple of Hkv ({hkv})")
    if sink is not None and tuple(sink.shape) != (hq,):
        raise ValueError(f"sink must have shape ({hq},); got {tuple(sink.shape)}")


def attention_positions_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    q_pos: torch.Tensor,
    q_lo: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sink attention where query ``i`` sees key ``j`` iff ``q_lo[i] <= k_pos[j] <= q_pos[i]``.

    q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` (Tq and Tk may differ), sink ``[Hq]`` or None,
    q_pos/q_lo ``[Tq]`` and k_pos ``[Tk]`` integer tensors (global stream positions; a query with
    ``q_lo > q_pos`` sees nothing). Returns ``(out [Tq, Hq, D], lse [Hq, Tq])``: float64 with
    ``upcast=True``; with ``upcast=False`` out has q's dtype and lse is float32 (float64 inputs
    stay float64). Differentiable wrt q, k, v and sink.
    """
    _check_qkv(q, k, v, sink)
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    if q_pos.shape != (tq,) or q_lo.shape != (tq,) or k_pos.shape != (tk,):
        raise ValueError(
            f"q_pos/q_lo must have shape ({tq},) and k_pos ({tk},); got "
            f"{tuple(q_pos.shape)}, {tuple(q_lo.shape)}, {tuple(k_pos.shape)}"
        )
    scale = d**-0.5 if scale is None else float(scale)
    group = hq // hkv

    # mask[i, j]: query i sees key j.
    qp, ql, kp = (t.to(q.device).long() for t in (q_pos, q_lo, k_pos))
    mask = (kp[None, :] >= ql[:, None]) & (kp[None, :] <= qp[:, None])  # [Tq, Tk]
    empty = ~mask.any(dim=1)  # [Tq] rows that see no key

    if upcast:
        cdt = sdt = torch.float64
    else:
        cdt = q.dtype
        sdt = torch.float32 if q.dtype in _LOW_PRECISION else q.dtype
    qc, kc, vc = q.to(cdt), k.to(cdt), v.to(cdt)
    kc = kc.repeat_interleave(group, dim=1)  # [Tk, Hq, D]: query head h uses kv head h // group
    vc = vc.repeat_interleave(group, dim=1)

    if sink is None:
        # Without a sink an empty row would be 0/0. Let it "see" every key for the arithmetic
        # (finite values, no NaN in forward or backward) and overwrite its result afterwards.
        mask = mask | empty[:, None]
    scores = torch.einsum("qhd,khd->hqk", qc, kc).to(sdt) * scale  # [Hq, Tq, Tk]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sink is not None:
        sink_col = sink.to(sdt)[:, None, None].expand(hq, tq, 1)
        lse = torch.logsumexp(torch.cat([scores, sink_col], dim=-1), dim=-1)  # [Hq, Tq]
    else:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])  # masked keys: exp(-inf) = 0
    out = torch.einsum("hqk,khd->qhd", probs.to(cdt), vc)  # [Tq, Hq, D]

    if sink is None:
        out = torch.where(empty[:, None, None], torch.zeros((), dtype=out.dtype), out)
        lse = torch.where(empty[None, :], torch.full((), float("-inf"), dtype=lse.dtype), lse)
    return out, lse


def attention_table_ref(q, k, v, sink, row_lo, row_hi, *, scale=None, upcast=True):
    """Sink attention where query ``i`` sees the key rows ``[row_lo[i], row_hi[i]]`` (none when
    ``row_lo[i] > row_hi[i]``). Same arguments and results as ``attention_positions_ref``."""
    k_pos = torch.arange(k.shape[0], device=row_lo.device)
    return attention_positions_ref(q, k, v, sink, row_hi, row_lo, k_pos, scale=scale, upcast=upcast)


def document_starts(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Start position of each token's document, int64 ``[total]``; tokens at or past
    ``cu_seqlens[-1]`` belong to no document and get ``-1``."""
    cu = _check_cu_seqlens(cu_seqlens, total)
    pos = torch.arange(total, dtype=torch.int64)
    doc = torch.searchsorted(cu, pos, right=True) - 1  # last boundary <= pos
    starts = cu[doc.clamp(max=cu.numel() - 1)]
    return torch.where(pos < cu[-1], starts, torch.full_like(starts, -1))


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be a non-empty 1-D tensor; got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer tensor; got {cu_seqlens.dtype}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu[0] != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at most at T={total}; got {cu.tolist()}"
        )
    return cu


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    *,
    window: int = 0,
    scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-device varlen (THD) sink attention: per-document causal, optional sliding window.

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, sink fp32 ``[Hq]`` or None, ``cu_seqlens`` int
    ``[docs + 1]`` from 0 to ``T`` (zero-length documents are fine). Query ``p`` sees key ``j`` iff
    both lie in the same document, ``j <= p``, and (``window == 0`` or ``p - j < window``).
    Extension: if ``cu_seqlens[-1] < T`` the trailing tokens belong to no document (tail pads):
    they see nothing and nobody sees them. Returns ``(out [T, Hq, D], lse [Hq, T])``.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = unbounded); got {window}")
    total = q.shape[0]
    if k.shape[0] != total:
        raise ValueError(f"q and k must have the same number of tokens; got {total} and {k.shape[0]}")
    starts = document_starts(cu_seqlens, total)
    pos = torch.arange(total, dtype=torch.int64)
    q_lo = torch.where(starts >= 0, starts, pos + 1)  # pads: q_lo > q_pos, empty row
    if window > 0:
        q_lo = torch.maximum(q_lo, pos - window + 1)
    # Pad keys are never seen: a real query's range [q_lo, p] ends at p < cu[-1] <= any pad key.
    return attention_positions_ref(q, k, v, sink, pos, q_lo, pos, scale=scale, upcast=upcast)


def sink_grad_closed_form(
    out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor
) -> torch.Tensor:
    """``dsink_h = -sum_q exp(sink_h - lse[h, q]) * <dO_q^h, O_q^h>`` (spec §5.4), float64 ``[Hq]``.

    out/dout ``[T, Hq, D]`` (O is the FINAL, sink-including output), lse ``[Hq, T]`` (the FINAL,
    sink-including lse). A row that sees no key has ``O = 0`` and contributes exactly 0.
    Restricting the rows restricts the sum (a CP rank's partial dsink).
    """
    delta = (dout.double() * out.double()).sum(dim=-1)  # [T, Hq]
    p_sink = torch.exp(sink.double()[:, None] - lse.double())  # [Hq, T]
    return -(p_sink * delta.transpose(0, 1)).sum(dim=1)

