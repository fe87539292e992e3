"""Native drop-in for ``nemo_automodel.components.models.flint.magi`` (learned-sink Magi CP).

One token partition per packed microbatch (MagiAttention's default dispatch, computed in C,
``csrc/core/magi_dispatch.c``), shared by the full-causal key (window 0) and the sliding-window
key (window W, counting the current token). Each key carries the exact K/V exchange of its
window (``csrc/core/plan.c``): every rank receives precisely the remote tokens its queries can
see, once; attention then runs the sink-attention kernels on the local queries against the
local + received keys sorted by global position, masked by global position, visiting only the
tiles the plan lists. Backward returns dK/dV of received keys to their owners through the
reverse all-to-all and sums them there (fp32, fixed order). dsink stays partial per rank: the
sum over this rank's queries, left to FSDP's reduction over dp x cp, as in Magi and Automodel.

Plans need no collective: every rank computes the same deterministic plan, so a bad input makes
every rank raise the same error before any communication.
"""

from __future__ import annotations

import contextlib
import math
import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import _compat
from ._ops import _C, dl, stream_of
from .attention import AttnMask, attn_backward, attn_forward, sink_attn_out

logger = logging.getLogger(__name__)

__all__ = [
    "FlintMagiBatch",
    "FlintMagiBatchPlans",
    "FlintMagiBatchValue",
    "FlintMagiPlan",
    "MagiAttentionKey",
    "_build_magi_plan",
    "_prepare_magi_inputs",
]

DEFAULT_CHUNK_SIZE = 512
# The tables of a window, in the order of their runs' buffer (csrc/include/ncp/ncp.h, NCP_PT_*).
_TABLES = ("send_idx", "recv_pos", "kv_pos", "kv_src", "local_slot", "recv_slot", "q_lo", "row_lo", "row_hi",
           "ret_off", "ret_idx")  # fmt: skip
_MASK_FIELDS = ("q_lo", "row_lo", "row_hi", "ret_off", "ret_idx")
_DEVICE_TABLES = ("send_idx", "kv_src", "local_slot", "recv_slot", "ret_off", "ret_idx")


def _runs(buf) -> Tensor:
    """A plan's run list (a bytearray of int32 (out, len, stride, val, step)) as a (runs, 5) tensor."""
    return torch.frombuffer(buf, dtype=torch.int32).view(-1, 5) if len(buf) else torch.empty((0, 5), dtype=torch.int32)


def _expand(runs: Tensor, n: int, device: torch.device, keep: list) -> Tensor:
    """The int32 tables the runs describe, written on ``device`` (one copy of the runs and one kernel
    on CUDA, on the current stream; the pinned copy of the runs stays in ``keep``)."""
    out = torch.empty(n, dtype=torch.int32, device=device)
    if device.type != "cuda":
        _C.runs_expand(runs=dl(runs), out=dl(out))
        return out
    pinned = runs.pin_memory()
    keep.append(pinned)
    _C.runs_expand(runs=dl(pinned), runs_dev=dl(pinned.to(device, non_blocking=True)), out=dl(out),
                   stream=stream_of(device))  # fmt: skip
    return out


def _host_table(name: str) -> property:
    """A read-only property: the plan table ``name``, expanded on the host from its runs once."""
    return property(lambda self: self._host()[name], doc=f"The plan table {name!r} on the host (int32).")


