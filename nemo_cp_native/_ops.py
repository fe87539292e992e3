"""The bridge to the native extension: DLPack capsules, streams, build facts.

Every native call passes tensors as DLPack capsules that the C side borrows for the length of
the call (``t.detach().__dlpack__(...)``) and the caller's current CUDA stream as an int; the C
side launches on that stream and nowhere else, so no producer/consumer sync is ever needed.
"""

from __future__ import annotations

import torch

from . import _C

Fallback = _C.Fallback

__all__ = ["Fallback", "build_info", "dl", "has_cuda", "stream_of"]


def dl(t: torch.Tensor | None):
    """A DLPack capsule borrowing ``t`` (None stays None)."""
    if t is None:
        return None
    t = t.detach()
    if t.device.type == "cuda":
        return t.__dlpack__(stream=-1)
    return t.__dlpack__()


def stream_of(device: torch.device) -> int | None:
    """The caller's current CUDA stream on ``device`` as an int, or None for the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


def has_cuda() -> bool:
    """True when the extension was compiled with its CUDA kernels."""
    return bool(_C.CUDA)


def build_info() -> dict:
    """What this build contains: CUDA on/off, target archs, kernel tile sizes."""
    return dict(_C.build_info())
