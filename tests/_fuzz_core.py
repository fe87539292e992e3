"""The fuzz harness of ``tests/test_fuzz.py``: cases, the outcome rule, and the subprocess worker.

A *family* is a function ``gen(rng: random.Random, g: torch.Generator) -> Case`` that draws one
case for one public entry point. Case ``i`` of family ``f`` under seed ``s`` is drawn from
``random.Random(f"{s}:{f}:{i}")`` alone, so any case replays from ``(seed, family, index)``:

    python tests/_fuzz_worker.py --seed S --case thd:123      # run one case in-process, verbose

Outcome rule (``check``): the native call must

- equal the oracle's result (``compare``, default: exact equality of nested containers, dtypes,
  shapes and devices, NaN equal to NaN, meta tensors compared by dtype/shape/device), or
- when the oracle raises (or there is no oracle): raise a *clear* error, i.e. ValueError,
  TypeError or NotImplementedError whose message names one of the case's argument ``names``; or,
  for drop-in names (``errors="same"``), exactly the oracle's exception type and message.

The worker (``main``) runs ranges of cases, writes one JSON line per case to a file (a "begin"
line with the case's kind and description, then the result), with ``faulthandler`` on and a
per-case timeout that dumps the stacks and exits. A case that kills the process therefore is the
last "begin" line without a result; the parent reports it and restarts the worker after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import math
import os
import random
import re
import time
import traceback
from typing import Any, Callable

import torch

CLEAR = (ValueError, TypeError, NotImplementedError)
CASE_TIMEOUT_S = float(os.environ.get("NCP_FUZZ_CASE_TIMEOUT", "30"))


@dataclasses.dataclass
class Case:
    kind: str  # "<family>/<what is odd about it>", the unit of known-issue marks
    desc: str  # the inputs, one line
    native: Callable[[], Any]
    oracle: Callable[[], Any] | None = None  # None: a clear error naming `names` is required
    names: tuple = ()  # what a clear error may name (argument, field or environment variable)
    errors: str = "clear"  # oracle raised: a "clear" error, the "same" type and message, or "same_or_clear"
    compare: Callable[[Any, Any], None] | None = None  # raise AssertionError when they differ
    env: dict | None = None  # environment around both calls; a None value unsets the variable
    ctx: Callable[[], Any] | None = None  # context manager factory around both calls
    allow_reject: bool = False  # a clear error is also fine where the oracle returns


# ---------------------------------------------------------------------------------------------
# outcomes
# ---------------------------------------------------------------------------------------------


def _call(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - classified by check()
        return "err", exc


def _exc_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:400]}"


def is_clear(exc: BaseException, names) -> bool:
    """A ValueError/TypeError/NotImplementedError whose message names one of ``names`` as a word
    (``k`` must not match inside ``sink``)."""
    msg = str(exc)
    return isinstance(exc, CLEAR) and any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", msg)
                                          for n in names if n)  # fmt: skip


def same(a, b, path: str = "out") -> None:
    """Exact equality of nested results (NaN == NaN; meta tensors by dtype, shape and device)."""
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, tuple(a.shape), a.device) == (b.dtype, tuple(b.shape), b.device), (
            f"{path}: {a.dtype} {tuple(a.shape)} {a.device} != {b.dtype} {tuple(b.shape)} {b.device}"
        )
        if a.device.type == "meta":
            return
        if a.is_floating_point() or a.is_complex():
            nan_a, nan_b = torch.isnan(a), torch.isnan(b)
            assert torch.equal(nan_a, nan_b), f"{path}: NaN positions differ"
            a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
        assert torch.equal(a, b), f"{path}: values differ\n{a.flatten()[:16]}\n{b.flatten()[:16]}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{path}: nan != {b!r}"
    elif isinstance(a, type) or callable(a):
        assert a is b, f"{path}: {a!r} is not {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@contextlib.contextmanager
def environment(env: dict | None):
    saved = {k: os.environ.get(k) for k in (env or {})}
    try:
        for k, v in (env or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check(case: Case) -> str | None:
    """None when the case's outcome is acceptable, else what went wrong."""
    with environment(case.env), (case.ctx() if case.ctx else contextlib.nullcontext()):
        nat = _call(case.native)
        orc = _call(case.oracle) if case.oracle is not None else None
    names = case.names
    if orc is None or orc[0] == "err":
        if nat[0] != "err":
            why = "no error" if orc is None else f"oracle raised {_exc_text(orc[1])}"
            return f"expected a clear error naming one of {list(names)} ({why}); native returned"
        if orc is not None and case.errors in ("same", "same_or_clear"):
            if type(nat[1]) is type(orc[1]) and str(nat[1]) == str(orc[1]):
                return None
            if case.errors == "same":
                return f"error differs from the oracle's\n native: {_exc_text(nat[1])}\n oracle: {_exc_text(orc[1])}"
        if not is_clear(nat[1], names):
            return f"unclear error (want ValueError/TypeError/NotImplementedError naming one of {list(names)}): {_exc_text(nat[1])}"
        return None
    if nat[0] == "err":
        if case.allow_reject and is_clear(nat[1], names):
            return None
        return f"native raised where the oracle returned: {_exc_text(nat[1])}"
    try:
        (case.compare or same)(nat[1], orc[1])
    except AssertionError as exc:
        return f"result differs from the oracle: {str(exc)[:600]}"
    return None