@dataclass(frozen=True, eq=False)
class MagiAttentionKey:
    """One mask over a plan's shared partition (what Magi's ``DistAttnRuntimeKey`` is to Flint).

    ``total_seqlen_q`` is the padded stream length, a multiple of ``chunk_size * cp_size``;
    ``local_token_global_indices`` (int64) are this rank's global positions in local order (pad
    positions ``>= total_seqlen`` included). The rest is the exchange of this window:
    ``send_idx`` (local rows sent, grouped by destination rank), ``send_counts``/``recv_counts``
    (all-to-all split sizes), ``kv_src`` (order of the sorted K/V buffer), ``local_slot`` /
    ``recv_slot`` (where local and received rows sit in it) and the attention mask.

    The plan holds its tables as runs (a few per chunk; ``csrc/core/plan.c``): the tables are
    written out where they are first used, on the host when read as attributes here, on the GPU
    by one kernel in ``device_tables``.
    """

    window: int
    total_seqlen: int
    total_seqlen_q: int
    chunk_size: int
    cp_size: int
    cp_rank: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    visible_pairs: int
    send_counts: tuple
    recv_counts: tuple
    table_off: tuple = field(repr=False)
    runs: Any = field(repr=False)
    local_runs: Any = field(repr=False)
    group: Any = field(default=None, repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def total_seqlen_k(self) -> int:
        return self.total_seqlen_q

    @property
    def pad_size(self) -> int:
        return self.total_seqlen_q - self.total_seqlen

    @property
    def num_local_tokens(self) -> int:
        return self.total_seqlen_q // self.cp_size

    def _host(self) -> dict:
        """Every table of the window on the host (written out once, then cached)."""
        if "host" not in self._cache:
            buf = _expand(_runs(self.runs), self.table_off[-1], torch.device("cpu"), [])
            self._cache["host"] = {name: buf[self.table_off[i] : self.table_off[i + 1]] for i, name in enumerate(_TABLES)}
        return self._cache["host"]

    def _local(self) -> Tensor:
        """This rank's global positions, int32 (written out once, then cached; the sharder needs only these)."""
        if "local" not in self._cache:
            self._cache["local"] = _expand(_runs(self.local_runs), self.num_local_tokens, torch.device("cpu"), [])
        return self._cache["local"]

    @property
    def local_token_global_indices(self) -> Tensor:
        return self._local().long()

    @property
    def q_pos(self) -> Tensor:
        return self._local()

    send_idx = _host_table("send_idx")
    recv_pos = _host_table("recv_pos")
    kv_src = _host_table("kv_src")
    local_slot = _host_table("local_slot")
    recv_slot = _host_table("recv_slot")
    kv_pos = _host_table("kv_pos")

    @property
    def mask_host(self) -> dict:
        host = self._host()
        return {name: host[name] for name in _MASK_FIELDS}

    def device_tables(self, device: torch.device) -> dict:
        """Index tables and mask on ``device``, written there once from the runs, then cached."""
        key = device  # torch.device hashes in 0.04 us, str(device) takes 0.3 (three calls a forward, four a backward)
        if key not in self._cache:
            keep = []
            if device.type == "cpu":
                t = self._host()
            else:
                buf = _expand(_runs(self.runs), self.table_off[-1], device, keep)
                t = {name: buf[self.table_off[i] : self.table_off[i + 1]] for i, name in enumerate(_TABLES)}
            self._cache[key] = {
                "mask": AttnMask(row_lo=t["row_lo"], row_hi=t["row_hi"], window=self.window),
                **{name: t[name] for name in _DEVICE_TABLES},
                "_pinned": keep,
            }
        return self._cache[key]


# ------------------------------------------------------------------------------------------
# exchange and the local compute, shared by the distributed path and the one-GPU simulation
# ------------------------------------------------------------------------------------------


def _send_rows(mkey: MagiAttentionKey, k: Tensor, v: Tensor) -> Tensor:
    """Rows this rank sends, grouped by destination: ``[sum(send_counts), Hkv, 2D]`` = [k | v]."""
    t = mkey.device_tables(k.device)
    out = k.new_empty((t["send_idx"].shape[0], k.shape[1], 2 * k.shape[2]))
    _C.kv_gather(a=dl(k), b=dl(v), idx=dl(t["send_idx"]), out=dl(out), stream=stream_of(k.device))
    return out


def _kv_buffer(mkey: MagiAttentionKey, k: Tensor, v: Tensor, recv: Tensor) -> tuple[Tensor, Tensor]:
    """The K/V buffer sorted by global position, from the local rows and the received ones."""
    t = mkey.device_tables(k.device)
    n = t["kv_src"].shape[0]
    kbuf, vbuf = k.new_empty((n,) + tuple(k.shape[1:])), v.new_empty((n,) + tuple(v.shape[1:]))
    _C.kv_assemble(k=dl(k), v=dl(v), recv=dl(recv), slot_src=dl(t["kv_src"]), kbuf=dl(kbuf), vbuf=dl(vbuf),
                   stream=stream_of(k.device))  # fmt: skip
    return kbuf, vbuf


def _returned_rows(mkey: MagiAttentionKey, dkbuf: Tensor, dvbuf: Tensor) -> Tensor:
    """Gradients of the received rows, grouped by their owner: ``[sum(recv_counts), Hkv, 2D]``."""
    t = mkey.device_tables(dkbuf.device)
    out = dkbuf.new_empty((t["recv_slot"].shape[0], dkbuf.shape[1], 2 * dkbuf.shape[2]))
    _C.kv_gather(a=dl(dkbuf), b=dl(dvbuf), idx=dl(t["recv_slot"]), out=dl(out), stream=stream_of(dkbuf.device))
    return out


def _local_grads(mkey: MagiAttentionKey, dkbuf: Tensor, dvbuf: Tensor, back: Tensor) -> tuple[Tensor, Tensor]:
    """dK, dV of the local rows: their buffer gradients plus what other ranks returned for them,
    summed in fp32 in rank order (bitwise repeatable)."""
    t = mkey.device_tables(dkbuf.device)
    L = t["local_slot"].shape[0]
    dk, dv = dkbuf.new_empty((L,) + tuple(dkbuf.shape[1:])), dvbuf.new_empty((L,) + tuple(dvbuf.shape[1:]))
    _C.kv_grad_sum(dkbuf=dl(dkbuf), dvbuf=dl(dvbuf), local_slot=dl(t["local_slot"]), back=dl(back),
                   ret_off=dl(t["ret_off"]), ret_idx=dl(t["ret_idx"]), dk=dl(dk), dv=dl(dv),
                   stream=stream_of(dkbuf.device))  # fmt: skip
    return dk, dv


def _all_to_all(group, send: Tensor, send_counts, recv_counts) -> Tensor:
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), list(recv_counts), list(send_counts), group=group)
    return recv


