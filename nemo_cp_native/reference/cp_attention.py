"""Whole-sequence oracle for context-parallel learned-sink attention (spec ``flint_magi.md`` §2, §5.5).

Run the single-device oracle (``sink_attention.attention_ref``, float64) on the whole, unpadded
packed stream once, backpropagate a global upstream gradient ``dout``, then hand every CP rank the
rows it owns under a Magi partition (``magi.DispatchRef``), in its local (dispatched) order:

* ``out``, ``lse`` of its local queries (pad rows: out 0, lse = sink, or -inf without a sink);
* ``dq`` of its local queries and ``dk``/``dv`` of its local keys: the FULL gradient of the tokens it
  owns (contributions from every rank's queries already summed, as after the reverse exchange);
  pad rows 0;
* ``dsink``: the PARTIAL sink gradient, the closed form of spec §5.4 summed over this rank's real
  local queries only (Magi leaves the cross-rank sum to the framework). Summed over ranks it equals
  the whole-sequence dsink.

Also ``local_rows``: a global ``[T, ...]`` tensor laid out in a rank's local order with pad rows
filled, i.e. what ``dispatch`` gives a rank (use it to build the per-rank kernel inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_cp_native.reference.magi import DispatchRef
from nemo_cp_native.reference.sink_attention import attention_ref, sink_grad_closed_form

__all__ = ["CPAttentionRef", "CPRankRef", "cp_attention_ref", "local_rows"]


def local_rows(x: torch.Tensor, dispatch: DispatchRef, rank: int, fill: float = 0.0) -> torch.Tensor:
    """``x`` ``[T, ...]`` (global, unpadded) -> ``[T_pad / cp, ...]`` in ``rank``'s local order;
    rows of pad tokens (global index ``>= T``) are ``fill``. Differentiable wrt ``x``."""
    if x.shape[0] != dispatch.total_seqlen:
        raise ValueError(f"x must have {dispatch.total_seqlen} rows (T); got {x.shape[0]}")
    idx = dispatch.local_token_global_indices(rank).to(x.device)
    real = idx < dispatch.total_seqlen
    picked = x.index_select(0, idx.clamp(max=dispatch.total_seqlen - 1))
    shape = (-1,) + (1,) * (x.dim() - 1)
    return torch.where(real.reshape(shape), picked, torch.full((), fill, dtype=x.dtype, device=x.device))


@dataclass(frozen=True)
class CPRankRef:
    """What one CP rank must produce, in its local order (``[T_loc, ...]``, ``T_loc = T_pad / cp``)."""

    local_indices: torch.Tensor  # [T_loc] int64 global positions, pads >= T
    out: torch.Tensor  # [T_loc, Hq, D]
    lse: torch.Tensor  # [Hq, T_loc], sink-including
    dq: torch.Tensor  # [T_loc, Hq, D]
    dk: torch.Tensor  # [T_loc, Hkv, D], full gradient of the keys this rank owns
    dv: torch.Tensor  # [T_loc, Hkv, D]
    dsink: torch.Tensor | None  # [Hq] partial (this rank's real queries only); None without sink


@dataclass(frozen=True)
class CPAttentionRef:
    """Whole-sequence results (global order, unpadded) plus every rank's share."""

    out: torch.Tensor  # [T, Hq, D]
    lse: torch.Tensor  # [Hq, T]
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dsink: torch.Tensor | None  # [Hq] whole-sequence (autograd; float64 with upcast, else fp32)
    ranks: tuple[CPRankRef, ...]


def cp_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    dout: torch.Tensor,
    dispatch: DispatchRef,
    cp_size: int | None = None,
    *,
    window: int = 0,
    scale: float | None = None,
    upcast: bool = True,
) -> CPAttentionRef:
    """Oracle for CP sink attention under ``dispatch`` (see the module docstring).

    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, dout ``[T, Hq, D]`` global and unpadded,
    ``cu_seqlens`` ending at ``T``. ``upcast=False`` gives the naive low-precision run of the same
    computation (autograd in the input dtype) for the tolerance rule.
    """
    total = q.shape[0]
    if cp_size is not None and cp_size != dispatch.cp_size:
        raise ValueError(f"cp_size {cp_size} does not match the dispatch's {dispatch.cp_size} ranks")
    if dispatch.total_seqlen != total:
        raise ValueError(f"dispatch is for T={dispatch.total_seqlen}; q has {total} rows")
    if dout.shape != q.shape:
        raise ValueError(f"dout must have q's shape {tuple(q.shape)}; got {tuple(dout.shape)}")

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sink_dtype = torch.float64 if upcast else torch.float32  # the oracle's dsink is float64
    sink_leaf = None if sink is None else sink.detach().to(sink_dtype).clone().requires_grad_(True)
    with torch.enable_grad():
        out, lse = attention_ref(*leaves, sink_leaf, cu_seqlens, window=window, scale=scale, upcast=upcast)
        inputs = leaves + ([] if sink_leaf is None else [sink_leaf])
        grads = torch.autograd.grad(out, inputs, grad_outputs=dout.to(out.dtype))
    out, lse = out.detach(), lse.detach()
    dq, dk, dv = grads[:3]
    dsink = grads[3] if sink_leaf is not None else None

    ranks = []
    for r in range(dispatch.cp_size):
        idx = dispatch.local_token_global_indices(r).to(q.device)
        real = idx < total
        rows = idx[real]
        lse_loc = torch.empty((lse.shape[0], idx.numel()), dtype=lse.dtype, device=lse.device)
        lse_loc[:, real] = lse[:, rows]
        lse_loc[:, ~real] = float("-inf") if sink is None else sink.to(lse.dtype)[:, None]
        part = None
        if sink is not None:
            part = sink_grad_closed_form(out[rows], dout[rows], lse[:, rows], sink)
        ranks.append(
            CPRankRef(
                local_indices=idx,
                out=local_rows(out, dispatch, r),
                lse=lse_loc,
                dq=local_rows(dq, dispatch, r),
                dk=local_rows(dk, dispatch, r),
                dv=local_rows(dv, dispatch, r),
                dsink=part,
            )
        )
    return CPAttentionRef(out, lse, dq, dk, dv, dsink, tuple(ranks))
