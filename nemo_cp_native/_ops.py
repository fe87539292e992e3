"""The bridge to the native extension: DLPack capsules, streams, build facts.

Every native call passes tensors as DLPack capsules that the C side borrows for the length of
the call (``torch.utils.dlpack.to_dlpack``, which exports without a copy, a sync or a stream
hand-off) and the caller's current CUDA stream as an int; the C side launches on that stream and
nowhere else, so no producer/consumer sync is ever needed.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from . import _C

Fallback = _C.Fallback

__all__ = ["EXCHANGE", "Fallback", "build_info", "capsules", "dl", "dl_named", "has_cuda", "stream_of"]


def dl(t: torch.Tensor | None):
    """A DLPack capsule borrowing ``t`` (None stays None)."""
    if t is None:
        return None
    return to_dlpack(t)


def dl_named(name: str, t: torch.Tensor | None):
    """``dl(t)``, with a ValueError naming the argument for tensors DLPack cannot carry (meta)."""
    if t is None:
        return None
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor; nemo_cp_native needs real data on the CPU or a CUDA device")
    return to_dlpack(t)


def capsules(named: dict) -> dict:
    """``dl`` of every tensor of ``named`` (None stays None), as keyword arguments of a native call.
    One try around all of them rather than a meta check per tensor (hot host paths); when DLPack
    refuses one, ``dl_named`` says which argument it was."""
    try:
        return {key: None if t is None else to_dlpack(t) for key, t in named.items()}
    except BufferError:
        for key, t in named.items():
            dl_named(key, t)
        raise


# The DLPack C exchange API (torch >= 2.10: ``torch.Tensor.__dlpack_c_exchange_api__``): the hot
# calls (attention, the MiMo sharder) read torch.Tensor and nn.Parameter objects through it in C,
# with no capsule and no Python call per tensor, and take torch's current stream in C (their
# ``_x`` entry points). False on an older torch: the capsule calls only. Decided once, at import.
EXCHANGE = bool(_C.exchange_init((torch.Tensor, torch.nn.Parameter)))

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(device: torch.device) -> int | None:
    """The caller's current CUDA stream on ``device`` as an int, or None for the CPU."""
    if device.type != "cuda":
        return None
    if _raw_stream is not None:
        return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def has_cuda() -> bool:
    """True when the extension was compiled with its CUDA kernels."""
    return bool(_C.CUDA)


def build_info() -> dict:
    """What this build contains: CUDA on/off and the target archs."""
    return dict(_C.build_info())