class _FlintCPAttention(torch.autograd.Function):
    """One rank's step: send rows, all-to-all, the sorted K/V buffer, the attention kernels with the
    plan's row bounds; backward: the kernels, the received rows' gradients back to their owners,
    and the sum of what came back."""

    @staticmethod
    def forward(ctx, q, k, v, sink, mkey: MagiAttentionKey, scale: float):
        recv = _all_to_all(mkey.group, _send_rows(mkey, k, v), mkey.send_counts, mkey.recv_counts)
        kbuf, vbuf = _kv_buffer(mkey, k, v, recv)
        mask = mkey.device_tables(q.device)["mask"]
        out, lse = attn_forward(q, kbuf, vbuf, sink, mask, scale)
        ctx.save_for_backward(q, kbuf, vbuf, out, lse, sink)
        ctx.mkey, ctx.scale = mkey, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kbuf, vbuf, out, lse, sink = ctx.saved_tensors
        mkey = ctx.mkey
        mask = mkey.device_tables(q.device)["mask"]
        dq, dkbuf, dvbuf, dsink = attn_backward(dout, q, kbuf, vbuf, sink, out, lse, mask, ctx.scale)
        back = _all_to_all(mkey.group, _returned_rows(mkey, dkbuf, dvbuf), mkey.recv_counts, mkey.send_counts)
        dk, dv = _local_grads(mkey, dkbuf, dvbuf, back)
        return dq, dk, dv, dsink, None, None


# ------------------------------------------------------------------------------------------
# plans
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class FlintMagiPlan:
    """Per-microbatch keys; all masks retain the same dispatched token order."""

    keys: dict

    def _key(self, window) -> MagiAttentionKey:
        if isinstance(window, bool) or not isinstance(window, int) or window not in self.keys:
            raise ValueError(f"window={window!r} has no key in this FlintMagiPlan; it holds windows {sorted(self.keys)}")
        return self.keys[window]

    def attention(self, query: Tensor, key: Tensor, value: Tensor, sink: Tensor, window: int, scale: float) -> Tensor:
        """Local THD attention output [tokens, query_heads, head_dim] with the plan's K/V exchange."""
        mkey = self._key(window)
        _check_local(mkey, query, key, value, sink)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"scale must be a finite float; got {scale!r}")
        if mkey.cp_size > 1 and not isinstance(mkey.group, dist.ProcessGroup):
            raise ValueError("this plan was built for simulated ranks; run it with nemo_cp_native.testing.simulate_cp_attention")
        q, k, v = (t.contiguous() for t in (query, key, value))
        if mkey.cp_size == 1:  # no exchange: the same positions-mode kernels, one autograd node
            mask = mkey.device_tables(q.device)["mask"]
            return sink_attn_out(q, k, v, sink, mask, float(scale))
        return _FlintCPAttention.apply(q, k, v, sink, mkey, float(scale))


