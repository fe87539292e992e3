"""Tolerances derived from a low-precision reference, never from hand-tuned atol/rtol tables.

STYLE.md item 10. Three tensors take part in every check:

* ``out``    the result under test (kernel output, in its own dtype, e.g. bf16 or fp32);
* ``ref``    the float64 reference (``upcast=True``), computed from the same, pre-rounded inputs;
* ``ref_lp`` the same reference run naively in low precision (``upcast=False``).

``assert_close_to_ref`` (FlashAttention's rule, for float tensors such as out/dq/dk/dv):

    max|out - ref| <= 2 * max|ref_lp - ref| + 2 * rounding_noise(ref)
    rounding_noise(ref) = max|round_to(out.dtype, ref) - ref|

i.e. the kernel may be at most twice as wrong as a naive low-precision implementation, plus twice
the error that merely storing the exact answer in ``out``'s dtype would cost.

``assert_close_to_ref_ulp`` (per element, for reductions such as dsink and lse, in the spirit of
FlashAttention 4's tests): for every element

    |out - ref| <= 2 * |ref_lp - ref| + ulps * ulp(ref)

where ``ulp(x)`` is the spacing of ``out.dtype`` at ``|x|``. Why per element: dsink has one entry per
head and lse one per (head, row); their magnitudes differ by orders of magnitude, so a max-norm rule
would let small entries be wrong by the error budget of large ones. Why ``ulps = 4`` by default: the
result must be stored in ``out.dtype`` (0.5 ulp), and the last few float32 operations of a kernel
(the final ``m + log(l)`` of lse, the last add of a partial sum, a conversion) may round differently
from the naive reference (~1 ulp each); anything larger (accumulation order over many terms) must
show up in ``|ref_lp - ref|``, which accumulates in float32 too. Four keeps the rule tight enough to
catch an error of a single dropped term while not failing on exact ties of rounding.

``assert_close_to_ref(..., allowance=a)`` adds a per-element allowance ``a`` to the max-norm bound,
for an error the naive reference cannot show: attention gradients take D_i = <dO_i, O_i> from the
stored, rounded O (spec 5.7), and where one key takes almost all of a row's weight the row's dq
(and its key's dk) is nothing but that rounding; ``a`` is then the effect of the worst such
rounding, computed in float64 (tests/_attn_checks.py ``d_rounding_allowance``).

Both rules: any NaN in ``out``, ``ref`` or ``ref_lp`` fails; non-finite entries of ``ref``
(``lse = -inf`` for a row without keys and without sink) must be matched exactly by ``out``.
"""

from __future__ import annotations

import torch

__all__ = ["assert_close_to_ref", "assert_close_to_ref_ulp", "rounding_noise", "ulp"]

_PRECISION_BITS = {
    torch.float64: 53,
    torch.float32: 24,
    torch.float16: 11,
    torch.bfloat16: 8,
}


def rounding_noise(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs error of storing ``ref`` in ``dtype`` (finite entries only; 0.0 if none)."""
    r = ref.detach().double()
    fin = torch.isfinite(r)
    if not bool(fin.any()):
        return 0.0
    err = (r.to(dtype).double() - r).abs()
    return float(err[fin].max())


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at ``|x|`` (float64 tensor): ``2**(e - p + 1)`` for ``|x|`` in
    ``[2**e, 2**(e+1))``, ``p`` = precision bits; the smallest subnormal below the normal range."""
    if dtype not in _PRECISION_BITS:
        raise ValueError(f"ulp: unsupported dtype {dtype}")
    p = _PRECISION_BITS[dtype]
    a = x.detach().double().abs()
    _, exponent = torch.frexp(a)  # a = m * 2**exponent, m in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(a), (exponent - p).to(torch.int64))
    tiny = torch.finfo(dtype).tiny
    smallest = tiny * 2.0 ** (1 - p)
    return torch.where(a < tiny, torch.full_like(a, smallest), spacing)


def _prepare(out: torch.Tensor, ref: torch.Tensor, ref_lp: torch.Tensor, name: str):
    """Shape/NaN/non-finite checks shared by both rules; returns float64 copies and a mask of the
    entries the numeric rule applies to."""
    if out.shape != ref.shape or ref_lp.shape != ref.shape:
        raise AssertionError(
            f"{name}: shape mismatch: out {tuple(out.shape)}, ref {tuple(ref.shape)}, ref_lp {tuple(ref_lp.shape)}"
        )
    o, r, rl = (t.detach().cpu().double() for t in (out, ref, ref_lp))
    for label, t in (("out", o), ("ref", r), ("ref_lp", rl)):
        nan = torch.isnan(t)
        if bool(nan.any()):
            where = tuple(int(i) for i in nan.nonzero()[0])
            raise AssertionError(f"{name}: {label} has {int(nan.sum())} NaN entries, first at index {where}")
    fin = torch.isfinite(r)
    bad = ~fin & (o != r)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: ref is non-finite at {where} (ref={r[where].item()}) but out={o[where].item()}; "
            f"{int(bad.sum())} such entries"
        )
    bad_out = fin & ~torch.isfinite(o)
    if bool(bad_out.any()):
        where = tuple(int(i) for i in bad_out.nonzero()[0])
        raise AssertionError(f"{name}: out is {o[where].item()} at {where} where ref={r[where].item()}")
    return o, r, rl, fin


