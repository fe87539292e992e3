"""Test hooks of the attention dispatcher (``_C.attn_debug``), as a context manager.

    with attn_debug(portable=True):        # the portable mma.sync kernels on any GPU
    with attn_debug(grid=5):               # the persistent Hopper forward on 5 CTAs
    with attn_debug(whole_tiles=True):     # no half tiles in the Hopper forward (same bits)
    with attn_debug(order_waves=-1):       # the Hopper backward grids in index order (0: default,
                                           # index order under a window, else longest first within
                                           # chunks of 2 waves; k > 0: longest first within k waves)

The hooks are one struct in the extension, read once per call; they are process-global, so do
not use them from several threads at once. Entering and leaving the block clears the cache of
backward workspace sizes (``attention._ws_bytes``): the portable hook changes the size a shape needs.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from .._ops import _C

__all__ = ["attn_debug", "kernels"]


@contextlib.contextmanager
def attn_debug(*, portable: Optional[bool] = None, grid: Optional[int] = None, whole_tiles: Optional[bool] = None,
               order_waves: Optional[int] = None):  # fmt: skip
    """Sets the given hooks for the block and restores the previous ones after it."""
    args = {}
    if order_waves is not None:
        args["order_waves"] = int(order_waves)
    if portable is not None:
        args["portable"] = int(bool(portable))
    if grid is not None:
        args["grid"] = int(grid)
    if whole_tiles is not None:
        args["whole_tiles"] = int(bool(whole_tiles))
    from .. import attention  # the package imports testing lazily: no cycle at import time

    prev = _C.attn_debug(**args)
    attention._ws_bytes.clear()  # the backward workspace's size depends on the kernels the hooks pick
    try:
        yield
    finally:
        _C.attn_debug(portable=prev[0], grid=prev[1], whole_tiles=prev[2], order_waves=prev[3])
        attention._ws_bytes.clear()


def kernels(deterministic: bool = False, device: int = 0, D: int = 128, window: int = 0) -> tuple[str, str]:
    """(forward, backward) kernel names the dispatcher picks for a call on ``device`` now, of head
    dim ``D`` and mask ``window`` (0: none; a table's window hint)."""
    return tuple(_C.sink_attn_kernels(deterministic=int(deterministic), device=device, D=D, window=window))
