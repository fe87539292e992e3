"""Build of nemo_cp_native._C: C sources always, CUDA objects when nvcc is found.

No torch headers and no torch.utils.cpp_extension: the extension talks to tensors through the
DLPack C ABI, so one build works with every torch version.

Knobs (environment):
    NCP_CUDA_ARCHS     semicolon list of targets, default "90a" (e.g. "80;90a"); "90a" builds
                       -gencode=arch=compute_90a,code=sm_90a
    NCP_FORCE_CUDA=1   fail instead of building CPU-only when nvcc is missing
    NCP_NO_CUDA=1      build CPU-only even when nvcc is present
    NCP_DEBUG=1        -O0 -g, asserts on, nvcc -G
    NCP_SANITIZE=1     ASan/UBSan on the C part (-O1, -fno-wrapv: CPython's -fwrapv is removed so
                       UBSan sees signed overflow). Load it with the sanitizer runtimes first:
                       LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
                       ASAN_OPTIONS=detect_leaks=0 python ...   (README, "Robustness")
    NCP_PTXAS_VERBOSE=1  keep nvcc's register/spill report in build/ncp_ptxas/<file>.txt
    NCP_ALLOW_SERIAL_WGMMA=1  build even when ptxas serializes a kernel's wgmma (C75xx advisory,
                       scripts/ptxas_check.py); by default that fails the build
    NCP_NVCC_JOBS      parallel nvcc processes (default: CPU count)
    NCP_CTA_CLOCK=1    a probe build: the Hopper dK/dV kernel records each CTA's SM, item count and
                       start/end clocks (benchmarks/probe_cta_clock.py reads them); never for a release
CUDA objects are cached under build/ncp_cuda/<hash>.o, keyed by source, headers, flags and the
nvcc version, so an unchanged tree links without recompiling.

Besides the package, the build installs ``nemo_cp_native_hook.py`` and ``nemo_cp_native_hook.pth``
at the top of site-packages (``pip install .`` and ``pip install -e .``): the opt-in
``NCP_PATCH=1`` hook that patches NeMo Automodel in every process (see that module).
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "False")


def _find_nvcc() -> str | None:
    if _env_flag("NCP_NO_CUDA"):
        return None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _ptxas_check():
    """scripts/ptxas_check.py, loaded by path (the build runs before the package is importable)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ncp_ptxas_check", os.path.join(ROOT, "scripts", "ptxas_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cuda_home(nvcc: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def _gencode(archs: str) -> list[str]:
    flags = []
    for arch in [a.strip() for a in archs.split(";") if a.strip()]:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _c_sources() -> list[str]:
    srcs = []
    for sub in ("core", "cpu", "python"):
        srcs += sorted(glob.glob(os.path.join("csrc", sub, "*.c")))
    return srcs


class NcpBuildExt(build_ext):
    """Compiles csrc/cuda/*.cu with nvcc (in parallel, cached) before linking the C extension."""

    def build_extensions(self):
        nvcc = _find_nvcc()
        ext = self.extensions[0]
        debug = _env_flag("NCP_DEBUG")
        if nvcc is None:
            if _env_flag("NCP_FORCE_CUDA"):
                raise RuntimeError("NCP_FORCE_CUDA=1 but nvcc was not found (set CUDA_HOME or PATH)")
            print("nemo_cp_native: nvcc not found: building CPU-only", file=sys.stderr)
        else:
            archs = os.environ.get("NCP_CUDA_ARCHS", "90a")
            objects = self._compile_cuda(nvcc, archs, debug)
            home = _cuda_home(nvcc)
            libdirs = [d for d in (os.path.join(home, "lib64"), os.path.join(home, "targets", "x86_64-linux", "lib"),
                                   os.path.join(home, "lib")) if os.path.isdir(d)]
            ext.extra_objects += objects
            ext.library_dirs += libdirs
            ext.libraries += ["cudart_static", "stdc++", "dl", "pthread", "rt"]
            ext.define_macros += [("NCP_WITH_CUDA", "1"), ("NCP_CUDA_ARCHS_STR", f'"{archs}"')]
            print(f"nemo_cp_native: CUDA build for {archs} with {nvcc}", file=sys.stderr)
        if debug:
            ext.extra_compile_args += ["-O0", "-g", "-UNDEBUG", "-DNCP_DEBUG=1"]
        if _env_flag("NCP_SANITIZE"):
            self._sanitize(ext)
        super().build_extensions()

    def _sanitize(self, ext) -> None:
        """ASan + UBSan on the C part. CPython's CFLAGS carry -fwrapv, which makes signed
        overflow defined and so invisible to UBSan: take it out of the compiler command and
        add -fno-wrapv after everything else."""
        for attr in ("compiler_so", "compiler", "compiler_cxx"):
            cmd = getattr(self.compiler, attr, None)
            if isinstance(cmd, list):
                setattr(self.compiler, attr, [a for a in cmd if a != "-fwrapv"])
        flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-wrapv", "-O1", "-g"]
        ext.extra_compile_args += flags
        ext.extra_link_args += ["-fsanitize=address,undefined"]
        print("nemo_cp_native: sanitizer build (ASan + UBSan, -fno-wrapv)", file=sys.stderr)

    def _compile_cuda(self, nvcc: str, archs: str, debug: bool) -> list[str]:
        sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "**", "*.cu"), recursive=True))
        headers = sorted(glob.glob(os.path.join(CSRC, "**", "*.h"), recursive=True)
                         + glob.glob(os.path.join(CSRC, "**", "*.cuh"), recursive=True))
        # Relative include paths and cwd=ROOT keep the cache key independent of where the tree lives.
        flags = ["-std=c++17", "-Xcompiler", "-fPIC", "-lineinfo", "--expt-relaxed-constexpr",
                 "-Icsrc/include", "-Icsrc/core"]
        flags += ["-O0", "-G", "-DNCP_DEBUG=1"] if debug else ["-O3", "-DNDEBUG"]
        flags += _gencode(archs)
        if "90a" in [a.strip() for a in archs.split(";")]:
            flags.append("-DNCP_SM90A_BUILD=1")  # the Hopper (wgmma/TMA) kernels exist in this build
        if _env_flag("NCP_CTA_CLOCK"):
            flags.append("-DNCP_CTA_CLOCK=1")  # probe build: per-CTA clocks of the dK/dV kernel
        verbose = _env_flag("NCP_PTXAS_VERBOSE")
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        version = "\n".join(line for line in version.splitlines() if "release" in line or "Build" in line)
        hdr = hashlib.sha256()
        for h in headers:
            with open(h, "rb") as f:
                hdr.update(f.read())
        outdir = os.path.join(ROOT, "build", "ncp_cuda")
        os.makedirs(outdir, exist_ok=True)
        jobs = []
        for src in sources:
            key = hashlib.sha256()
            with open(src, "rb") as f:
                key.update(f.read())
            key.update(hdr.digest())
            key.update(" ".join(flags).encode())
            key.update(version.encode())
            name = os.path.relpath(src, os.path.join(CSRC, "cuda"))[:-3].replace(os.sep, "_")
            obj = os.path.join(outdir, f"{name}-{key.hexdigest()[:16]}.o")
            jobs.append((src, obj))
        todo = [(s, o) for s, o in jobs if not os.path.exists(o)]
        n_jobs = int(os.environ.get("NCP_NVCC_JOBS", os.cpu_count() or 1))

        def compile_one(job):
            src, obj = job
            cmd = [nvcc, "-c", os.path.relpath(src, ROOT), "-o", obj + ".tmp"] + flags
            cmd += ["-Xptxas", "-v"] if verbose else []
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if res.returncode != 0:
                raise RuntimeError(f"nvcc failed on {src}:\n{' '.join(cmd)}\n{res.stdout}\n{res.stderr}")
            serial = _ptxas_check().serialized_wgmma(res.stderr)
            if serial and not _env_flag("NCP_ALLOW_SERIAL_WGMMA"):
                names = "\n  ".join(f"{code} {kernel}" for code, kernel in serial)
                raise RuntimeError(f"ptxas serialized the wgmma of {len(serial)} kernel(s) in {src} (each wgmma then "
                                   f"waits for the previous one; NCP_ALLOW_SERIAL_WGMMA=1 builds anyway):\n  {names}")
            if verbose:
                rep = os.path.join(ROOT, "build", "ncp_ptxas")
                os.makedirs(rep, exist_ok=True)
                with open(os.path.join(rep, os.path.relpath(src, os.path.join(CSRC, "cuda")).replace(os.sep, "_") + ".txt"), "w") as f:
                    f.write(res.stderr)
            os.replace(obj + ".tmp", obj)
            return src

        if todo:
            print(f"nemo_cp_native: nvcc {len(todo)} of {len(jobs)} CUDA files ({n_jobs} jobs)", file=sys.stderr)
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:
                for src in pool.map(compile_one, todo):
                    print(f"  compiled {os.path.relpath(src, ROOT)}", file=sys.stderr)
        return [o for _, o in jobs]


