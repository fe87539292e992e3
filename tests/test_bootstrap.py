"""``scripts/bootstrap.sh`` skips the reinstall when nothing it depends on changed: its stamp hashes
setup.py, pyproject.toml, csrc/, the hook module, the script itself and the build knobs.
(A second real run prints "bootstrap: up to date"; here the stamp alone is computed, on a copy of
the tree, so the test never installs anything.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stamp(tree, **env) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("NCP_")}
    full.update(NCP_BOOTSTRAP_STAMP_ONLY="1", NCP_VENV=os.path.dirname(os.path.dirname(sys.executable)), **env)
    res = subprocess.run(["bash", os.path.join(tree, "scripts", "bootstrap.sh")], capture_output=True, text=True,
                         env=full, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout.strip()
    assert len(out) == 64, out
    return out


def test_stamp_tracks_sources_and_knobs(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "nemo_cp_native_hook.py"):
        shutil.copy(os.path.join(ROOT, name), tree / name)
    for name in ("csrc", "scripts"):
        shutil.copytree(os.path.join(ROOT, name), tree / name)
    first = _stamp(tree)
    assert _stamp(tree) == first  # nothing changed: the install is skipped
    assert _stamp(tree, NCP_DEBUG="1") != first  # another build
    (tree / "README.md").write_text("docs do not need a rebuild\n")
    assert _stamp(tree) == first
    with open(tree / "csrc" / "core" / "common.c", "a") as f:
        f.write("/* changed */\n")
    assert _stamp(tree) != first
