"""The C part under AddressSanitizer + UndefinedBehaviorSanitizer: a sanitized copy of the extension
(``NCP_SANITIZE=1 NCP_NO_CUDA=1``, which also drops CPython's ``-fwrapv`` so signed overflow is
checked) runs the CPU tests of the native paths and the fuzz campaign, and must draw no report.

Skips cleanly when the compiler has no ASan/UBSan runtime. The same run by hand (README,
"Robustness, sanitizers and NCP_PATCH"):

    NCP_NO_CUDA=1 NCP_SANITIZE=1 python setup.py build_ext --inplace
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \\
    ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 python -m pytest -q -s tests

(libasan must come first in the process, hence LD_PRELOAD; libstdc++ is preloaded with it, or
ASan's interception aborts inside torch's C++ exceptions. ``-s`` lets the reports through.)

Here UBSan runs with ``halt_on_error=0`` so that one run lists every report; the test fails on
any report. (TE's int32 wraparound on absurd lengths is intended parity and is written as explicit
unsigned arithmetic, ``ncp_add_wrap_i32``, so it draws none.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = [  # the CPU tests of every native path, plus the fuzz campaign
    "tests/test_thd_partition.py",
    "tests/test_mimo_native.py",
    "tests/test_mimo_native_integration.py",
    "tests/test_sink_attention.py",
    "tests/test_flint_plan.py",
    "tests/test_flint_dist.py",
    "tests/test_regressions_issue17.py",
    "tests/test_fuzz.py",
]
DESELECT = [  # the plain suite runs these; under ASan they cannot mean what they test
    # crashes a child process on purpose (ASan would report the SEGV)
    "tests/test_fuzz.py::test_crash_is_reported_and_the_rest_still_runs",
    # 4 GiB of zero pages: ASan's shadow memory would make them real
    "tests/test_regressions_issue17.py::test_thd_binary_search_midpoint_with_2_30_entries",
    # caps the child at 3 GiB of address space; ASan reserves terabytes of it at start-up
    "tests/test_regressions_issue17.py::test_flint_plan_past_int32_schedule_is_refused_before_allocating",
]
FUZZ_CASES = "6000"
_REPORT = re.compile(r"([\w./-]+\.(?:c|h|cu|cuh)):(\d+):(\d+): runtime error: (.*)")


def _runtime(cc: str, name: str) -> str | None:
    try:
        path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _toolchain() -> tuple[str, list[str]] | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return None
    libs = [_runtime(cc, n) for n in ("libasan.so", "libubsan.so", "libstdc++.so")]
    if any(lib is None for lib in libs):
        return None
    return cc, [libs[0], libs[2]]


def _copy_tree(dst: str) -> None:
    for name in ("setup.py", "pyproject.toml", "README.md", "nemo_cp_native_hook.py"):
        shutil.copy(os.path.join(ROOT, name), os.path.join(dst, name))
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.o")
    for name in ("csrc", "nemo_cp_native", "tests"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dst, name), ignore=ignore)


@pytest.mark.sanitize
def test_cpu_suite_and_fuzz_under_asan_ubsan(tmp_path):
    found = _toolchain()
    if found is None:
        pytest.skip("no ASan/UBSan runtime for this compiler (libasan.so, libubsan.so, libstdc++.so)")
    cc, preload = found
    tree = str(tmp_path / "tree")
    os.makedirs(tree)
    _copy_tree(tree)
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "NCP_PATCH", "NCP_FORCE_CUDA", "NCP_DEBUG")}
    t0 = time.perf_counter()
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, capture_output=True,
                           text=True, timeout=900, env=dict(base, NCP_NO_CUDA="1", NCP_SANITIZE="1"))  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    compiles = [line for line in build.stdout.splitlines() if " -c csrc/" in line]
    assert compiles and all("-fsanitize=address,undefined" in c and "-fno-wrapv" in c for c in compiles)
    assert not any(" -fwrapv" in c for c in compiles), "CPython's -fwrapv survived: UBSan would miss signed overflow"
    build_s = time.perf_counter() - t0

    env = dict(base, LD_PRELOAD=" ".join(preload), ASAN_OPTIONS="detect_leaks=0",
               UBSAN_OPTIONS="halt_on_error=0:print_stacktrace=1", NCP_FUZZ_CASES=FUZZ_CASES,
               NCP_FUZZ_CASE_TIMEOUT="300", PYTHONDONTWRITEBYTECODE="1")  # fmt: skip
    env.pop("PYTHONPATH", None)
    probe = subprocess.run([sys.executable, "-c", "import nemo_cp_native._C as c; print(c.__file__)"], cwd=tree,
                           capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.strip().startswith(tree), f"the sanitized copy is not the one imported: {probe.stdout}"

    t1 = time.perf_counter()
    deselect = [arg for d in DESELECT for arg in ("--deselect", d)]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *TESTS, *deselect], cwd=tree,
                         capture_output=True, text=True, timeout=1500, env=env)  # fmt: skip
    out = run.stdout + run.stderr
    summary = [line for line in out.splitlines() if " passed" in line or " failed" in line][-1:]
    print(f"sanitized build {build_s:.0f}s, tests {time.perf_counter() - t1:.0f}s: {summary}")
    asan = [line for line in out.splitlines() if "ERROR: AddressSanitizer" in line]
    assert not asan, "AddressSanitizer:\n" + out[-6000:]
    reports = {(os.path.basename(f), int(line)): msg for f, line, _, msg in _REPORT.findall(out)}
    assert not reports, "UBSan reports:\n" + "\n".join(f"{f}:{n}: {m}" for (f, n), m in sorted(reports.items()))
    assert run.returncode == 0, "tests failed under the sanitizers:\n" + out[-6000:]
