"""Fuzz families for sink attention and Flint (see ``_fuzz_core.py`` for the rules).

- ``sink_attention``: ``ncp.sink_attention`` on the CPU (forward, ``return_lse``, and backward on
  part of the cases) against the float64 oracle ``reference.sink_attention.attention_ref``:
  GQA, zero-length documents, windows; bad dtypes, ranks, shapes, ``cu_seqlens``, windows and
  scales; non-finite q/k/v/sink; head dims and head counts past the old limits; meta tensors.
- ``flint_plan``: ``flint._build_magi_plan`` against ``reference.magi.dispatch`` (local token
  order, padded length, chunk size, per rank); bad ``cu_seqlens``, config fields, groups and
  ``MAGI_ATTENTION_MIN_CHUNKS_PER_RANK`` values.
- ``flint_attention``: ``FlintMagiPlan.attention`` of a single-rank plan against ``attention_ref``
  (pad rows: out = 0), forward and backward; bad windows, shapes, dtypes, scales, NaN, meta.
- ``flint_select``: ``FlintMagiBatchPlans.select`` with every kind of index.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import torch
from _fuzz_core import I32_MAX, Case, odd_scalar, pick, strided_copy

import nemo_cp_native as ncp
from nemo_cp_native import flint, testing
from nemo_cp_native.reference import magi as rmagi
from nemo_cp_native.reference.sink_attention import attention_ref
from nemo_cp_native.reference.tolerance import assert_close_to_ref

ENV = "MAGI_ATTENTION_MIN_CHUNKS_PER_RANK"
NONFINITE = (float("nan"), float("inf"), float("-inf"))


def _docs(rng, total: int, zero_ok: bool = True) -> list[int]:
    cu = [0]
    while cu[-1] < total:
        n = rng.choice((0, 1, 1, 2, 3, 5, 8)) if zero_ok else rng.randint(1, 8)
        cu.append(min(total, cu[-1] + n))
    if zero_ok and rng.random() < 0.2:
        cu.append(cu[-1])  # a trailing empty document
    return cu


def _close(a: torch.Tensor, b: torch.Tensor, name: str, rel: float) -> None:
    """Same dtype/shape, same non-finite entries, finite ones within ``rel`` of the largest."""
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    dtype = a.dtype if a.dtype.is_floating_point else torch.float64
    a, b = a.detach().double(), b.detach().double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name}: NaN at {torch.isnan(a).nonzero()[:4].tolist()} vs {torch.isnan(b).nonzero()[:4].tolist()}"
    inf_a, inf_b = a.masked_fill(fa | torch.isnan(a), 0), b.masked_fill(fb | torch.isnan(b), 0)
    assert torch.equal(inf_a, inf_b), f"{name}: infinite entries differ"
    both = fa & fb
    assert torch.equal(fa, fb), f"{name}: finite entries differ in place"
    rel = max(rel, 8 * torch.finfo(dtype).eps)
    if bool(both.any()):
        scale = float(b[both].abs().max()) + 1.0
        err = float((a[both] - b[both]).abs().max())
        assert err <= rel * scale, f"{name}: max err {err:.3g} > {rel:g} * {scale:.3g}"


def _attn_compare(dtype):
    def compare(nat, orc):
        names = ("out", "lse", "dq", "dk", "dv", "dsink")
        if dtype in (torch.float64,):
            for name, x, y in zip(names, nat, orc):
                if x is not None or y is not None:
                    _close(x, y, name, 1e-9)
            return
        (out, lse), (ref_pair, lp_pair) = nat[:2], orc
        assert_close_to_ref(out, ref_pair[0], lp_pair[0], name="out")
        _close(lse, ref_pair[1], "lse", 1e-3 if dtype == torch.float32 else 3e-2)

    return compare


def gen_sink_attention(rng: random.Random, g: torch.Generator) -> Case:
    T = rng.randint(1, 20)
    hkv, grp, D = pick(rng, (1, 2)), pick(rng, (1, 2, 3)), pick(rng, (1, 3, 8, 16))
    dtype = rng.choices([torch.float64, torch.float32, torch.bfloat16, torch.float16], weights=[70, 20, 5, 5])[0]
    mode = rng.choices(["valid", "nonfinite", "sink_inf", "huge_dim", "bad_shape", "bad_dtype", "bad_cu", "window",
                        "scale", "meta", "strided", "env"],
                       weights=[30, 8, 4, 2, 10, 8, 10, 8, 8, 3, 5, 4])[0]  # fmt: skip
    if mode == "huge_dim":
        T, (hkv, grp, D) = 2, pick(rng, ((1, 1, 1100), (1, 4100, 1), (2, 2050, 2)))
    hq = hkv * grp
    cu = _docs(rng, T)
    q = torch.randn(T, hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(T, hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(T, hkv, D, generator=g, dtype=torch.float64)
    sink = torch.randn(hq, generator=g) if rng.random() < 0.8 else None
    window = pick(rng, (0, 0, 1, 2, 5, I32_MAX))
    scale = None if rng.random() < 0.6 else rng.uniform(0.05, 2.0)
    kind, names, oracle_ok = f"sink_attention/{mode}", ("q", "head_dim", "heads"), True
    backward = dtype == torch.float64 and rng.random() < 0.3
    if mode in ("nonfinite", "sink_inf"):
        dtype, backward = torch.float64, rng.random() < 0.3
        if mode == "sink_inf" or (sink is not None and rng.random() < 0.3):
            sink = torch.randn(hq, generator=g) if sink is None else sink
            sink[rng.randrange(hq)] = pick(rng, NONFINITE)
            kind = "sink_attention/sink_" + ("nan" if bool(torch.isnan(sink).any()) else "inf")
        if mode == "nonfinite":
            for t in rng.sample([q, k, v], rng.randint(1, 2)):
                t.view(-1)[rng.randrange(t.numel())] = pick(rng, NONFINITE)
            if kind == "sink_attention/nonfinite":
                qkv_nan = bool(torch.isnan(torch.cat([q.flatten(), k.flatten(), v.flatten()])).any())
                kind += "_nan" if qkv_nan else "_inf"
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if sink is not None and dtype == torch.float64 and rng.random() < 0.3:
        sink = sink.double()
    cu_t = torch.tensor(cu, dtype=torch.int32)
    args = {"q": q, "k": k, "v": v, "sink": sink, "cu_seqlens": cu_t}
    kw = {"window": window, "scale": scale}
    if mode == "bad_shape":
        what = pick(rng, ("q2d", "q4d", "k_tokens", "heads", "dim", "hkv0", "d0", "kv_shape"))
        args.update({"q2d": {"q": q[:, 0]}, "q4d": {"q": q[None]}, "k_tokens": {"k": k[:-1], "v": v[:-1]},
                     "heads": {"k": k.repeat(1, 2, 1)[:, : hkv + 1], "v": v.repeat(1, 2, 1)[:, : hkv + 1]},
                     "dim": {"k": k[..., :-1] if D > 1 else k.repeat(1, 1, 2)}, "hkv0": {"k": k[:, :0], "v": v[:, :0]},
                     "d0": {"q": q[..., :0], "k": k[..., :0], "v": v[..., :0]},
                     "kv_shape": {"v": v[:, :, :1] if D > 1 else v.repeat(1, 1, 2)}}[what])  # fmt: skip
        names, oracle_ok = ("q", "k", "v", "head", "heads"), what not in ("q2d", "q4d", "hkv0", "d0")
        kind += "/" + what
    elif mode == "bad_dtype":
        what = pick(rng, ("q_int", "q_bool", "k_other", "sink_f64", "sink_int", "q_complex", "sink_shape", "sink_list"))
        fix = {"q_int": {"q": q.to(torch.int32)}, "q_bool": {"q": q > 0}, "q_complex": {"q": q.to(torch.complex64)},
               "k_other": {"k": k.to(torch.float16 if dtype != torch.float16 else torch.float32)},
               "sink_f64": {"sink": torch.zeros(hq, dtype=torch.float64 if dtype != torch.float64 else torch.float16)},
               "sink_int": {"sink": torch.zeros(hq, dtype=torch.int32)}, "sink_shape": {"sink": torch.zeros(hq + 1)},
               "sink_list": {"sink": [0.0] * hq}}[what]  # fmt: skip
        args.update(fix)
        names, oracle_ok, kind = ("q", "k", "v", "sink"), False, kind + "/" + what
    elif mode == "bad_cu":
        what = pick(rng, ("int64", "2d", "empty", "start", "decreasing", "end_short", "end_long", "list", "float"))
        bad = {"int64": cu_t.long(), "2d": cu_t[None], "empty": cu_t[:0], "start": cu_t + 1,
               "decreasing": torch.tensor([0, T, 0, T], dtype=torch.int32),
               "end_short": torch.tensor([0, max(T - 1, 0)], dtype=torch.int32) if T > 1 else torch.tensor([0, 2], dtype=torch.int32),
               "end_long": torch.tensor([0, T + 1], dtype=torch.int32), "list": list(cu), "float": cu_t.float()}[what]  # fmt: skip
        args["cu_seqlens"], names, oracle_ok, kind = bad, ("cu_seqlens",), False, kind + "/" + what
    elif mode == "window":
        kw["window"] = pick(rng, (-1, True, 2**31, 2**63, 1.5, "3", None, -(2**63)))
        names, kind = ("window",), kind + ("/huge" if isinstance(kw["window"], int) and kw["window"] >= 2**31 else "")
        oracle_ok = isinstance(kw["window"], int) and not isinstance(kw["window"], bool) and kw["window"] >= 0
    elif mode == "scale":
        kw["scale"] = pick(rng, (True, False, float("nan"), float("inf"), -float("inf"), "1", 0.0, -1.0, 1e300, 2**1000))
        if kw["scale"] in (1e300, 2**1000):  # infinite scores: compared in float64, like the non-finite cases
            q, k, v = (t.double() for t in (q, k, v))
            args.update(q=q, k=k, v=v)
            dtype = torch.float64
        names = ("scale",)
        oracle_ok = isinstance(kw["scale"], (int, float)) and not isinstance(kw["scale"], bool) and math.isfinite(kw["scale"])
        kind += "/" + ("bool" if isinstance(kw["scale"], bool) else "huge" if kw["scale"] in (1e300, 2**1000) else "value")
    elif mode == "meta":
        args = {k_: (t.to("meta") if isinstance(t, torch.Tensor) else t) for k_, t in args.items()}
        names, oracle_ok = ("q", "k", "v", "sink", "cu_seqlens"), False
    elif mode == "strided":
        args.update({n: strided_copy(args[n], rng) for n in ("q", "k", "v") if rng.random() < 0.7})
    desc = (f"{mode} T={T} hq={hq} hkv={hkv} D={D} {dtype} cu={cu} window={kw['window']!r} scale={kw['scale']!r} "
            f"sink={None if sink is None else sink.tolist()[:4]} bwd={backward} "
            f"shapes={[tuple(getattr(t, 'shape', ())) for t in args.values()]}")  # fmt: skip
    dout = torch.randn(T, hq, D, generator=g, dtype=torch.float64).to(dtype)

    def run(fn, x):
        leaves = [x[n].detach().requires_grad_() if backward and isinstance(x[n], torch.Tensor) and x[n].is_floating_point()
                  and x[n].device.type != "meta" else x[n] for n in ("q", "k", "v", "sink")]  # fmt: skip
        out, lse = fn(*leaves, x["cu_seqlens"], **kw)
        if not backward:
            return out, lse
        want = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = torch.autograd.grad(out, want, dout.to(out.dtype))
        it = iter(grads)
        return (out, lse, *[next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves])

    native = lambda: run(lambda *a, **k_: ncp.sink_attention(*a, return_lse=True, **k_), args)  # noqa: E731
    if not oracle_ok:
        return Case(kind, desc, native, None, names=names)

    def ref(*a, window, scale):  # a window past every document is the unbounded window
        return attention_ref(*(t.double() if isinstance(t, torch.Tensor) else t for t in a[:4]), a[4],
                             window=window if window <= T else 0, scale=scale)

    def oracle():
        r = run(ref, args)
        if dtype == torch.float64:
            return tuple(t if t is None else t for t in r)
        lp = attention_ref(*(args[n] for n in ("q", "k", "v", "sink")), args["cu_seqlens"], upcast=False,
                           window=kw["window"] if kw["window"] <= T else 0, scale=kw["scale"])
        return r[:2], lp

    env = {"NCP_DETERMINISTIC": pick(rng, ("1", "0", "abc", ""))} if mode == "env" else None
    return Case(kind, desc, native, oracle, names=names, compare=_attn_compare(dtype), env=env,
                allow_reject=mode in ("window", "scale", "huge_dim") and kind != "sink_attention/scale/bool")  # fmt: skip


# =============================================================================================
# Flint
# =============================================================================================


def _config(rng, window, chunk, hq=4, hkv=2, d=8, odd=False):
    fields = {"num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": d, "sliding_window": window,
              "magi_chunk_size": chunk}  # fmt: skip
    bad = None
    if odd:
        bad = pick(rng, list(fields))
        fields[bad] = odd_scalar(rng, fields[bad]) if rng.random() < 0.8 else "<missing>"
        if fields[bad] == "<missing>":
            del fields[bad]
    return SimpleNamespace(**fields), bad


def _plan_summary(plan, rank):
    return {w: (k.total_seqlen, k.total_seqlen_q, k.chunk_size, k.cp_size, k.cp_rank,
                k.local_token_global_indices.tolist()) for w, k in sorted(plan.keys.items())}  # fmt: skip


def gen_flint_plan(rng: random.Random, g: torch.Generator) -> Case:
    cp = pick(rng, (1, 2, 3, 4, 8))
    rank = rng.randrange(cp)
    lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 5))]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    window = pick(rng, (0, 1, 7, 64, 513))
    chunk = pick(rng, (1, 3, 16, 64, 128, 512, 100_000, None))
    mode = rng.choices(["valid", "cu", "config", "group", "env", "huge", "meta"], weights=[35, 20, 20, 10, 10, 3, 2])[0]
    env_val = None if rng.random() < 0.7 else pick(rng, ("1", "2", "8", "16"))
    cfg, bad_field = _config(rng, window, chunk, odd=mode == "config")
    group = None if cp == 1 and rng.random() < 0.5 else testing.SimulatedGroup(cp, rank)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    names, kind, allow_reject = ("cu_seqlens", "cp_size"), f"flint_plan/{mode}", False  # a pack too short for cp
    if mode == "cu":
        what = pick(rng, ("int64", "2d", "list", "start", "decreasing", "zero_len", "one", "negative", "strided"))
        cu_t = {"int64": cu_t.long(), "2d": cu_t[None], "list": cu, "start": cu_t + 1,
                "decreasing": torch.tensor(cu + [cu[-1] - 1], dtype=torch.int32), "one": cu_t[:1],
                "zero_len": torch.tensor(cu + [cu[-1]], dtype=torch.int32), "negative": torch.tensor([0, -5], dtype=torch.int32),
                "strided": strided_copy(cu_t, rng)}[what]  # fmt: skip
        kind += "/" + what
        allow_reject = what == "zero_len"  # Magi accepts empty documents; the native plan refuses them, by name
    elif mode == "huge":  # 2**31 - 1 is prime: padded to chunk * cp it passes int32 and must be refused
        cu_t = torch.tensor([0, I32_MAX], dtype=torch.int32)  # (a pack that fits, e.g. 2**31 - 2 tokens with
        cfg.magi_chunk_size = pick(rng, (2, 16, 512, None))  # chunk 3 and cp 3, is the CP-speed issue's)
    elif mode == "meta":
        cu_t = cu_t.to("meta")
    elif mode == "group":
        group = pick(rng, (testing.SimulatedGroup(0, 0), testing.SimulatedGroup(2, 2), testing.SimulatedGroup(2, -1),
                           testing.SimulatedGroup(2**40, 0), SimpleNamespace(size=lambda: 1.5, rank=lambda: 0),
                           object(), "cp"))  # fmt: skip
        names = ("group", "cp_size")
    elif mode == "env":
        env_val = pick(rng, ("abc", "", " 8 ", "1e3", "-1", "0", str(2**63), "8.0", "3"))
        names = (ENV, "cp_size")
    elif mode == "config":
        names = (bad_field, "cp_size")
        value = getattr(cfg, bad_field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > I32_MAX:
            kind = "flint_plan/config_huge"
    env = {ENV: env_val}
    desc = f"{mode} cu={getattr(cu_t, 'tolist', lambda: cu_t)() if mode != 'meta' else cu} cp={cp} rank={rank} " \
           f"group={group!r} cfg={vars(cfg)} {ENV}={env_val!r}"  # fmt: skip
    native = lambda: _plan_summary(flint._build_magi_plan(cu_t, cfg, group), rank)  # noqa: E731

    def oracle():
        if mode in ("group", "meta", "huge") or (mode == "cu" and kind.endswith(("int64", "2d", "list", "one", "negative"))):
            raise ValueError("the native plan must refuse this input")
        mcr = int(env_val.strip()) if env_val not in (None,) and env_val.strip().lstrip("-").isdigit() else None
        if env_val is not None and mcr is None:
            raise ValueError(f"{ENV}={env_val!r} is not an integer")
        get = lambda n, dflt=None: getattr(cfg, n, dflt)  # noqa: E731
        for n in ("num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "magi_chunk_size"):
            x = get(n, 0 if n == "sliding_window" else (512 if n == "magi_chunk_size" else None))
            if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
                raise ValueError(f"config.{n}")
        hq, hkv, d = get("num_attention_heads"), get("num_key_value_heads"), get("head_dim")
        if not hq or not hkv or not d or hq % hkv or get("magi_chunk_size", 512) == 0:
            raise ValueError("config heads")
        w = get("sliding_window", 0) or 0
        c = get("magi_chunk_size", 512)
        ref = rmagi.dispatch(cu_t, cp, 512 if c is None else c, 8 if mcr is None else mcr)
        keys = (0, w) if w > 0 else (0,)
        idx = ref.local_token_global_indices(rank).tolist()
        return {k: (ref.total_seqlen, ref.total_seqlen_padded, ref.chunk_size, cp, rank, idx) for k in keys}

    if mode == "config" and bad_field in ("sliding_window", "num_attention_heads", "num_key_value_heads", "head_dim",
                                          "magi_chunk_size"):  # fmt: skip
        allow_reject = True  # huge but valid values may be refused, by name
    if mode == "env" and env_val not in ("3",):
        allow_reject = True  # odd but parseable values may be refused, by name
    return Case(kind, desc, native, oracle, names=names, env=env, allow_reject=allow_reject)


_PLAN_CACHE: dict = {}


def _single_plan(rng, window, hq, hkv, d, T):
    key = (window, hq, hkv, d, T)
    if key not in _PLAN_CACHE:
        cu = _docs(rng, T, zero_ok=False)
        cfg, _ = _config(rng, window, pick(rng, (4, 8, 512)), hq, hkv, d)
        _PLAN_CACHE[key] = (flint._build_magi_plan(torch.tensor(cu, dtype=torch.int32), cfg, None), cu)
    return _PLAN_CACHE[key]


def gen_flint_attention(rng: random.Random, g: torch.Generator) -> Case:
    hkv, grp, d = pick(rng, (1, 2)), pick(rng, (1, 2)), pick(rng, (4, 8))
    hq, window, T = hkv * grp, pick(rng, (0, 3, 16)), rng.randint(4, 40)
    plan, cu = _single_plan(rng, window, hq, hkv, d, T)
    L = plan.keys[0].num_local_tokens
    dtype = pick(rng, (torch.float64, torch.float64, torch.float32))
    q = torch.randn(L, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(L, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(L, hkv, d, generator=g, dtype=torch.float64).to(dtype)
    sink = torch.randn(hq, generator=g)
    w, scale = pick(rng, list(plan.keys)), rng.uniform(0.1, 1.0)
    mode = rng.choices(["valid", "window", "shape", "dtype", "scale", "nonfinite", "meta"], weights=[40, 12, 12, 10, 10, 10, 4])[0]
    names, oracle_ok, kind, backward = ("query",), True, f"flint_attention/{mode}", rng.random() < 0.3
    x = {"query": q, "key": k, "value": v, "sink": sink}
    if mode == "window":
        w = pick(rng, (7, True, "16", None, 2**63, -1, 1.5))
        names, oracle_ok = ("window",), False
    elif mode == "shape":
        what = pick(rng, ("q_short", "q_heads", "k_heads", "v_dim", "sink_shape", "q_2d"))
        x.update({"q_short": {"query": q[1:]}, "q_heads": {"query": q.repeat(1, 2, 1)},
                  "k_heads": {"key": k.repeat(1, 2, 1)}, "v_dim": {"value": v[..., :-1]},
                  "sink_shape": {"sink": sink[:-1] if hq > 1 else torch.zeros(2)}, "q_2d": {"query": q[:, 0]}}[what])  # fmt: skip
        names, oracle_ok, kind = ("query", "key", "value", "sink"), False, kind + "/" + what
    elif mode == "dtype":
        what = pick(rng, ("k_other", "sink_f64", "q_int", "sink_list"))
        x.update({"k_other": {"key": k.half()}, "sink_f64": {"sink": sink.double()}, "q_int": {"query": q.long()},
                  "sink_list": {"sink": sink.tolist()}}[what])  # fmt: skip
        names, oracle_ok, kind = ("query", "key", "value", "sink"), False, kind + "/" + what
    elif mode == "scale":
        scale = pick(rng, (True, float("nan"), float("inf"), "1", None))
        names, oracle_ok = ("scale",), False
        kind += "/" + ("bool" if isinstance(scale, bool) else "value")
    elif mode == "nonfinite":
        dtype = torch.float64
        x = {n: t.double() if n != "sink" else t for n, t in x.items()}
        t = x[pick(rng, ("query", "key", "value", "sink"))]
        t.view(-1)[rng.randrange(t.numel())] = pick(rng, (float("nan"), float("nan"), float("inf"), float("-inf")))
    elif mode == "meta":
        x = {n: t.to("meta") for n, t in x.items()}
        oracle_ok, backward = False, False
    desc = f"{mode} cu={cu} L={L} hq={hq} hkv={hkv} d={d} {dtype} window={w!r} scale={scale!r} bwd={backward} " \
           f"shapes={[tuple(getattr(t, 'shape', ())) for t in x.values()]}"  # fmt: skip
    Tr = cu[-1]
    dout = torch.randn(L, hq, d, generator=g, dtype=torch.float64)

    def run(fn):
        leaves = [x[n].detach().requires_grad_() if backward and isinstance(x[n], torch.Tensor) and x[n].is_floating_point()
                  and x[n].device.type != "meta" else x[n] for n in ("query", "key", "value", "sink")]  # fmt: skip
        out = fn(*leaves)
        if not backward:
            return (out,)
        return (out, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))

    native = lambda: run(lambda *a: plan.attention(*a, w, scale))  # noqa: E731
    if not oracle_ok:
        return Case(kind, desc, native, None, names=names)

    def ref_fn(q_, k_, v_, s_):
        o, _ = attention_ref(q_[:Tr].double(), k_[:Tr].double(), v_[:Tr].double(), s_, torch.tensor(cu, dtype=torch.int32),
                             window=w, scale=scale)  # fmt: skip
        return torch.cat([o, torch.zeros(L - Tr, hq, d, dtype=o.dtype)]).to(q_.dtype)

    def compare(nat, orc):
        for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), nat, orc):
            _close(a, b, name, 1e-9 if dtype == torch.float64 else 2e-5)

    return Case(kind, desc, native, lambda: run(ref_fn), names=names, compare=compare)


def gen_flint_select(rng: random.Random, g: torch.Generator) -> Case:
    n = rng.randint(1, 4)
    plans = tuple(_single_plan(rng, 0, 2, 1, 4, 8 + i)[0] for i in range(n))
    bp = flint.FlintMagiBatchPlans(plans=plans)
    i = rng.randrange(n)
    mode = rng.choices(["valid", "dtype", "shape", "range", "type", "meta"], weights=[35, 15, 15, 15, 12, 8])[0]
    idx = {"valid": lambda: pick(rng, (torch.tensor([i]), torch.tensor(i), torch.arange(n)[i : i + 1], torch.tensor([[i]]))),
           "dtype": lambda: torch.tensor([i], dtype=pick(rng, (torch.int32, torch.uint8, torch.bool, torch.float32, torch.int16))),
           "shape": lambda: pick(rng, (torch.tensor([i, i]), torch.empty(0, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))),
           "range": lambda: torch.tensor([pick(rng, (n, n + 1, -1, -n - 1, 2**63 - 1, -(2**63)))]),
           "type": lambda: pick(rng, (i, None, [i], 1.0, "0")),
           "meta": lambda: torch.tensor([i], device="meta")}[mode]()  # fmt: skip
    desc = f"{mode} n={n} index={idx!r}"
    oracle = (lambda: plans[int(idx.reshape(()).item())]) if mode == "valid" else None
    return Case(f"flint_select/{mode}", desc, lambda: bp.select(idx), oracle, names=("microbatch_index",),
                compare=_identical)  # fmt: skip


def _identical(a, b) -> None:
    assert a is b, f"{a!r} is not {b!r}"


FAMILIES = {
    "sink_attention": gen_sink_attention,
    "flint_plan": gen_flint_plan,
    "flint_attention": gen_flint_attention,
    "flint_select": gen_flint_select,
}
