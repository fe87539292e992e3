"""Test helpers for context-parallel meshes: a fake 1-D CP mesh, a fake process group, real gloo runs.

- ``FakeCPMesh(size, rank)``: the part of a 1-D ``DeviceMesh`` the sharders use.
- ``fake_dist(mesh_or_none)``: patch ``torch.distributed`` so that
  ``get_rank(group=mesh.get_group())`` answers the mesh's rank (``None``: "not initialized").
- ``run_distributed(fn, world_size, *args)``: run ``fn(rank, world_size, *args)`` in ``world_size``
  spawned processes over a gloo process group; child failures fail the calling test. Children
  see ``NCP_DIST_CHILD=1`` in their environment.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_mod
import socket
import time
import traceback

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


class _FakeGroup:
    """A process-group stand-in: compared by identity only."""

    def __init__(self, mesh: "FakeCPMesh") -> None:
        self._desc = f"FakeGroup(size={mesh._size}, rank={mesh._rank})"

    def __repr__(self) -> str:
        return self._desc


class FakeCPMesh:
    """A one-dimensional "cp" mesh of ``size`` ranks, seen from ``rank``."""

    mesh_dim_names = ("cp",)

    def __init__(self, size: int, rank: int) -> None:
        self._size = int(size)
        self._rank = int(rank)
        self._group = _FakeGroup(self)

    def size(self, mesh_dim: int | None = None) -> int:
        return self._size

    def get_group(self, mesh_dim=None) -> _FakeGroup:
        return self._group

    def get_local_rank(self, mesh_dim=None) -> int:
        return self._rank

    def __getitem__(self, name: str) -> "FakeCPMesh":
        if name != "cp":
            raise KeyError(name)
        return self

    def __repr__(self) -> str:
        return f"FakeCPMesh(size={self._size}, rank={self._rank})"


@contextlib.contextmanager
def fake_dist(mesh: FakeCPMesh | None):
    """Patch ``torch.distributed.{is_available,is_initialized,get_rank}`` for the duration.

    With a mesh: available and initialized; ``get_rank(group=mesh.get_group())`` (or no group)
    returns the mesh's rank, any other group raises ValueError. With None: available but not
    initialized, and ``get_rank`` raises as torch does without a default process group.
    """
    saved = (dist.is_available, dist.is_initialized, dist.get_rank)

    def get_rank(group=None):
        if mesh is None:
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group."
            )
        if group is None or group is mesh.get_group():
            return mesh.get_local_rank()
        raise ValueError(f"fake_dist: unknown process group {group!r}")

    dist.is_available = lambda: True
    dist.is_initialized = lambda: mesh is not None
    dist.get_rank = get_rank
    try:
        yield
    finally:
        dist.is_available, dist.is_initialized, dist.get_rank = saved


# ---------------------------------------------------------------------------------------------
# Real process groups
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, backend, timeout, fn, args, results):
    """Body of one spawned rank: init the group, run ``fn``, report, always tear down."""
    error = None
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        error = traceback.format_exc()
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            if error is None:
                error = traceback.format_exc()
    results.put((rank, error))


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120) -> None:
    """Run module-level ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Fails the calling test (with each failing child's traceback) if any rank raises, dies without
    reporting, or the whole run exceeds ``timeout`` seconds; leftover children are killed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, world_size, port, backend, timeout, fn, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    # Children inherit the environment at start: mark them (they may take shortcuts only safe in
    # throwaway processes) and keep each to one intra-op thread unless the caller chose otherwise.
    child_env = {"NCP_DIST_CHILD": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    saved_env = {k: os.environ.get(k) for k in child_env}
    os.environ.update(child_env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    reports: dict[int, str | None] = {}
    deadline = time.monotonic() + timeout
    dead_since = None
    try:
        while len(reports) < world_size and time.monotonic() < deadline:
            try:
                rank, error = results.get(timeout=0.2)
                reports[rank] = error
                continue
            except queue_mod.Empty:
                pass
            # A rank that exited without reporting (hard crash): give the queue a moment, then stop.
            if any(p.exitcode is not None for i, p in enumerate(procs) if i not in reports):
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > 5:
                    break
    finally:
        timed_out = len(reports) < world_size and time.monotonic() >= deadline
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        results.join_thread()

    problems = []
    for rank, p in enumerate(procs):
        if rank not in reports:
            why = f"timed out after {timeout}s" if timed_out else f"died (exit code {p.exitcode})"
            problems.append(f"rank {rank}: {why} without reporting")
        elif reports[rank] is not None:
            problems.append(f"rank {rank} raised:\n{reports[rank]}")
    if problems:
        pytest.fail(f"run_distributed({fn.__name__}, world_size={world_size}) failed:\n" + "\n".join(problems))


__all__ = ["FakeCPMesh", "fake_dist", "run_distributed"]
