"""``NCP_PATCH=1``: patch NeMo Automodel in every Python process, e.g. every torchrun rank.

The model is coverage.py's ``COVERAGE_PROCESS_START``: installing nemo-cp-native puts
``nemo_cp_native_hook.pth`` into site-packages. Python runs its one line at start-up in every
process; the line reads one environment variable and, only when ``NCP_PATCH`` is set to a true
value (``1``, ``true``, ``yes``, ``on``), imports this module and calls ``install()``. With
``NCP_PATCH`` unset, nothing is imported (no torch, no nemo_automodel): start-up cost is one
dictionary lookup.

``install()`` imports nothing heavy either. It puts a finder at the front of ``sys.meta_path``
that waits for the upstream modules nemo-cp-native replaces
(``nemo_automodel.components.models.mimo_v2_flash.cp`` and ``...flint.magi``). Right after one
of them has executed, and before the module that imported it continues, the finder calls
``nemo_cp_native.patch`` for that module, so later ``from ... import`` statements (the model
module, the recipe) already bind the native names. Processes that never import upstream (the
torchrun launcher, pip) are left alone. Each patch writes one line to stderr with the rank, read
from ``RANK`` / ``LOCAL_RANK`` as torchrun sets them:

    nemo_cp_native: NCP_PATCH=1 rank 1 (local 1, pid 4242): patched 5 names of nemo_automodel...cp

Manual use where the ``.pth`` could not be installed (for example a read-only site-packages, or a
build with ``setup.py build_ext --inplace`` only):

    python -m nemo_cp_native_hook install     # write the .pth into this interpreter's site-packages
    python -m nemo_cp_native_hook uninstall   # remove it
    python -m nemo_cp_native_hook status      # where it is, and whether NCP_PATCH is set

This module must stay importable without torch and cheap to import.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["ENV", "PTH_LINE", "PTH_NAME", "TARGETS", "enabled", "install", "installed_pth", "uninstall"]

ENV = "NCP_PATCH"
PTH_NAME = "nemo_cp_native_hook.pth"
# The .pth line: site.py execs lines that start with "import". Keep it in sync with enabled().
PTH_LINE = (
    "import os; os.environ.get('NCP_PATCH', '').strip().lower() not in ('', '0', 'false', 'no', 'off')"
    " and __import__('nemo_cp_native_hook').install()\n"
)
TARGETS = (
    "nemo_automodel.components.models.mimo_v2_flash.cp",
    "nemo_automodel.components.models.flint.magi",
)
_FALSE = ("", "0", "false", "no", "off")
_state = {"finder": None, "patched": []}


def enabled(environ=None) -> bool:
    """True when ``NCP_PATCH`` asks for the hook (the same test as the ``.pth`` line)."""
    return (environ if environ is not None else os.environ).get(ENV, "").strip().lower() not in _FALSE


def _rank_text() -> str:
    rank, local = os.environ.get("RANK"), os.environ.get("LOCAL_RANK")
    return f"rank {rank if rank is not None else '?'} (local {local if local is not None else '?'}, pid {os.getpid()})"


def _patch(target: str) -> None:
    """Patch one loaded upstream module and say so on stderr (one line)."""
    try:
        from nemo_cp_native.patch import patch_module

        swapped = patch_module(target)
    except Exception as exc:  # noqa: BLE001 - a broken patch must not kill the user's job at import
        sys.stderr.write(f"nemo_cp_native: {ENV}=1 {_rank_text()}: patching {target} failed: "
                         f"{type(exc).__name__}: {exc}\n")  # fmt: skip
        return
    _state["patched"].append(target)
    sys.stderr.write(f"nemo_cp_native: {ENV}=1 {_rank_text()}: patched {len(swapped)} names of {target}\n")
    sys.stderr.flush()


class _Loader:
    """Wraps the real loader: runs the module, then patches it before the importer continues."""

    def __init__(self, loader, target: str) -> None:
        self._loader = loader
        self._target = target

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _patch(self._target)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... of the real loader
        return getattr(self._loader, name)


class _Finder:
    """A ``sys.meta_path`` finder that only wraps the loaders of ``TARGETS``."""

    _busy: set = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TARGETS or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


def install() -> bool:
    """Arm the hook in this process (idempotent). Targets already imported are patched now.
    Returns True when the finder is in place."""
    if _state["finder"] is None:
        _state["finder"] = _Finder()
        sys.meta_path.insert(0, _state["finder"])
        for target in TARGETS:
            if target in sys.modules:
                _patch(target)
    return True


def uninstall() -> None:
    """Remove the finder from this process (names already patched stay patched; see ``unpatch``)."""
    finder = _state["finder"]
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    _state["finder"] = None


# ------------------------------------------------------------------------------------------
# python -m nemo_cp_native_hook install | uninstall | status
# ------------------------------------------------------------------------------------------


def _site_dir() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def installed_pth() -> str | None:
    """Path of the installed ``.pth`` in this interpreter's site directories, or None."""
    import site

    dirs = [_site_dir(), *getattr(site, "getsitepackages", lambda: [])()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    for d in dirs:
        path = os.path.join(d, PTH_NAME)
        if os.path.isfile(path):
            return path
    return None


def _main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    path = os.path.join(_site_dir(), PTH_NAME)
    if cmd == "install":
        with open(path, "w") as f:
            f.write(PTH_LINE)
        print(f"wrote {path}")
    elif cmd == "uninstall":
        if os.path.exists(path):
            os.remove(path)
            print(f"removed {path}")
        else:
            print(f"not installed at {path}")
    elif cmd == "status":
        where = installed_pth()
        print(f"hook .pth: {where or 'not installed'}; {ENV}={os.environ.get(ENV, '')!r} "
              f"({'on' if enabled() else 'off'})")  # fmt: skip
    else:
        print("usage: python -m nemo_cp_native_hook [install | uninstall | status]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