def _local_ok(mkey: MagiAttentionKey, q, k, v, sink) -> bool:
    """Every condition ``_check_local`` checks, in one expression (its hot path: 3.5 us where its
    check-by-check walk with the messages takes 10 on the development machine)."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and isinstance(sink, Tensor)):
        return False
    if q.is_meta or k.is_meta or v.is_meta or sink.is_meta or q.ndim != 3:
        return False
    L, Hq, dev, dt = mkey.num_local_tokens, mkey.num_heads_q, q.device, q.dtype
    want = (L, mkey.num_heads_kv, q.shape[2])
    return (q.shape[0] == L and q.shape[1] == Hq and k.shape == want and v.shape == want and k.dtype == dt
            and v.dtype == dt and k.device == dev and v.device == dev and sink.shape == (Hq,)
            and sink.dtype == torch.float32 and sink.device == dev
            and (dev.type != "cuda" or dt in (torch.bfloat16, torch.float16)))  # fmt: skip


def _check_local(mkey: MagiAttentionKey, q: Tensor, k: Tensor, v: Tensor, sink: Tensor) -> None:
    if not _local_ok(mkey, q, k, v, sink):
        _explain_local(mkey, q, k, v, sink)


def _explain_local(mkey: MagiAttentionKey, q, k, v, sink) -> None:
    """The first condition of ``_local_ok`` that fails, as its error (checked one by one)."""
    L = mkey.num_local_tokens
    if not all(isinstance(t, Tensor) for t in (q, k, v, sink)):
        raise TypeError("query, key, value and sink must be tensors")
    for name, t in (("query", q), ("key", k), ("value", v), ("sink", sink)):
        if t.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor; Flint CP attention needs real data")
    if q.ndim != 3 or q.shape[0] != L or q.shape[1] != mkey.num_heads_q:
        raise ValueError(
            f"query must have shape ({L}, {mkey.num_heads_q}, head_dim) for this plan "
            f"(total_seqlen_q={mkey.total_seqlen_q} over cp_size={mkey.cp_size}); got {tuple(q.shape)}"
        )
    want = (L, mkey.num_heads_kv, q.shape[2])
    for name, t in (("key", k), ("value", v)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want}; got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match query's dtype and device ({q.dtype}, {q.device})")
    if sink.shape != (mkey.num_heads_q,) or sink.dtype != torch.float32 or sink.device != q.device:
        raise ValueError(f"sink must be float32 of shape ({mkey.num_heads_q},) on {q.device}; got {sink.dtype} "
                         f"{tuple(sink.shape)} on {sink.device}")  # fmt: skip
    if q.device.type == "cuda" and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"query must be bfloat16 or float16 on CUDA; got {q.dtype}")


@dataclass(frozen=True, eq=False)
class FlintMagiBatchPlans:
    """Step-owned plans replicated by PP; a chunked index selects each plan."""

    plans: tuple

    def select(self, microbatch_index: Tensor) -> FlintMagiPlan:
        """Select without a mutable cursor, before entering checkpointed layers."""
        if not isinstance(microbatch_index, Tensor) or microbatch_index.dtype != torch.int64 or microbatch_index.numel() != 1:
            raise ValueError(
                "microbatch_index must be an int64 tensor with one element ([1]); got "
                f"{getattr(microbatch_index, 'dtype', type(microbatch_index).__name__)} "
                f"{tuple(getattr(microbatch_index, 'shape', ()))}"
            )
        if microbatch_index.device.type == "meta":
            raise ValueError("microbatch_index is a meta tensor; it must hold the index (CPU, or GPU with one sync)")
        i = int(microbatch_index.reshape(()).item())
        if not 0 <= i < len(self.plans):
            raise ValueError(f"microbatch_index {i} is out of range for {len(self.plans)} plans")
        return self.plans[i]


def _group_size_rank(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    if not (callable(getattr(group, "size", None)) and callable(getattr(group, "rank", None))):
        raise ValueError(f"group must be a process group (with size() and rank()) or None; got {type(group).__name__}")
    size, rank = group.size(), group.rank()
    if not isinstance(size, int) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"group must report size() > rank() >= 0; got size={size!r}, rank={rank!r}")
    return size, rank


def _config_int(config, name: str, default=None) -> Optional[int]:
    value = getattr(config, name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config.{name} must be a non-negative int; got {value!r}")
    if value >= 2**31:
        raise ValueError(f"config.{name} must be < 2^31; got {value!r}")
    return value


def _min_chunks_per_rank() -> int:
    """MagiAttention's MAGI_ATTENTION_MIN_CHUNKS_PER_RANK (default 8), a positive int."""
    raw = os.environ.get("MAGI_ATTENTION_MIN_CHUNKS_PER_RANK", "8")
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if not 0 < value < 2**31:
        raise ValueError(f"MAGI_ATTENTION_MIN_CHUNKS_PER_RANK must be a positive int; got {raw!r}")
    return value


