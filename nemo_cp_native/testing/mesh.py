"""A one-process stand-in for a 1-D CP DeviceMesh (benchmarks and the sanitizer run without
torch.distributed): size/rank plus a patched torch.distributed.get_rank for its group."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _Mesh:
    mesh_dim_names = ("cp",)

    def __init__(self, size, rank):
        self._group = _Group(size, rank)

    def size(self, mesh_dim=None):
        return self._group.size()

    def get_group(self, mesh_dim=None):
        return self._group

    def get_local_rank(self, mesh_dim=None):
        return self._group.rank()


@contextlib.contextmanager
def fake_mesh(size: int, rank: int):
    """Yields a mesh (None for size 1) with torch.distributed answering for its group."""
    if size <= 1:
        yield None
        return
    mesh = _Mesh(size, rank)
    saved = dist.is_available, dist.is_initialized, dist.get_rank
    dist.is_available, dist.is_initialized = (lambda: True), (lambda: True)
    dist.get_rank = lambda group=None: group.rank() if isinstance(group, _Group) else mesh.get_local_rank()
    try:
        yield mesh
    finally:
        dist.is_available, dist.is_initialized, dist.get_rank = saved
