"""Fuzz families for the partition and the MiMo sharder (see ``_fuzz_core.py`` for the rules).

- ``thd``: ``ncp.thd_partition_indices`` against the TE oracle (``reference.te_partition``), any
  boundaries with ``validate=False``; with ``validate=True`` exactly the layouts a validator
  should accept; bad dtypes, ranks, devices (meta), strides, scalars near the int32/int64 limits,
  non-int scalars, sizes that must be refused before allocating.
- ``mimo``: ``ncp.mimo.shard_batch_for_mimo_te`` against ``reference.mimo`` (a drop-in: same
  result, or the same exception type and message) on mutated packed batches: sentinels, extreme
  lengths, dtypes, strides, missing keys, odd media ids and chunk counts, fake CP ranks.
- ``mimo_helpers``: ``_chunk_partition_indices``, ``_media_mask``, ``_flatten_chunks`` the same way.
Meta tensors must give a clear error naming the argument wherever the oracle cannot compute.
"""

from __future__ import annotations

import contextlib
import operator
import random

import torch
from _fuzz_core import EXTREME_INTS, I32_MAX, Case, odd_scalar, pick, strided_copy
from _mesh import FakeCPMesh, fake_dist
from _upstream import case_meshes, draw_case

import nemo_cp_native as ncp
from nemo_cp_native import mimo as nat
from nemo_cp_native.reference import mimo as ref
from nemo_cp_native.reference import te_partition as te

I64_INTS = tuple(v for v in EXTREME_INTS if -(2**63) <= v < 2**63)
I32_INTS = tuple(v for v in EXTREME_INTS if -(2**31) <= v < 2**31)


# =============================================================================================
# thd_partition_indices
# =============================================================================================


def _wrap32(x: int) -> int:
    return (x + 2**31) % 2**32 - 2**31