def _argmax_index(err: torch.Tensor) -> tuple[int, ...]:
    flat = int(err.reshape(-1).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))


def assert_close_to_ref(
    out: torch.Tensor, ref: torch.Tensor, ref_lp: torch.Tensor, *, name: str, allowance: torch.Tensor | None = None
) -> None:
    """Raise AssertionError unless ``max|out-ref| <= 2 max|ref_lp-ref| + 2 rounding_noise(ref)``
    (plus ``allowance`` per element where given, see the module docstring).

    ``rounding_noise`` is taken in ``out.dtype``. The message gives both maxima, the bound, and
    the index with the worst excess together with out/ref/ref_lp there.
    """
    o, r, rl, fin = _prepare(out, ref, ref_lp, name)
    if not bool(fin.any()):
        return
    zero = torch.zeros((), dtype=torch.float64)
    err = torch.where(fin, (o - r).abs(), zero)
    lp_err = float(torch.where(fin, (rl - r).abs(), zero).max())
    noise = rounding_noise(ref, out.dtype)
    bound = 2.0 * lp_err + 2.0 * noise
    extra = zero if allowance is None else allowance.detach().cpu().double().abs()
    excess = err - extra
    max_err = float(excess.max())
    if max_err <= bound:
        return
    at = _argmax_index(excess)
    with_extra = "" if allowance is None else f" + allowance {float(extra[at]):.6g} there"
    raise AssertionError(
        f"{name}: max|out - ref| = {float(err.max()):.6g} exceeds bound {bound:.6g} "
        f"(= 2 * max|ref_lp - ref| {lp_err:.6g} + 2 * rounding_noise[{out.dtype}] {noise:.6g}){with_extra}; "
        f"worst at index {at}: out={o[at].item():.10g} ref={r[at].item():.10g} ref_lp={rl[at].item():.10g}; "
        f"{int((excess > bound).sum())} of {err.numel()} entries over the bound"
    )


def assert_close_to_ref_ulp(
    out: torch.Tensor, ref: torch.Tensor, ref_lp: torch.Tensor, *, name: str, ulps: float = 4.0,
    magnitude_floor: float = 0.0,
) -> None:
    """Per-element rule for reductions: ``|out-ref| <= 2 |ref_lp-ref| + ulps * ulp(ref)`` with
    ``ulp`` in ``out.dtype`` (see the module docstring for the choice of ``ulps``).

    ``magnitude_floor`` takes the ulp of ``max(|ref|, floor)``: a log-sum-exp is computed as
    ``m + log(l)`` from O(1) intermediates, so near zero its rounding is an ulp of those, not of the
    (cancelled) result."""
    o, r, rl, fin = _prepare(out, ref, ref_lp, name)
    if not bool(fin.any()):
        return
    zero = torch.zeros((), dtype=torch.float64)
    err = torch.where(fin, (o - r).abs(), zero)
    mag = torch.where(fin, r.abs().clamp(min=magnitude_floor), zero)
    bound = torch.where(fin, 2.0 * (rl - r).abs() + ulps * ulp(mag, out.dtype), zero)
    over = err > bound
    if not bool(over.any()):
        return
    excess = torch.where(over, err - bound, zero)
    at = _argmax_index(excess)
    raise AssertionError(
        f"{name}: {int(over.sum())} of {err.numel()} entries exceed |out-ref| <= 2|ref_lp-ref| + "
        f"{ulps:g} ulp[{out.dtype}](ref); worst at index {at}: out={o[at].item():.10g} "
        f"ref={r[at].item():.10g} ref_lp={rl[at].item():.10g} |out-ref|={err[at].item():.6g} "
        f"bound={bound[at].item():.6g}"
    )