def _build_magi_plan(cu_seqlens: Tensor, config, group) -> FlintMagiPlan:
    """Build masks with one shared token partition for a packed microbatch."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.device.type != "cpu" or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            "cu_seqlens must be a CPU int32 tensor of padded document boundaries [documents + 1]; got "
            f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} on {getattr(cu_seqlens, 'device', '?')}"
        )
    if cu_seqlens.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1-D [documents + 1]; got shape {tuple(cu_seqlens.shape)}")
    hq, hkv, d = (_config_int(config, n) for n in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    if not hq or not hkv or not d or hq % hkv:
        raise ValueError(f"config needs num_attention_heads ({hq}) a positive multiple of num_key_value_heads ({hkv}) "
                         f"and head_dim ({d}) > 0")  # fmt: skip
    window = _config_int(config, "sliding_window", 0) or 0
    chunk = _config_int(config, "magi_chunk_size", DEFAULT_CHUNK_SIZE)
    chunk = DEFAULT_CHUNK_SIZE if chunk is None else chunk
    if chunk == 0:
        raise ValueError("config.magi_chunk_size must be a positive int (or None for the default 512); got 0")
    min_chunks = _min_chunks_per_rank()
    cp, rank = _group_size_rank(group)
    windows = (0, window) if window > 0 else (0,)
    # C refuses a pack of more than 2^26 chunks (its tables hold one entry per chunk) before allocating
    raw = _C.plan_build(dl(cu_seqlens.contiguous()), cp, rank, chunk, min_chunks, windows)
    keys = {}
    for w in raw["windows"]:
        keys[w["window"]] = _new_key(
            window=w["window"], total_seqlen=raw["total"], total_seqlen_q=raw["total_padded"],
            chunk_size=raw["chunk_size"], cp_size=cp, cp_rank=rank, num_heads_q=hq, num_heads_kv=hkv, head_dim=d,
            visible_pairs=w["visible_pairs"], send_counts=w["send_counts"], recv_counts=w["recv_counts"],
            table_off=w["table_off"], runs=w["runs"], local_runs=raw["local_runs"], group=group,
        )  # fmt: skip
    return FlintMagiPlan(keys=keys)


def _new_key(**fields) -> MagiAttentionKey:
    """``MagiAttentionKey(**fields)`` (every field but ``_cache``) without the frozen dataclass's
    per-field ``object.__setattr__`` (the plan build's host path): the same object, its fields in
    its ``__dict__``, a fresh cache (tests/test_flint_plan.py compares the two)."""
    key = object.__new__(MagiAttentionKey)
    key.__dict__.update(fields)
    key.__dict__["_cache"] = {}
    return key


# ------------------------------------------------------------------------------------------
# model-owned sharder
# ------------------------------------------------------------------------------------------

FlintMagiBatchValue = Union[Tensor, str, int, float, bool, FlintMagiPlan, FlintMagiBatchPlans, Any]
FlintMagiBatch = dict  # dict[str, FlintMagiBatchValue]

PLANS_KEY = "flint_magi_plans"
INDEX_KEY = "flint_magi_microbatch_index"
_FILL = {"labels": -100, "position_ids": 0, "loss_mask": 0, "padding_mask": True}


class _FlintMagiModel(Protocol):
    """Flint model state needed to build model-owned Magi CP inputs."""

    config: Any
    cp_mesh: Any

    def _is_pipeline_parallel_stage(self) -> bool: ...


def _doc_boundaries(batch: dict, num_chunks: int, S: int) -> list[Tensor]:
    """CPU int32 padded boundaries of every pack (one device-to-host copy for all rows)."""
    lens = batch.get("seq_lens_padded", batch.get("seq_lens"))
    if not isinstance(lens, Tensor) or lens.ndim != 2 or lens.shape[0] != num_chunks:
        raise ValueError(f"Flint Magi CP needs seq_lens_padded (or seq_lens) [batch={num_chunks}, documents]; "
                         f"got {getattr(lens, 'shape', lens)}")  # fmt: skip
    host = lens.to("cpu", torch.int64)
    cus = []
    for c in range(num_chunks):
        row = host[c]
        row = row[row > 0]
        cu = torch.zeros(row.numel() + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(row, 0)
        if int(cu[-1]) != S:
            raise ValueError(f"Flint Magi CP: the document lengths of pack {c} sum to {int(cu[-1])}, not to the pack "
                             f"length {S}")  # fmt: skip
        cus.append(cu.to(torch.int32))
    return cus


def _gather_rows(t: Tensor, idx: Tensor, S: int, fill) -> Tensor:
    """t [C, S] -> [C, L] at idx [C, L]; positions >= S (Magi tail pad) get `fill`."""
    safe = idx.clamp(max=S - 1)
    got = torch.gather(t, 1, safe)
    return torch.where(idx < S, got, torch.as_tensor(fill, dtype=t.dtype, device=t.device))


def _shard_flint_batch(cp_mesh, tp_mesh, batch, *, model, num_chunks, loss_mask=None, padding_token_id=0):
    del tp_mesh
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
        raise ValueError("Flint Magi CP requires input_ids [batch, sequence]")
    B, S = input_ids.shape
    if not isinstance(num_chunks, int) or num_chunks < 1 or B % num_chunks:
        raise ValueError(f"Flint Magi CP: num_chunks={num_chunks} must evenly divide batch size {B}")
    if B != num_chunks:
        raise ValueError(f"Flint Magi CP holds one pack per pipeline microbatch: batch has {B} rows for "
                         f"num_chunks={num_chunks}")  # fmt: skip
    mesh = cp_mesh if cp_mesh is not None else getattr(model, "cp_mesh", None)
    group = mesh.get_group() if mesh is not None and mesh.size() > 1 else None
    plans = tuple(_build_magi_plan(cu, model.config, group) for cu in _doc_boundaries(batch, num_chunks, S))
    dev = input_ids.device
    idx = torch.stack([p.keys[0].local_token_global_indices for p in plans]).to(dev)
    out = {}
    pp_stage = bool(getattr(model, "_is_pipeline_parallel_stage", lambda: False)())
    out["input_ids"] = input_ids if pp_stage else _gather_rows(input_ids, idx, S, padding_token_id)
    extra = {"loss_mask": loss_mask} if loss_mask is not None else {}
    for key, fill in _FILL.items():
        t = extra.get(key, batch.get(key))
        if isinstance(t, Tensor) and t.ndim == 2 and tuple(t.shape) == (B, S):
            out[key] = _gather_rows(t, idx, S, fill)
    for key, value in batch.items():
        if key not in out and key not in ("seq_lens", "seq_lens_padded") and not isinstance(value, Tensor):
            out[key] = value
    out["qkv_format"] = "thd"
    out[PLANS_KEY] = FlintMagiBatchPlans(plans=plans)
    out[INDEX_KEY] = torch.arange(num_chunks, dtype=torch.int64, device=dev)
    layout = None
    if num_chunks == 1:
        layout = _compat.ShardLayout(
            local_token_global_indices=idx[0], padded_seq_len=plans[0].keys[0].total_seqlen_q, input_row_shape=(B, S)
        )
    return contextlib.nullcontext, out, layout


def _prepare_magi_inputs(model, batch: dict, num_chunks: int) -> dict:
    """Prepare model-owned packed CP, including independent pipeline microbatches.

    Returns ``{"cp_sharder": ContextParallelSharder}``. Its ``shard`` builds one plan per pack
    (row), gathers labels / positions / masks into the dispatched order ``[chunks, local]`` (Magi
    tail pads: labels -100, positions 0, padding True), keeps token ids global ``[chunks, S]`` on a
    pipeline stage (the stage embeds and selects its own rows) and dispatches them otherwise, and
    adds ``flint_magi_plans`` (``FlintMagiBatchPlans``) and ``flint_magi_microbatch_index``
    (int64 ``arange(chunks)``, split by PP into ``[1]`` per microbatch).
    """
    del batch
    return {"cp_sharder": _compat.ContextParallelSharder(shard_batch=partial(_shard_flint_batch, model=model,
                                                                             num_chunks=num_chunks))}  # fmt: skip