def _te_oracle(cu: list[int], total: int, cp: int, rank: int) -> torch.Tensor:
    """The oracle's loop (reference.te_partition), its int64 results cast to int32 as C does."""
    te._check_args(torch.tensor(cu, dtype=torch.int32) if cu else torch.empty(0, dtype=torch.int32), total, cp, rank)
    cs = [te._c_div(v, cp) for v in cu]
    out = []
    for t in range(total // cp):
        s = te._find_document(t, cs)
        half = te._c_div(cs[s + 1] - cs[s], 2)
        off = rank if t - cs[s] < half else 2 * cp - 2 - rank
        out.append(_wrap32(t - cs[s] + cs[s] * cp + half * off))
    return torch.tensor(out, dtype=torch.int32)


def _valid_cu(rng, cp, max_docs=6, max_units=4):
    cu = [0]
    for _ in range(rng.randint(1, max_docs)):
        cu.append(cu[-1] + 2 * cp * rng.randint(0, max_units))
    return cu


def _validate_error(cu: list[int], total: int, cp: int) -> bool:
    """What ``validate=True`` must reject (besides the scalar checks)."""
    if len(cu) < 2 or cu[0] < 0 or cu[-1] > total:
        return True
    return any(b < a or (b - a) % (2 * cp) for a, b in zip(cu, cu[1:]))


def _scalar_problem(total, cp, rank) -> tuple[str, ...]:
    """Names of the scalar arguments the native call must refuse (empty: all fine)."""
    bad = []
    try:
        total, cp, rank = (operator.index(x) for x in (total, cp, rank))
    except TypeError:
        for name, x in (("total_tokens", total), ("cp_size", cp), ("cp_rank", rank)):
            try:
                operator.index(x)
            except TypeError:
                bad.append(name)
        return tuple(bad)
    if cp <= 0 or cp > I32_MAX:
        return ("cp_size",)
    if not 0 <= rank < cp:
        return ("cp_rank",)
    if total <= 0 or total % (2 * cp) or total // cp > I32_MAX:
        return ("total_tokens",)
    return ()


def gen_thd(rng: random.Random, g: torch.Generator) -> Case:
    cp = pick(rng, (1, 2, 3, 4, 8))
    rank = rng.randrange(cp)
    mode = rng.choices(["valid", "garbage", "extreme", "dtype", "scalars", "strided", "meta", "short"],
                       weights=[20, 20, 10, 8, 25, 7, 4, 6])[0]  # fmt: skip
    validate = rng.random() < 0.5
    cu = _valid_cu(rng, cp)
    total = max(cu[-1], 2 * cp) + 2 * cp * rng.choice((0, 0, 1, 3))
    desc = lambda c, t, w, r, v: f"cu={c} total={t!r} cp={w!r} rank={r!r} validate={v}"  # noqa: E731
    if mode in ("garbage", "extreme", "short"):
        if mode == "garbage":
            cu = [rng.randint(-40, 120) for _ in range(rng.randint(0, 7))]
        elif mode == "extreme":
            cu = [pick(rng, I32_INTS + (0, 0, 8, 16)) for _ in range(rng.randint(1, 6))]
        else:
            total = 2 * cp * rng.randint(1, max(1, cu[-1] // (2 * cp)))  # documents past total_tokens
        t = torch.tensor(cu, dtype=torch.int32)
        if not validate:
            return Case(f"thd/{mode}", desc(cu, total, cp, rank, validate),
                        lambda: ncp.thd_partition_indices(t, total, cp, rank, validate=False),
                        (lambda: _te_oracle(cu, total, cp, rank)), names=("cu_seqlens",))  # fmt: skip
        oracle = None if _validate_error(cu, total, cp) else (lambda: _te_oracle(cu, total, cp, rank))
        return Case(f"thd/{mode}_validate", desc(cu, total, cp, rank, validate),
                    lambda: ncp.thd_partition_indices(t, total, cp, rank), oracle, names=("cu_seqlens",))  # fmt: skip
    if mode == "dtype":
        dt = pick(rng, (torch.int64, torch.int16, torch.uint8, torch.float32, torch.float64, torch.bool))
        bad = pick(rng, ("dtype", "dtype", "ndim0", "ndim2", "list", "numpy", "none"))
        import numpy as np

        t = {"dtype": lambda: torch.tensor(cu).to(dt), "ndim0": lambda: torch.tensor(cu[-1], dtype=torch.int32),
             "ndim2": lambda: torch.tensor([cu], dtype=torch.int32), "list": lambda: list(cu),
             "numpy": lambda: np.array(cu, dtype=np.int32), "none": lambda: None}[bad]()  # fmt: skip
        return Case("thd/dtype", f"{bad} {dt} {desc(cu, total, cp, rank, validate)}",
                    lambda: ncp.thd_partition_indices(t, total, cp, rank, validate=validate), names=("cu_seqlens",))
    if mode == "meta":
        t = torch.tensor(cu, dtype=torch.int32, device="meta")
        return Case("thd/meta", desc(cu, total, cp, rank, validate),
                    lambda: ncp.thd_partition_indices(t, total, cp, rank, validate=validate), names=("cu_seqlens",))
    if mode == "strided":
        t = strided_copy(torch.tensor(cu, dtype=torch.int32), rng)
        if rng.random() < 0.3:
            t, cu = torch.zeros(1, dtype=torch.int32).expand(len(cu)), [0] * len(cu)  # stride 0
        return Case("thd/strided", f"stride={t.stride()} {desc(cu, total, cp, rank, validate)}",
                    lambda: ncp.thd_partition_indices(t, total, cp, rank, validate=validate),
                    lambda: _te_oracle(cu, total, cp, rank))  # fmt: skip
    if mode == "scalars":
        total, cp_arg, rank_arg = odd_scalar(rng, total), odd_scalar(rng, cp), odd_scalar(rng, rank)
        bad = _scalar_problem(total, cp_arg, rank_arg)
        t = torch.tensor(cu, dtype=torch.int32)
        oracle = None
        if not bad:
            tt, cc, rr = (operator.index(x) for x in (total, cp_arg, rank_arg))
            if tt // cc > 4096:  # fine for the native call, too slow for the Python oracle: shrink
                total = tt = 2 * cc * rng.randint(1, 4)
            if validate and _validate_error(cu, tt, cc):
                bad = ("cu_seqlens",)
            else:
                oracle = lambda: _te_oracle(cu, tt, cc, rr)  # noqa: E731
        return Case("thd/scalars", desc(cu, total, cp_arg, rank_arg, validate),
                    lambda: ncp.thd_partition_indices(t, total, cp_arg, rank_arg, validate=validate), oracle,
                    names=bad)  # fmt: skip
    t = torch.tensor(cu, dtype=torch.int32)
    return Case("thd/valid", desc(cu, total, cp, rank, validate),
                lambda: ncp.thd_partition_indices(t, total, cp, rank, validate=validate),
                lambda: _te_oracle(cu, total, cp, rank))  # fmt: skip


# =============================================================================================
# MiMo sharder
# =============================================================================================

_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")


def _poke(t: torch.Tensor, rng, values) -> torch.Tensor:
    """A copy of integer tensor ``t`` with one to three entries replaced from ``values``."""
    t = t.clone()
    if t.numel():
        info = torch.iinfo(t.dtype)
        for _ in range(rng.randint(1, 3)):
            v = pick(rng, values)
            t.view(-1)[rng.randrange(t.numel())] = min(max(v, info.min), info.max)
    return t


def _mutate_batch(batch: dict, opts: dict, rng) -> tuple[str, str]:
    """Apply one mutation in place; returns (kind suffix, description)."""
    m = rng.choices(["none", "lens_extreme", "padded_extreme", "sentinel", "dtype", "position", "drop", "format",
                     "strided", "media", "padding", "chunks", "extra", "empty", "loss_mask"],
                    weights=[14, 12, 12, 6, 8, 6, 5, 3, 6, 8, 4, 6, 4, 3, 3])[0]  # fmt: skip
    lens_values = I64_INTS + (-1000, 0, 1, 2, 4, 8, 16, 1 << 20)
    if m == "lens_extreme" and isinstance(batch.get("seq_lens"), torch.Tensor):
        batch["seq_lens"] = _poke(batch["seq_lens"], rng, lens_values)
    elif m == "padded_extreme" and isinstance(batch.get("seq_lens_padded"), torch.Tensor):
        batch["seq_lens_padded"] = _poke(batch["seq_lens_padded"], rng, lens_values)
    elif m == "sentinel":
        key = pick(rng, ("seq_lens", "seq_lens_padded"))
        batch[key] = _poke(batch[key], rng, (-1000, -999, -1001, -1))
    elif m == "dtype":
        key = pick(rng, _TOKEN_KEYS)
        dt = pick(rng, (torch.int32, torch.int16, torch.float32, torch.bool, torch.uint8))
        if isinstance(batch.get(key), torch.Tensor):
            batch[key] = batch[key].to(dt)
        return "dtype", f"{key}->{dt}"
    elif m == "position":
        how = pick(rng, ("none", "3d", "1d"))
        p = batch.get("position_ids")
        if isinstance(p, torch.Tensor):
            batch["position_ids"] = {"none": None, "3d": p[None].expand(3, *p.shape).contiguous(), "1d": p.reshape(-1)}[how]
        return "position", how
    elif m == "drop":
        key = pick(rng, _TOKEN_KEYS)
        batch.pop(key, None)
        return "drop", key
    elif m == "format":
        batch["qkv_format"] = pick(rng, ("bshd", None, "THD"))
    elif m == "strided":
        for key in _TOKEN_KEYS:
            if isinstance(batch.get(key), torch.Tensor) and rng.random() < 0.6:
                batch[key] = strided_copy(batch[key], rng)
    elif m == "media":
        for key in ("image_token_id", "video_token_id"):
            if rng.random() < 0.6:
                opts[key] = pick(rng, I64_INTS + (2**63, -(2**63) - 1, True, 1.5, "5", 151655))
        return "media", f"image={opts.get('image_token_id')!r} video={opts.get('video_token_id')!r}"
    elif m == "padding":
        opts["padding_token_id"] = pick(rng, I64_INTS + (2**63, None, 1.5))
    elif m == "chunks":
        opts["num_chunks"] = pick(rng, (0, -1, 3, 5, True, 2.0, None, 2**31, 2**63))
        return "chunks", f"num_chunks={opts['num_chunks']!r}"
    elif m == "extra":
        batch[pick(rng, ("attention_mask", "_vlm_pp_media_chunks", "foo"))] = pick(
            rng, (torch.tensor(3), torch.ones(2), {"a": 1}, None))
    elif m == "empty":
        for key in ("input_ids", "labels", "position_ids"):
            if isinstance(batch.get(key), torch.Tensor):
                batch[key] = batch[key][:, :0]
    elif m == "loss_mask":
        opts["loss_mask"] = torch.ones(1)
    return m, ""


def _via_sharder(module, batch: dict, opts: dict):
    sharder = module.make_mimo_te_cp_sharder(model=None, **{"image_token_id": None, "video_token_id": None,
                                                            "num_chunks": 1, **opts})  # fmt: skip
    ctx, out = sharder.shard(dict(batch))
    return ctx, out, sharder.shard_layout


def gen_mimo(rng: random.Random, g: torch.Generator) -> Case:
    batch, opts, cp = draw_case(g)
    mesh = pick(rng, case_meshes(cp, g))
    kind, what = _mutate_batch(batch, opts, rng)
    meta = rng.random() < 0.04
    if meta:
        batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        kind = "meta"
    frozen = dict(batch)
    make = lambda: (mesh, None, dict(frozen))  # noqa: E731 - fresh dict per call
    shapes = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) if isinstance(v, torch.Tensor) else v
              for k, v in frozen.items() if k != "_vlm_pp_media_chunks"}  # fmt: skip
    desc = f"cp={cp} mesh={mesh} {kind} {what} opts={opts} batch={shapes}"
    oracle = lambda: ref.shard_batch_for_mimo_te(*make(), **opts)  # noqa: E731
    native = lambda: nat.shard_batch_for_mimo_te(*make(), **opts)  # noqa: E731
    if rng.random() < 0.2 and not meta:  # through make_mimo_te_cp_sharder(...).shard(batch), as the framework does
        mesh, kind = None, "sharder_" + kind
        sopts = {k: opts[k] for k in ("num_chunks", "image_token_id", "video_token_id") if k in opts}
        oracle = lambda: _via_sharder(ref, frozen, sopts)  # noqa: E731
        native = lambda: _via_sharder(nat, frozen, sopts)  # noqa: E731
        desc = f"make_mimo_te_cp_sharder(...).shard(batch) without a mesh; drawn: {desc}"
    ctx = lambda: fake_dist(mesh) if mesh is not None else contextlib.nullcontext()  # noqa: E731
    if meta:  # the oracle cannot compute on meta: a clear error naming a tensor argument
        return Case("mimo/meta", desc, native, oracle, names=("input_ids", "labels", "position_ids", "seq_lens"),
                    errors="same_or_clear", ctx=ctx)  # fmt: skip
    return Case(f"mimo/{kind}", desc, native, oracle, errors="same", ctx=ctx)


def _outside_dtype(value, t) -> bool:
    """An int sentinel that the integer dtype of ``t`` cannot hold (torch then wraps it)."""
    if isinstance(value, bool) or not isinstance(value, int) or not isinstance(t, torch.Tensor):
        return False
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        return False
    info = torch.iinfo(t.dtype)
    return not info.min <= value <= info.max


def gen_mimo_helpers(rng: random.Random, g: torch.Generator) -> Case:
    batch, opts, cp = draw_case(g)
    mesh = pick(rng, case_meshes(cp, g))
    _mutate_batch(batch, opts, rng)
    meta = rng.random() < 0.05
    if meta:
        batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    which = pick(rng, ("_chunk_partition_indices", "_media_mask", "_flatten_chunks"))
    chunks = opts.get("num_chunks", 1) if rng.random() < 0.7 else pick(rng, (0, -1, 3, True, 2**31, 2**63, None, 1.5))
    ids = batch.get("input_ids")
    if which == "_chunk_partition_indices":
        sentinel = -1000 if rng.random() < 0.7 else pick(rng, I64_INTS + (2**63, None, "x", 1.5))
        args, kw = (dict(batch),), dict(cp_mesh=mesh, num_chunks=chunks, seq_lens_padding_value=sentinel)
        what = f"num_chunks={chunks!r} sentinel={sentinel!r}"
    elif which == "_media_mask":
        token = pick(rng, (None, 151655, 0, 5) + I64_INTS + (2**63, True, 1.5, "5"))
        args, kw, what = (ids, token, chunks), {}, f"token_id={token!r} num_chunks={chunks!r}"
    else:
        t = pick(rng, (ids, batch.get("labels"), batch.get("seq_lens"), torch.zeros(3), torch.zeros(2, 3, 4)))
        args, kw, what = (t, chunks), {}, f"tensor={getattr(t, 'shape', t)} num_chunks={chunks!r}"
    desc = f"{which} cp={cp} mesh={mesh} meta={meta} {what} ids={getattr(ids, 'shape', ids)}"
    ctx = lambda: fake_dist(mesh) if mesh is not None else contextlib.nullcontext()  # noqa: E731
    native = lambda: getattr(nat, which)(*args, **kw)  # noqa: E731
    oracle = lambda: getattr(ref, which)(*args, **kw)  # noqa: E731
    if meta:  # pure view functions may return meta results equal to the oracle's
        return Case("mimo_helpers/meta", desc, native, oracle, names=("input_ids", "seq_lens_padded", "tensor", "token_id"),
                    errors="same_or_clear", ctx=ctx)  # fmt: skip
    suffix = ""
    if which == "_media_mask" and not isinstance(ids, torch.Tensor):
        suffix = "_none"
    elif which == "_chunk_partition_indices" and _outside_dtype(kw["seq_lens_padding_value"], batch.get("seq_lens_padded")):
        suffix = "_sentinel_range"
    return Case(f"mimo_helpers/{which}{suffix}", desc, native, oracle, errors="same", ctx=ctx)


FAMILIES = {"thd": gen_thd, "mimo": gen_mimo, "mimo_helpers": gen_mimo_helpers}
_ = FakeCPMesh  # re-exported for replays in a REPL
