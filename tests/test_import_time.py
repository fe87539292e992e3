"""``import nemo_cp_native`` stays cheap: no upstream import, at most 0.3 s beyond ``import torch``.

``nemo_automodel.components.distributed`` costs seconds to import; ``_compat`` binds upstream's
classes on first use instead (module ``__getattr__``). Timed in fresh subprocesses; the best of
three runs is compared, so a busy CI machine does not fail the bound by accident.
"""

from __future__ import annotations

import json
import subprocess
import sys

_CODE = """
import json, sys, time
t0 = time.perf_counter(); import torch
t1 = time.perf_counter(); import nemo_cp_native
t2 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "ncp": t2 - t1,
                  "upstream": sorted(m for m in sys.modules if m.split(".")[0] == "nemo_automodel")}))
"""
BOUND_S = 0.3


def _run() -> dict:
    res = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_does_not_load_upstream_and_is_fast():
    runs = [_run() for _ in range(3)]
    for r in runs:
        assert r["upstream"] == [], r["upstream"][:5]
    best = min(r["ncp"] for r in runs)
    print(f"import nemo_cp_native beyond torch: best {best:.3f}s of {[round(r['ncp'], 3) for r in runs]}")
    assert best <= BOUND_S, runs


def test_compat_resolves_upstream_lazily_and_keeps_its_names():
    code = (
        "import sys, nemo_cp_native._compat as c; before = 'nemo_automodel' in sys.modules; "
        "have = c.HAVE_UPSTREAM; layout = c.ShardLayout; sharder = c.ContextParallelSharder; "
        "from nemo_cp_native._compat import ShardLayout; "
        "print(before, have, layout is ShardLayout, layout.__name__, sharder.__name__, "
        "have == ('nemo_automodel' in sys.modules), c.upstream_version() is None or isinstance(c.upstream_version(), str))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    before, have, same, lname, sname, consistent, version_ok = res.stdout.split()
    assert before == "False" and same == "True" and consistent == "True" and version_ok == "True"
    assert (lname, sname) == ("ShardLayout", "ContextParallelSharder")


def test_compat_without_upstream_uses_the_stand_ins():
    code = (
        "import sys; sys.modules['nemo_automodel'] = None; import nemo_cp_native._compat as c; "
        "print(c.HAVE_UPSTREAM, c.ShardLayout is c._StandaloneShardLayout, "
        "c.ContextParallelSharder is c._StandaloneContextParallelSharder, c.upstream_version())"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "True", "True", "None"]
