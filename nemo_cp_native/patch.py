"""``patch()`` / ``unpatch()`` / ``patched()``: swap the upstream Python modules for ours.

Upstream modules and the places that imported the replaced names directly (the MiMo model
module imports ``make_mimo_te_cp_sharder``; Flint's model imports ``_prepare_magi_inputs``) are
rebound in place. Idempotent; ``unpatch`` restores exactly what was there, including upstream
modules that imported a native name while patched. Without ``nemo_automodel`` it changes nothing
and says so. ``NCP_PATCH=1`` patches every process at import time (``nemo_cp_native_hook``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["patch", "patch_module", "patched", "unpatch"]

# target module -> (our module, names)
_TARGETS = {
    "nemo_automodel.components.models.mimo_v2_flash.cp": (
        "nemo_cp_native.mimo",
        ("shard_batch_for_mimo_te", "make_mimo_te_cp_sharder", "_chunk_partition_indices", "_media_mask",
         "_flatten_chunks"),
    ),
    "nemo_automodel.components.models.flint.magi": (
        "nemo_cp_native.flint",
        ("FlintMagiPlan", "FlintMagiBatchPlans", "_build_magi_plan", "_prepare_magi_inputs"),
    ),
}  # fmt: skip

_saved: dict[tuple[str, str], object] = {}  # (module, name) -> original object


def _importable(name: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - absent or broken upstream: nothing to patch
        logger.debug("nemo_cp_native.patch: cannot import %s (%s)", name, exc)
        return None


def _importers(target: str, originals: dict) -> list:
    """Loaded modules (besides the target) that hold one of the original objects by name."""
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name == target or not mod_name.startswith("nemo_automodel"):
            continue
        for name, obj in originals.items():
            if getattr(mod, "__dict__", {}).get(name) is obj:
                found.append((mod_name, name))
    return found


def _patch_target(target: str, mod) -> list[str]:
    """Swap the names of one loaded upstream module and of the upstream modules that imported them."""
    ours_name, names = _TARGETS[target]
    ours = importlib.import_module(ours_name)
    swapped = []
    originals = {n: getattr(mod, n) for n in names if hasattr(mod, n)}
    for n, orig in originals.items():
        new = getattr(ours, n)
        if orig is new:
            continue
        _saved.setdefault((target, n), orig)
        setattr(mod, n, new)
        swapped.append(f"{target}.{n}")
    for mod_name, n in _importers(target, {n: _saved.get((target, n), o) for n, o in originals.items()}):
        _saved.setdefault((mod_name, n), getattr(sys.modules[mod_name], n))
        setattr(sys.modules[mod_name], n, getattr(ours, n))
        swapped.append(f"{mod_name}.{n}")
    return swapped


def patch() -> list[str]:
    """Swap every replaceable upstream name for the native one. Returns what was swapped
    (``"module.name"`` strings); an empty list when ``nemo_automodel`` is absent."""
    swapped = []
    for target in _TARGETS:
        mod = _importable(target)
        if mod is not None:
            swapped += _patch_target(target, mod)
    if swapped:
        logger.info("nemo_cp_native.patch: swapped %d names: %s", len(swapped), ", ".join(swapped))
    elif not _saved:
        logger.info("nemo_cp_native.patch: nemo_automodel is not importable; nothing to patch")
    return swapped


def patch_module(target: str) -> list[str]:
    """``patch()`` for one upstream module that is already imported (the ``NCP_PATCH`` hook calls
    this right after the module has executed, so nothing else gets imported). Returns what was
    swapped, like ``patch()``."""
    if target not in _TARGETS:
        raise ValueError(f"target must be one of {sorted(_TARGETS)}; got {target!r}")
    mod = sys.modules.get(target)
    if mod is None:
        raise ValueError(f"target {target!r} is not imported")
    swapped = _patch_target(target, mod)
    if swapped:
        logger.info("nemo_cp_native.patch: swapped %d names: %s", len(swapped), ", ".join(swapped))
    return swapped


def unpatch() -> list[str]:
    """Restore every name ``patch`` swapped. Returns what was restored.

    Upstream modules (``nemo_automodel.*``) that imported a native name from a patched module
    *after* ``patch()`` (``from ...cp import shard_batch_for_mimo_te`` while patched) are restored
    too. Modules outside ``nemo_automodel`` keep what they imported: they may have imported the
    native object on purpose."""
    restored = []
    natives = {}  # (name, id(native object)) -> original, for the late importers
    for (mod_name, name), orig in list(_saved.items()):
        if mod_name in _TARGETS:
            natives[(name, id(getattr(importlib.import_module(_TARGETS[mod_name][0]), name)))] = orig
        mod = sys.modules.get(mod_name)
        if mod is not None:
            setattr(mod, name, orig)
            restored.append(f"{mod_name}.{name}")
        del _saved[(mod_name, name)]
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("nemo_automodel"):
            continue
        for (name, native_id), orig in natives.items():
            if id(getattr(mod, "__dict__", {}).get(name)) == native_id:
                setattr(mod, name, orig)
                restored.append(f"{mod_name}.{name}")
    return restored


def is_patched() -> bool:
    return bool(_saved)


@contextlib.contextmanager
def patched():
    """``with nemo_cp_native.patched(): ...`` patches for the block and restores afterwards."""
    already = is_patched()
    swapped = patch()
    try:
        yield swapped
    finally:
        if not already:
            unpatch()
