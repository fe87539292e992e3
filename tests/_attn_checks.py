"""Checks shared by the CPU and CUDA sink-attention tests (tests/test_sink_attention*.py)."""

from __future__ import annotations

import torch

__all__ = ["check_dsink", "d_rounding_allowance", "guarded", "guards_intact"]

GUARD = 7.0  # the pattern in the padding around a poisoned buffer (exact in every float dtype)


def check_dsink(dsink, out, lse, dout, sink, ref_dsink, lp_dsink, *, name="dsink"):
    """dsink is a reduction over every query row, so it is checked in two parts.

    1. Exactly what the kernel should have summed: the closed form over the kernel's own (rounded)
       O and lse, in float64; only fp32 accumulation error is allowed.
    2. Against the float64 oracle: twice the error of a low-precision run, plus the worst-case
       effect of rounding O to its dtype on D_i = <dO_i, O_i> (|dO_i| |O_i| eps per row, weighted
       by P_sink,i). A sum of rounding errors is a random walk, so the factor-2 rule alone would
       flake.
    """
    p_sink = torch.exp(sink.double()[:, None] - lse.double())  # [Hq, T]
    terms = p_sink * (dout.double() * out.double()).sum(-1).T
    own = -terms.sum(1)
    scale = (p_sink * (dout.double() * out.double()).abs().sum(-1).T).sum(1)
    assert torch.all((dsink.double() - own).abs() <= 1e-5 * scale + 1e-6), f"{name}: not the closed form of its O/lse"
    eps = torch.finfo(out.dtype).eps
    bound = 2 * (lp_dsink.double() - ref_dsink).abs() + eps * scale + 1e-5
    err = (dsink.double() - ref_dsink).abs()
    assert torch.all(err <= bound), f"{name}: |dsink - ref| {err.tolist()} over {bound.tolist()}"


def d_rounding_allowance(ref_fn, leaves, dout, dtype):
    """Per-element allowance (float64 dq, dk, dv, ...) for rounding O in D_i = <dO_i, O_i>.

    Flash kernels (and spec 5.7) take D from the stored, rounded O; autograd through a
    low-precision reference does not. Where one key takes almost all of a row's weight (the first
    token of a document, say), dS_ij = P_ij (dP_ij - D_i) cancels and that rounding is the whole
    error of the row's dq (and of its key's dk), with nothing to average it out. Rounding O to
    ``dtype`` moves D_i by at most e_i = u sum_d |dO_id O_id| (u the unit roundoff); since
    d lse_i / d s_ij = P_ij, moving every D_i by e_i changes the gradients by minus the gradient of
    sum_i e_i lse_i, whose magnitude is returned (for dq exactly the worst case per element; for dk
    the rows' worst cases summed with one sign).

    ``ref_fn(*leaves64) -> (out [T, Hq, D], lse [Hq, T])``.
    """
    ls = [t.detach().double().requires_grad_() for t in leaves]
    out, lse = ref_fn(*ls)
    u = torch.finfo(dtype).eps / 2
    e = (u * (dout.double() * out.detach()).abs().sum(-1)).T  # [Hq, T]
    finite = torch.isfinite(lse)
    shift = (e * torch.where(finite, lse, torch.zeros_like(lse))).sum()
    grads = torch.autograd.grad(shift, ls, allow_unused=True)  # v does not move lse
    return [torch.zeros_like(t) if g is None else g.abs() for g, t in zip(grads, ls)]


def guarded(shape, dtype, fill, device="cpu", pad=1024):
    """``(buffer, view, pad)``: a tensor view of ``shape`` filled with ``fill`` (NaN to poison it)
    inside a larger flat buffer whose ``pad`` head and tail elements hold ``GUARD``."""
    n = 1
    for s in shape:
        n *= int(s)
    buf = torch.full((n + 2 * pad,), GUARD, dtype=torch.float32, device=device).to(dtype)
    buf[pad : pad + n] = fill
    return buf, buf[pad : pad + n].view(tuple(shape)), pad


def guards_intact(buf, pad) -> bool:
    """True when the head and tail padding of a ``guarded`` buffer still hold ``GUARD``."""
    return bool((buf[:pad] == GUARD).all()) and bool((buf[-pad:] == GUARD).all())