# ---------------------------------------------------------------------------------------------
# families and the worker
# ---------------------------------------------------------------------------------------------


def families() -> dict:
    """name -> generator, in a fixed order (imports the heavy family modules)."""
    import _fuzz_attn
    import _fuzz_thd_mimo

    return {**_fuzz_thd_mimo.FAMILIES, **_fuzz_attn.FAMILIES}


def draw(fams: dict, seed: int, family: str, index: int) -> Case:
    rng = random.Random(f"{seed}:{family}:{index}")
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    return fams[family](rng, g)


def run_one(fams: dict, seed: int, family: str, index: int) -> tuple[Case | None, str | None]:
    """Draw and check one case: ``(case or None, None when fine else what failed)``."""
    try:
        case = draw(fams, seed, family, index)
    except Exception:  # noqa: BLE001 - a generator bug is a failure too
        return None, "case generator raised:\n" + traceback.format_exc()[-1500:]
    return case, check_safely(case)


def check_safely(case: Case) -> str | None:
    try:
        return check(case)
    except Exception:  # noqa: BLE001 - a comparison crashed
        return "checking raised:\n" + traceback.format_exc()[-1500:]


def _plan(text: str) -> list[tuple[str, int, int]]:
    out = []
    for part in filter(None, text.split(",")):
        fam, start, count = part.split(":")
        out.append((fam, int(start), int(count)))
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=int(os.environ.get("NCP_FUZZ_SEED", "0")))
    ap.add_argument("--plan", default="", help="family:start:count,...")
    ap.add_argument("--out", help="JSON lines file (appended)")
    ap.add_argument("--case", help="family:index: run one case here and print it")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    fams = families()
    if args.case:
        fam, index = args.case.split(":")
        case, err = run_one(fams, args.seed, fam, int(index))
        print(f"NCP_FUZZ_SEED={args.seed} {fam}:{index} [{case.kind if case else '?'}] {case.desc if case else ''}")
        print("OK" if err is None else f"FAIL: {err}")
        return 0 if err is None else 1
    faulthandler.enable()
    crash_at = os.environ.get("NCP_FUZZ_SELFTEST_CRASH")  # "family:index": test_fuzz's harness self-test
    with open(args.out, "a") as f:
        for fam, start, count in _plan(args.plan):
            for i in range(start, start + count):
                t0 = time.perf_counter()
                case, err = None, None
                try:
                    case = draw(fams, args.seed, fam, i)
                except Exception:  # noqa: BLE001 - a generator bug is a failure too
                    err = "case generator raised:\n" + traceback.format_exc()[-1500:]
                kind, desc = (case.kind, case.desc) if case else (f"{fam}/generator", "?")
                f.write(json.dumps({"b": [fam, i], "k": kind, "d": desc[:300]}) + "\n")
                f.flush()
                if crash_at == f"{fam}:{i}":
                    faulthandler._sigsegv()
                if case is not None:
                    faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
                    err = check_safely(case)
                    faulthandler.cancel_dump_traceback_later()
                rec = {"f": fam, "i": i, "k": kind, "t": round(time.perf_counter() - t0, 4)}
                if err is not None:
                    rec.update(d=desc[:300], e=err[:2000])
                f.write(json.dumps(rec) + "\n")
                f.flush()
        f.write(json.dumps({"done": True}) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# value pools shared by the families
# ---------------------------------------------------------------------------------------------

I32_MAX, I64_MAX = 2**31 - 1, 2**63 - 1
EXTREME_INTS = (0, 1, -1, 2, 3, 7, 2**15, 2**30, I32_MAX, 2**31, 2**32, 2**62, I64_MAX, 2**63, 2**64, -(2**31),
                -(2**31) - 1, -(2**63), -(2**63) - 1, 10**30)  # fmt: skip
NON_INTS = (None, 1.0, 2.5, "2", b"2", [2], float("nan"), float("inf"), 1j, object())


def pick(rng: random.Random, seq):
    return seq[rng.randrange(len(seq))]


def odd_scalar(rng: random.Random, good: int):
    """``good`` most of the time, else an extreme int, a bool, a numpy / 0-d tensor int, or a non-int."""
    import numpy as np

    r = rng.random()
    if r < 0.45:
        return good
    if r < 0.75:
        return pick(rng, EXTREME_INTS)
    if r < 0.82:
        return pick(rng, (True, False))
    if r < 0.88 and isinstance(good, int):
        return pick(rng, (np.int64(good), np.int32(good), torch.tensor(good), torch.tensor([good])))
    return pick(rng, NON_INTS)


def strided_copy(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """Same values as ``t`` in a non-contiguous view (every other element of a wider buffer)."""
    if t.ndim == 0 or t.numel() == 0:
        return t
    junk = float("nan") if t.dtype.is_floating_point else (True if t.dtype == torch.bool else pick(rng, (0, 1, -7)))
    wide = torch.full((*t.shape[:-1], t.shape[-1] * 2), junk, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]
