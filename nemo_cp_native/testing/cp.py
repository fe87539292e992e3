"""Every rank of a Flint CP group in one process, for tests and benchmarks: the same plan
tables, the same rank-step functions and kernels as ``FlintMagiPlan.attention``, with the
all-to-all replaced by in-process routing (no collectives)."""

from __future__ import annotations

import torch

from ..attention import attn_backward, attn_forward
from ..flint import _check_local, _kv_buffer, _local_grads, _returned_rows, _send_rows

__all__ = ["SimulatedGroup", "simulate_cp_attention"]


def simulate_cp_attention(plans, queries, keys, values, sink, window, scale, douts=None):
    """Runs every rank of a CP group in this process, exchange included (no collectives).

    ``plans[r]`` is rank r's plan (built with a group reporting size cp and rank r); the
    per-rank tensors are local (dispatched) rows. Returns ``(outs, grads)`` where ``grads`` is
    None without ``douts``, else per rank ``(dq, dk, dv, partial dsink)``.
    """
    cp = len(plans)
    mk = [p._key(window) for p in plans]
    for r in range(cp):
        _check_local(mk[r], queries[r], keys[r], values[r], sink)
    keys, values, queries = ([t.contiguous() for t in ts] for ts in (keys, values, queries))
    sends = [_send_rows(mk[r], keys[r], values[r]) for r in range(cp)]

    def route(parts_by_src, counts_of):  # parts_by_src[s] grouped by destination
        out = []
        for dst in range(cp):
            pieces = []
            for src in range(cp):
                offs = [0]
                for n in counts_of(src):
                    offs.append(offs[-1] + n)
                pieces.append(parts_by_src[src][offs[dst] : offs[dst + 1]])
            out.append(torch.cat(pieces))
        return out

    recvs = route(sends, lambda s: mk[s].send_counts)
    outs, saved = [], []
    for r in range(cp):
        kb, vb = _kv_buffer(mk[r], keys[r], values[r], recvs[r])
        mask = mk[r].device_tables(kb.device)["mask"]
        out, lse = attn_forward(queries[r], kb, vb, sink, mask, float(scale))
        outs.append(out)
        saved.append((kb, vb, out, lse, mask))
    if douts is None:
        return outs, None
    dq, dbuf, d_remote, dsink = [], [], [], []
    for r in range(cp):
        kb, vb, out, lse, mask = saved[r]
        g = attn_backward(douts[r].contiguous(), queries[r], kb, vb, sink, out, lse, mask, float(scale))
        dq.append(g[0])
        dsink.append(g[3])
        dbuf.append((g[1], g[2]))
        d_remote.append(_returned_rows(mk[r], g[1], g[2]))
    backs = route(d_remote, lambda s: mk[s].recv_counts)
    grads = []
    for r in range(cp):
        dk, dv = _local_grads(mk[r], *dbuf[r], backs[r])
        grads.append((dq[r], dk, dv, dsink[r]))
    return outs, grads


class SimulatedGroup:
    """A stand-in process group (size, rank) for building plans of simulated ranks."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


