"""Case generators for sink attention and Flint CP, shared by tests and benchmarks.

Everything draws from a ``torch.Generator`` so a failing case replays from its seed.
"""

from __future__ import annotations

import torch

from ..baselines import attention_flops, visible_pairs  # one FLOP convention, re-exported for tests

__all__ = [
    "attention_flops",
    "doc_lengths",
    "make_attention_case",
    "pack_documents",
    "visible_pairs",
]


def doc_lengths(total: int, mode: str, *, window: int = 0, generator: torch.Generator | None = None,
                mean: int = 64) -> list[int]:  # fmt: skip
    """Document lengths summing to ``total``.

    modes: ``one`` (a single document), ``random`` (uniform lengths around ``mean``), ``tiny``
    (lengths 1-3), ``window`` (lengths W-1, W, W+1, 1 and 2W around the window), ``equal:N``
    (documents of N tokens, the last one shorter if N does not divide total).
    """
    g = generator
    if total <= 0:
        return []
    if mode == "one":
        return [total]
    if mode.startswith("equal:"):
        n = int(mode.split(":")[1])
        out = [n] * (total // n)
        return out + ([total % n] if total % n else [])
    if mode == "tiny":
        choices = [1, 2, 3]
    elif mode == "window":
        w = max(window, 2)
        choices = [w - 1, w, w + 1, 1, 2 * w]
    elif mode == "random":
        choices = None
    else:
        raise ValueError(f"unknown doc mode {mode!r}")
    out, left = [], total
    while left > 0:
        if choices is None:
            n = int(torch.randint(1, 2 * mean, (1,), generator=g))
        else:
            n = choices[int(torch.randint(0, len(choices), (1,), generator=g))]
        n = min(n, left)
        out.append(n)
        left -= n
    return out


def pack_documents(lengths: list[int], device="cpu") -> torch.Tensor:
    """int32 cu_seqlens of the given document lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return cu.to(device=device, dtype=torch.int32)


def make_attention_case(lengths, num_heads: int, num_kv_heads: int, head_dim: int, *, dtype=torch.bfloat16,
                        device="cpu", sink_scale: float = 4.0, generator: torch.Generator | None = None,
                        requires_grad: bool = False) -> dict:  # fmt: skip
    """Random q/k/v [T, H, D] (normal, then cast), sink uniform in [-sink_scale, sink_scale]."""
    g = generator
    T = int(sum(lengths))

    def draw(h):
        x = torch.randn((T, h, head_dim), generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    sink = ((torch.rand(num_heads, generator=g) * 2 - 1) * sink_scale).to(device).requires_grad_(requires_grad)
    return {
        "q": draw(num_heads),
        "k": draw(num_kv_heads),
        "v": draw(num_kv_heads),
        "sink": sink,
        "cu_seqlens": pack_documents(lengths, device),
        "lengths": list(lengths),
    }
