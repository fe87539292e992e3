"""Mechanical rules on csrc/ (STYLE.md item 15): no exit/abort, every kernel launch checked, every
exported C symbol prefixed ncp_, files within size limits, a header comment on every source file."""

from __future__ import annotations

import pathlib
import re

import pytest

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".c", ".h", ".cu", ".cuh"))


def _code(path: pathlib.Path) -> str:
    """Source without comments and string literals."""
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def test_there_are_sources():
    assert len(SOURCES) >= 15


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(CSRC)))
def test_no_exit_or_abort(path):
    assert not re.search(r"\b(exit|abort|_Exit|quick_exit)\s*\(", _code(path)), f"{path} calls exit/abort"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.suffix == ".cu"], ids=lambda p: p.name)
def test_every_launch_is_checked(path):
    lines = _code(path).splitlines()
    for i, line in enumerate(lines):
        if "<<<" in line:
            after = "\n".join(lines[i : i + 4])
            assert "NCP_CUDA_CHECK(cudaGetLastError())" in after, f"{path.name}:{i + 1}: unchecked launch"


def _exported_functions(path):
    code = _code(path)
    if path.suffix == ".cu":  # only extern "C" definitions leave a .cu file
        return re.findall(r'extern\s+""\s+\w+\s+\*?\s*(\w+)\s*\(', code)
    names = []
    for m in re.finditer(r"^(?!static\b)(?:[A-Za-z_][\w \*]*?)\b(\w+)\s*\([^;{]*\)\s*\{", code, flags=re.M):
        names.append(m.group(1))
    return names


@pytest.mark.parametrize("path", [p for p in SOURCES if p.suffix in (".c", ".cu")], ids=lambda p: p.name)
def test_exported_symbols_are_prefixed(path):
    for name in _exported_functions(path):
        assert name.startswith("ncp_") or name == "PyInit__C", f"{path.name}: exported symbol {name!r} lacks ncp_"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(CSRC)))
def test_size_and_header_comment(path):
    text = path.read_text()
    assert text.lstrip().startswith("/*"), f"{path} has no header comment"
    assert len(text.splitlines()) <= 800, f"{path} is longer than 800 lines"


def _function_bodies(code: str):
    """(name, first line, line count) of every brace-delimited function definition in code."""
    for m in re.finditer(r"\b(\w+)\s*\([^;{}]*\)\s*(?:const\s*)?\{", code):
        if m.group(1) in ("if", "for", "while", "switch", "do", "catch"):
            continue
        depth, i = 0, m.end() - 1
        while i < len(code):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                break
            i += 1
        start = code.count("\n", 0, m.start()) + 1
        yield m.group(1), start, code.count("\n", m.end(), i) + 1


@pytest.mark.parametrize("path", [p for p in SOURCES if p.suffix in (".cu", ".cuh")], ids=lambda p: str(p.relative_to(CSRC)))
def test_kernels_are_at_most_150_lines(path):
    """Kernels are composed of named parts (STYLE.md item 15, DESIGN.md section 7)."""
    code = _code(path)
    for m in re.finditer(r"__global__[^{;]*?\b(\w+)\s*\(", code):
        body = code[m.start():]
        for name, start, n in _function_bodies(body):
            assert n <= 150, f"{path.name}: kernel {name} has {n} lines"
            break


def test_no_runtime_switch_matrix():
    """At most three getenv calls in csrc: the kernels take no environment switches (the test
    hooks are one struct set from Python, read once per call)."""
    n = sum(_code(p).count("getenv") for p in SOURCES)
    assert n <= 3, f"{n} getenv calls in csrc"


def test_the_stub_states_every_native_function():
    """nemo_cp_native/_C.pyi declares exactly the functions the extension exports."""
    import nemo_cp_native._C as C

    stub = (CSRC.parent / "nemo_cp_native" / "_C.pyi").read_text()
    declared = set(re.findall(r"^def (\w+)\(", stub, flags=re.M))
    exported = {n for n in dir(C) if callable(getattr(C, n)) and not n.startswith("_") and n != "Fallback"}
    assert declared == exported, (sorted(declared - exported), sorted(exported - declared))


def _ptxas_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ncp_ptxas_check", CSRC.parent / "scripts" / "ptxas_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_rejects_serialized_wgmma_advisories():
    """setup.py fails a CUDA build whose ptxas serialized a kernel's wgmma (scripts/ptxas_check.py).
    The sample lines are ptxas 13.0's own output for a Hopper forward variant that hit C7511."""
    check = _ptxas_check().serialized_wgmma
    kernel = "_ZN3ncp5fwd9044_GLOBAL__N_125sink_attn_fwd_sm90_kernelI13__nv_bfloat16Li128ENS_8DocsMaskEEEv"
    out = (
        "ptxas info    : Compiling entry function '" + kernel + "' for 'sm_90a'\n"
        "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "insufficient register resources for the wgmma pipeline in the function '" + kernel + "'\n"
        "ptxas info    : (C7519) warpgroup.arrive is injected in around line 106 by compiler to allow use of "
        "registers in GMMA in function '_Z1kv'\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n"
    )
    assert check(out) == [("C7511", kernel)]
    assert check("ptxas info    : Used 168 registers, used 16 barriers\n") == []
    src = (CSRC.parent / "setup.py").read_text()
    assert "serialized_wgmma(res.stderr)" in src and "raise RuntimeError" in src.split("serialized_wgmma(res.stderr)")[1][:400]