def _hook_pth_line() -> str:
    """The one line of nemo_cp_native_hook.pth, from the hook module itself (torch-free)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ncp_hook_src", os.path.join(ROOT, "nemo_cp_native_hook.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PTH_LINE, mod.PTH_NAME


def _write_hook_pth(directory: str) -> str:
    line, name = _hook_pth_line()
    os.makedirs(directory, exist_ok=True)
    dest = os.path.join(directory, name)
    with open(dest, "w") as f:
        f.write(line)
    return dest


class NcpBuildPy(build_py):
    """Also writes nemo_cp_native_hook.pth at the root of the build, so of the wheel and of
    site-packages (``pip install .``)."""

    def run(self):
        super().run()
        _write_hook_pth(self.build_lib)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, _hook_pth_line()[1])]


CMDCLASS = {"build_ext": NcpBuildExt, "build_py": NcpBuildPy}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - setuptools < 64: `python -m nemo_cp_native_hook install`
    editable_wheel = None
if editable_wheel is not None and hasattr(editable_wheel, "_run_build_commands"):

    class NcpEditableWheel(editable_wheel):
        """``pip install -e .`` (PEP 660): setuptools maps packages and modules to the tree but
        drops files that build_py writes at the root, so put the .pth into the unpacked editable
        wheel itself (everything there is installed into site-packages)."""

        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            _write_hook_pth(str(unpacked_wheel))
            return result

    CMDCLASS["editable_wheel"] = NcpEditableWheel


ext = Extension(
    "nemo_cp_native._C",
    sources=_c_sources(),
    include_dirs=[os.path.join("csrc", "include"), os.path.join("csrc", "core"), os.path.join("csrc", "python")],
    extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"],
    extra_link_args=[],
    define_macros=[],
    libraries=[],
    library_dirs=[],
    extra_objects=[],
)

if sysconfig.get_config_var("CC") is None:  # pragma: no cover - exotic interpreters
    raise RuntimeError("a C compiler is required to build nemo_cp_native")

setup(ext_modules=[ext], cmdclass=CMDCLASS)
