"""Helpers to run the real upstream nemo-automodel code here, where Transformer Engine is absent,
and to compare it exactly with our oracles (``parity``, ``assert_same``, ``draw_case``).

``fake_transformer_engine()`` installs a ``transformer_engine_torch`` module whose
``thd_get_partitioned_indices`` is our oracle (``nemo_cp_native.reference.te_partition``), so that
upstream's lazy ``import transformer_engine_torch as tex`` resolves to it. Note the oracle
allocates on the device of ``cu_seqlens``, where real TE uses the current CUDA device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import types

import torch

_TE_MODULE = "transformer_engine_torch"
UPSTREAM_CP_MODULE = "nemo_automodel.components.models.mimo_v2_flash.cp"


_THD_UTILS = "nemo_automodel.components.distributed.thd_utils"
_CP_UTILS = "nemo_automodel.components.distributed.context_parallel.utils"
# Package __init__s that import far more than the MiMo CP path needs (parallelizers, dynamo,
# the MiMo model and transformers: ~9 s of imports per process).
_HEAVY_PACKAGES = ("nemo_automodel.components.distributed", "nemo_automodel.components.models.mimo_v2_flash")
_cached: list = []


def _register_bare_packages() -> None:
    """Register ``_HEAVY_PACKAGES`` without running their ``__init__``; submodules load unchanged.

    Only inside throwaway rank processes of ``run_distributed`` (``NCP_DIST_CHILD=1``), where
    process start-up dominates: it leaves bare packages in ``sys.modules``, which would break
    anyone importing the package-level names later. Must run before anything imports them.
    """
    for name in _HEAVY_PACKAGES:
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)  # imports the parents only
        except Exception:  # noqa: BLE001 - upstream absent: upstream_modules() reports it
            return
        if spec is None:
            return
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, package)


if os.environ.get("NCP_DIST_CHILD") == "1":
    _register_bare_packages()

from _mesh import FakeCPMesh, fake_dist  # noqa: E402

from nemo_cp_native.reference import mimo as ref  # noqa: E402 - after the bare packages
from nemo_cp_native.reference import te_partition  # noqa: E402
from nemo_cp_native.testing import make_mimo_batch, random_case  # noqa: E402


def upstream_modules():
    """``(cp, context_parallel.utils, thd_utils)`` modules of upstream, or None if not importable."""
    if not _cached:
        try:
            _cached.append(tuple(importlib.import_module(m) for m in (UPSTREAM_CP_MODULE, _CP_UTILS, _THD_UTILS)))
        except Exception:  # noqa: BLE001 - any failure means "not available"
            _cached.append(None)
    return _cached[0]


def upstream_available() -> bool:
    """True when nemo_automodel's MiMo ``cp`` module and the framework helpers it uses import."""
    return upstream_modules() is not None


def upstream_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nemo-automodel")
    except Exception:  # noqa: BLE001
        return None


@contextlib.contextmanager
def fake_transformer_engine():
    """Install a fake ``transformer_engine_torch`` in ``sys.modules``; restore what was there after."""
    module = types.ModuleType(_TE_MODULE)
    module.__doc__ = "Fake Transformer Engine: thd_get_partitioned_indices from nemo_cp_native's oracle."
    module.thd_get_partitioned_indices = te_partition.thd_get_partitioned_indices
    missing = object()
    saved = sys.modules.get(_TE_MODULE, missing)
    sys.modules[_TE_MODULE] = module
    try:
        yield module
    finally:
        if saved is missing:
            sys.modules.pop(_TE_MODULE, None)
        else:
            sys.modules[_TE_MODULE] = saved


# ---------------------------------------------------------------------------------------------
# Exact comparison of two results (oracle vs upstream)
# ---------------------------------------------------------------------------------------------


def leaves(obj, path="out"):
    """Yield ``(path, value)`` for every leaf of nested dicts / lists / tuples / dataclasses."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), f"{path}.{f.name}")
    else:
        yield path, obj


def assert_same(a, b, path="out") -> None:
    """Exact equality: same container types, key order, dtypes, shapes, devices and values."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert torch.equal(a, b), f"{path}: values differ\n{a}\n{b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, type) or callable(a):
        assert a is b, f"{path}: {a!r} is not {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def snapshot(obj):
    """A deep copy of the tensors of nested containers (to detect in-place mutation)."""
    return [(p, v.clone() if isinstance(v, torch.Tensor) else v) for p, v in leaves(obj)]


def assert_unchanged(obj, snap) -> None:
    now = list(leaves(obj))
    assert [p for p, _ in now] == [p for p, _ in snap], "input structure was mutated"
    for (p, v), (_, old) in zip(now, snap):
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, old), f"input {p} was modified in place"


def aliasing(out, inputs) -> dict[str, list[str]]:
    """For each output tensor leaf: the input leaves sharing its storage (views of caller memory)."""
    storage = {}
    for p, v in leaves(inputs, "in"):
        if isinstance(v, torch.Tensor) and v.numel():
            storage.setdefault(v.untyped_storage().data_ptr(), []).append(p)
    result = {}
    for p, v in leaves(out):
        if isinstance(v, torch.Tensor) and v.numel():
            result[p] = storage.get(v.untyped_storage().data_ptr(), [])
    return result


