"""``NCP_PATCH=1`` (``nemo_cp_native_hook`` + its ``.pth``) and ``unpatch`` of late importers.

1. The ``.pth`` is installed by ``pip install -e .`` (this environment) and shipped at the root
   of the wheel (``pip install .``); its line is the module's ``PTH_LINE``.
2. Without ``NCP_PATCH`` a Python process imports nothing of ours (no torch either); with it,
   only the tiny hook module until upstream is imported.
3. ``NCP_PATCH=1`` + importing upstream's MiMo model module: upstream's ``cp`` names and the
   name the model module imported are the native ones, before the model module finishes.
4. ``torchrun --nproc-per-node 2`` over gloo with ``NCP_PATCH=1``: both ranks take the native
   path through upstream's name and match the reference (``tests/_hook_rank.py``).
5. ``unpatch`` restores upstream modules that imported a native name while patched, and leaves
   modules outside ``nemo_automodel`` alone.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import types
import zipfile

import pytest

import nemo_cp_native as ncp
import nemo_cp_native_hook as hook
from nemo_cp_native import flint

from _fake_flint import FLINT, NAMES, install_fake_flint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIMO_CP = "nemo_automodel.components.models.mimo_v2_flash.cp"
MIMO_MODEL = "nemo_automodel.components.models.mimo_v2_flash.model"


def _installed() -> bool:
    try:
        importlib.metadata.distribution("nemo-cp-native")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _have_upstream_mimo() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec(MIMO_CP) is not None
    except Exception:  # noqa: BLE001
        return False


needs_install = pytest.mark.skipif(not _installed(), reason="nemo-cp-native is not pip-installed here")
needs_upstream = pytest.mark.skipif(not _have_upstream_mimo(), reason="nemo_automodel's MiMo module is absent")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NCP_PATCH", "RANK", "LOCAL_RANK", "NCP_FORCE_CUDA")}
    env.update(extra)
    return env


def _py(code: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=_env(**env), cwd=ROOT)  # fmt: skip


# =============================================================================================
# 1. installation
# =============================================================================================


@needs_install
def test_pth_is_installed_in_site_packages():
    path = hook.installed_pth()
    assert path is not None, "nemo_cp_native_hook.pth missing: reinstall, or python -m nemo_cp_native_hook install"
    with open(path) as f:
        assert f.read() == hook.PTH_LINE


def test_wheel_ships_hook_at_site_packages_root(tmp_path):
    """``pip install .`` installs the wheel: the .pth and the hook module sit at its root."""
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-build-isolation",
         "--no-deps", "-w", str(tmp_path), ROOT],
        capture_output=True, text=True, timeout=600, env=_env(NCP_NO_CUDA="1"), cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert hook.PTH_NAME in names and "nemo_cp_native_hook.py" in names
        assert z.read(hook.PTH_NAME).decode() == hook.PTH_LINE


def test_pth_line_agrees_with_enabled():
    """The .pth line and ``enabled()`` read NCP_PATCH the same way."""
    for value in ("", "0", "false", "No", " off ", "1", "true", "YES", "on", "2"):
        calls = []
        fake_hook = types.SimpleNamespace(install=lambda: calls.append(1))
        fake_os = types.SimpleNamespace(environ={"NCP_PATCH": value})
        line = hook.PTH_LINE.replace("import os; ", "")
        eval(line, {"os": fake_os, "__import__": lambda name: fake_hook})  # noqa: S307 - our own line
        assert bool(calls) == hook.enabled({"NCP_PATCH": value}), value


# =============================================================================================
# 2.-3. what a process imports, and patch-on-import
# =============================================================================================

_PROBE = "import sys; print(sorted(m for m in ('torch', 'nemo_cp_native', 'nemo_cp_native_hook', 'nemo_automodel') if m in sys.modules))"


@needs_install
def test_no_env_imports_nothing():
    res = _py(_PROBE)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    res = _py(_PROBE, NCP_PATCH="0")
    assert res.stdout.strip() == "[]"


@needs_install
def test_env_imports_only_the_hook_at_startup():
    res = _py(_PROBE, NCP_PATCH="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "['nemo_cp_native_hook']"
    assert res.stderr == ""  # no log line until upstream is imported


@needs_install
@needs_upstream
def test_env_patches_upstream_on_import_before_importers_continue():
    code = (
        f"import {MIMO_MODEL} as model, {MIMO_CP} as cp, nemo_cp_native.mimo as m; "
        "print(cp.shard_batch_for_mimo_te is m.shard_batch_for_mimo_te, "
        "cp._chunk_partition_indices is m._chunk_partition_indices, "
        "model.make_mimo_te_cp_sharder is m.make_mimo_te_cp_sharder)"
    )
    res = _py(code, NCP_PATCH="1", RANK="5", LOCAL_RANK="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "True", "True"]
    logs = [line for line in res.stderr.splitlines() if line.startswith("nemo_cp_native:")]
    assert len(logs) == 1 and "rank 5 (local 1" in logs[0] and f"patched 5 names of {MIMO_CP}" in logs[0], logs
    # without the hook, the same import leaves upstream alone
    res = _py(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False", "False"]


# =============================================================================================
# 4. torchrun, two ranks, gloo
# =============================================================================================


@pytest.mark.dist
@needs_install
@needs_upstream
def test_torchrun_two_ranks_take_the_native_path(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "tests", "_hook_rank.py")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                         env=_env(NCP_PATCH="1", NCP_HOOK_OUT=str(tmp_path), OMP_NUM_THREADS="1"))  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    results = {}
    for r in (0, 1):
        with open(tmp_path / f"rank{r}.json") as f:
            results[r] = json.load(f)
    for r, got in results.items():
        assert got == {"rank": r, "env_rank": str(r), "hook_loaded_at_start": True, "native_name": True,
                       "path": "native", "same_as_reference": True}, got  # fmt: skip
    logs = [line for line in res.stderr.splitlines() if line.startswith("nemo_cp_native: NCP_PATCH=1")]
    assert sorted(line.split(" rank ")[1][0] for line in logs) == ["0", "1"], res.stderr[-3000:]


# =============================================================================================
# 5. unpatch and modules that imported a native name while patched
# =============================================================================================

FLINT_LATE = "nemo_automodel.components.models.flint.late_importer"


@pytest.fixture
def fake_flint(monkeypatch):
    yield install_fake_flint(monkeypatch)
    ncp.unpatch()


def test_unpatch_restores_names_imported_while_patched(fake_flint, monkeypatch):
    magi, originals = fake_flint
    ncp.patch()
    late = types.ModuleType(FLINT_LATE)  # `from ...flint.magi import _build_magi_plan` while patched
    late._build_magi_plan = magi._build_magi_plan
    user = types.ModuleType("my_recipe")  # outside nemo_automodel: may hold the native name on purpose
    user._build_magi_plan = magi._build_magi_plan
    monkeypatch.setitem(sys.modules, FLINT_LATE, late)
    monkeypatch.setitem(sys.modules, "my_recipe", user)
    assert late._build_magi_plan is flint._build_magi_plan
    restored = ncp.unpatch()
    assert f"{FLINT_LATE}._build_magi_plan" in restored
    assert late._build_magi_plan is originals["_build_magi_plan"]
    assert magi._build_magi_plan is originals["_build_magi_plan"]
    assert user._build_magi_plan is flint._build_magi_plan


def test_patch_module_validates_its_argument(fake_flint):
    from nemo_cp_native.patch import patch_module

    with pytest.raises(ValueError, match="target must be one of"):
        patch_module("nemo_automodel.nothing")
    swapped = patch_module(FLINT)
    assert sorted(swapped) == sorted(f"{FLINT}.{n}" for n in NAMES)


def test_hook_install_patches_targets_already_imported(fake_flint, capsys, monkeypatch):
    """``install()`` in a process that imported a target earlier patches it at once (and logs)."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(hook, "_state", {"finder": None, "patched": []})
    try:
        assert hook.install()
        assert fake_flint[0]._build_magi_plan is flint._build_magi_plan
    finally:
        hook.uninstall()
    assert hook._state["finder"] is None and all(not isinstance(f, hook._Finder) for f in sys.meta_path)
    err = capsys.readouterr().err
    assert "NCP_PATCH=1 rank 3 (local" in err and f"patched 4 names of {FLINT}" in err
