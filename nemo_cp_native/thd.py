"""``thd_partition_indices``: Transformer Engine's DualChunkSwap partition, native."""

from __future__ import annotations

import operator

import torch

from ._ops import _C, dl, stream_of

__all__ = ["thd_partition_indices"]

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1


def _as_int(value, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def thd_partition_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int, *, validate: bool = True
) -> torch.Tensor:
    """Global token indices owned by ``cp_rank`` under DualChunkSwap, bit-identical to
    ``transformer_engine_torch.thd_get_partitioned_indices``.

    Args:
        cu_seqlens: int32 ``[documents + 1]`` boundaries of the packed stream, on the CPU or a GPU.
        total_tokens: stream length; positive and divisible by ``2 * cp_size``.
        cp_size: context-parallel world size (> 0).
        cp_rank: this rank, in ``[0, cp_size)``.
        validate: check on the host that ``cu_seqlens`` starts at >= 0, never decreases, ends at
            or before ``total_tokens`` and that every document length is divisible by
            ``2 * cp_size`` (TE would silently mis-partition, or return indices past
            ``total_tokens``). For a CUDA ``cu_seqlens`` this costs one device-to-host copy; pass
            False for TE's exact behaviour on any input and no sync.

    Returns:
        int32 ``[total_tokens / cp_size]`` on the device of ``cu_seqlens`` (TE allocates on the
        current CUDA device instead; we do not copy that trap). Slots past ``cu_seqlens[-1]``
        follow TE exactly (they continue the last document's tail chunk).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.ndim != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor; got {cu_seqlens.ndim}-D {cu_seqlens.dtype}"
        )
    if cu_seqlens.device.type not in ("cpu", "cuda"):
        raise ValueError(f"cu_seqlens must be on the CPU or a CUDA device; got device '{cu_seqlens.device}'")
    total_tokens = _as_int(total_tokens, "total_tokens")
    cp_size = _as_int(cp_size, "cp_size")
    cp_rank = _as_int(cp_rank, "cp_rank")
    if cp_size <= 0:
        raise ValueError(f"cp_size must be > 0; got {cp_size}")
    if cp_size > _INT32_MAX:
        raise ValueError(f"cp_size must fit in int32 (<= {_INT32_MAX}); got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}); got {cp_rank}")
    if total_tokens <= 0 or total_tokens % (2 * cp_size):
        raise ValueError(
            f"total_tokens must be positive and divisible by 2 * cp_size ({2 * cp_size}); got {total_tokens}"
        )
    if total_tokens > _INT64_MAX or total_tokens // cp_size > _INT32_MAX:  # before allocating: TE's output is int32
        raise ValueError(f"total_tokens / cp_size must fit in int32; got {total_tokens // cp_size}")
    cu = cu_seqlens.contiguous()
    if validate:
        host = cu if cu.device.type == "cpu" else cu.cpu()
        _C.thd_partition_validate(dl(host), cp_size)
        last = int(host[-1])
        if last > total_tokens:
            raise ValueError(
                f"cu_seqlens[-1] must be <= total_tokens ({total_tokens}); got {last} "
                "(validate=False gives TE's indices past total_tokens)"
            )
    out = torch.empty(total_tokens // cp_size, dtype=torch.int32, device=cu.device)
    _C.thd_partition(dl(cu), dl(out), total_tokens, cp_size, cp_rank, stream_of(cu.device))
    return out