def call(fn, *args, **kwargs):
    """``("ok", result)`` or ``("err", exception)``."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return "err", exc


def assert_same_outcome(ref, up, path="out") -> None:
    """Both returned equal results, or both raised the same exception type with the same message."""
    (rk, rv), (uk, uv) = ref, up
    if rk == "err" or uk == "err":
        assert rk == uk, f"{path}: oracle {rk} {rv!r} vs upstream {uk} {uv!r}"
        assert type(rv) is type(uv), f"{path}: {type(rv).__name__}({rv}) != {type(uv).__name__}({uv})"
        assert str(rv) == str(uv), f"{path}: messages differ\n oracle:   {rv}\n upstream: {uv}"
    else:
        assert_same(rv, uv, path)


# ---------------------------------------------------------------------------------------------
# Oracle-vs-upstream runs
# ---------------------------------------------------------------------------------------------


def up_fn(name: str):
    """Upstream's function of that name (MiMo cp, then context_parallel.utils, then thd_utils)."""
    for module in upstream_modules() or ():
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


_MUTATES_ARGS = {"_shard_thd_chunk_for_te"}  # index-selects the dict it is given, in place


def parity(name, make_args, *, mesh=None, dist_mesh="same", **kwargs):
    """Run oracle and upstream ``name`` on fresh args under fake TE + fake dist; compare exactly.

    ``make_args()`` must return fresh containers (tensors may be shared). ``dist_mesh``: the mesh
    ``fake_dist`` answers for (``"same"``: ``mesh``; None: no process group), or ``"real"`` to leave
    ``torch.distributed`` alone (inside ``run_distributed``). Compares the outcome (values or the
    exception), the arguments after the call, and which outputs alias caller storage.
    Returns the oracle's outcome.
    """
    results = []
    for fn in (getattr(ref, name), up_fn(name)):
        args = make_args()
        snap = snapshot(args)
        if dist_mesh == "real":
            dist_ctx = contextlib.nullcontext()
        else:
            dist_ctx = fake_dist(mesh if dist_mesh == "same" else dist_mesh)
        with fake_transformer_engine(), dist_ctx:
            outcome = call(fn, *args, **kwargs)
        if name not in _MUTATES_ARGS:
            assert_unchanged(args, snap)
        results.append((outcome, args))
    (ref_out, ref_args), (up_out, up_args) = results
    assert_same_outcome(ref_out, up_out, name)
    assert_same(ref_args, up_args, f"{name} args after call")
    if ref_out[0] == "ok":
        assert aliasing(ref_out[1], ref_args) == aliasing(up_out[1], up_args), f"{name}: aliasing differs"
    return ref_out


def draw_case(g, *, B=None, S=None, C=None, cp=None, **batch_kw):
    """A random batch, ``shard_batch_for_mimo_te`` options and cp over the test matrix.

    Adds extra keys at random (a ``_vlm_pp_media_chunks`` dict, a media tensor, an attention mask),
    and position_ids=None only where upstream supports it (cp 1, one chunk). ``batch_kw`` override
    the drawn ``make_mimo_batch`` options.
    """
    rB, rS, rC, rcp = random_case(g)
    B, C, cp = B or rB, C or rC, cp or rcp
    S = S or rS * cp // rcp
    flip = lambda p: bool(torch.rand((), generator=g) < p)  # noqa: E731
    pos_none = cp == 1 and C == 1 and flip(0.15)
    drawn = dict(
        docs_per_row=(1, int(torch.randint(1, 7, (), generator=g))),
        dtype=torch.int32 if flip(0.2) else torch.long,
        lens_dtype=torch.int32 if flip(0.2) else torch.long,
        image_token_id=151655 if flip(0.6) else None,
        video_token_id=151656 if flip(0.4) else None,
        media_fraction=0.1, with_position_ids=not pos_none,
        absorption=flip(0.25), min_doc=flip(0.3),
    )  # fmt: skip
    batch = make_mimo_batch(B, S, num_chunks=C, cp_size=cp, generator=g, **{**drawn, **batch_kw})
    if flip(0.4):
        batch["_vlm_pp_media_chunks"] = {"pixel_values": [torch.randn(3, 4, generator=g)], "grid": [None]}
    if flip(0.3):
        batch["pixel_values"] = torch.randn(5, 6, generator=g)
    if flip(0.2):
        batch["attention_mask"] = torch.ones(B, S, dtype=torch.long)
    opts = {
        "num_chunks": C,
        "padding_token_id": 0,
        "image_token_id": 151655 if flip(0.6) else None,
        "video_token_id": 151656 if flip(0.5) else None,
    }
    return batch, opts, cp


def case_meshes(cp, g):
    """Every rank's FakeCPMesh for cp > 1; None or a size-1 mesh for cp 1."""
    if cp == 1:
        return [None if bool(torch.rand((), generator=g) < 0.5) else FakeCPMesh(1, 0)]
    return [FakeCPMesh(cp, r) for r in range(cp)]


class _FakeAttention(torch.nn.Module):
    """Records ``setup_cp_attention`` calls, as MiMo's TE attention would receive them (§9)."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def setup_cp_attention(self, cp_mesh, *, cp_stream=None):
        self.calls.append((cp_mesh, cp_stream))


class FakeMiMoModel(torch.nn.Module):
    """Two ``layers.N.self_attn`` modules; ``with_hook=False`` makes the first one lack the hook."""

    def __init__(self, with_hook=True):
        super().__init__()
        self.calls = []
        block = torch.nn.Module()
        block.self_attn = _FakeAttention(self.calls) if with_hook else torch.nn.Linear(1, 1)
        self.layers = torch.nn.ModuleList([block, torch.nn.Module()])
        self.layers[1].self_attn = _FakeAttention(self.calls)


__all__ = [
    "FakeMiMoModel",
    "UPSTREAM_CP_MODULE",
    "aliasing",
    "assert_same",
    "assert_same_outcome",
    "assert_unchanged",
    "call",
    "case_meshes",
    "draw_case",
    "gen",
    "parity",
    "up_fn",
    "fake_transformer_engine",
    "leaves",
    "snapshot",
    "upstream_available",
    "upstream_modules",
    "upstream_version",
]
