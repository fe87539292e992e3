"""Every rank of a Flint CP group in one process, for tests and benchmarks: the same plan
tables, the same rank-step functions and kernels as ``FlintMagiPlan.attention``, with the
all-to-all replaced by in-process routing (no collectives)."""

from __future__ import annotations

import torch

from ..attention import attn_backward, attn_forward
from ..flint import _assemble, _check_local, _pack_send, _split_grads, _sum_returned

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
    D = keys[0].shape[-1]
    kv = [torch.cat([k, v], dim=-1) for k, v in zip(keys, values)]
    sends = [_pack_send(mk[r], kv[r]) for r in range(cp)]

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
        buf = _assemble(mk[r], kv[r], recvs[r])
        kb, vb = buf[..., :D].contiguous(), buf[..., D:].contiguous()
        mask = mk[r].device_tables(kb.device)["mask"]
        out, lse = attn_forward(queries[r].contiguous(), kb, vb, sink, mask, float(scale))
        outs.append(out)
        saved.append((kb, vb, out, lse, mask))
    if douts is None:
        return outs, None
    dq, d_local, d_remote, dsink = [], [], [], []
    for r in range(cp):
        kb, vb, out, lse, mask = saved[r]
        g = attn_backward(douts[r].contiguous(), queries[r].contiguous(), kb, vb, sink, out, lse, mask, float(scale))
        dq.append(g[0])
        dsink.append(g[3])
        loc, rem = _split_grads(mk[r], torch.cat([g[1], g[2]], dim=-1))
        d_local.append(loc)
        d_remote.append(rem)
    backs = route(d_remote, lambda s: mk[s].recv_counts)
    grads = []
    for r in range(cp):
        summed = _sum_returned(mk[r], d_local[r], backs[r])
        grads.append((dq[r], summed[..., :D], summed[..., D:], dsink[r]))
    return outs, grads


class SimulatedGroup:
    """A stand-in process group (size, rank) for building plans of simulated ranks."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


