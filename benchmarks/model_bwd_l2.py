"""A model of the Hopper dK/dV kernel's L2 traffic: how many DRAM bytes its Q, dO and dQ tiles cost
in a given item order, under an LRU cache of the L2's size. CPU only; no kernel runs.

The kernel (csrc/cuda/sink_attn/sm90_bwd_parts.cuh, KvItems) gives each CTA one key tile (128 keys)
of one kv head; the CTA walks items (query head, 64-row q tile) over the G query heads of that kv
head and every q tile that sees its keys, reading that item's Q and dO tiles (16 KiB each in bf16,
D = 128) and adding into its fp32 dQ tile (32 KiB). The grid is dispatched in launch.h's order:
longest first within chunks of 2 waves, one CTA per SM, each free SM taking the next CTA. The model
runs every SM one item per step (items of equal time), replays the tile accesses through an LRU
cache and counts the misses (reads from DRAM) and the write-backs of evicted dQ tiles.

    python benchmarks/model_bwd_l2.py [--docs 4] [--doc-len 32768] [--l2-mib 50] [--order head-major]

``--order head-major``: main's items (every q tile of head 0, then head 1, ...);
``--order heads-inner``: the heads inner (every head of q tile 0, then q tile 1, ...); either with
``-desc``: the q tiles from the last down.
It is a model: it ignores item-time differences, the diagonal tiles' masking, the L2's two
partitions and its replacement policy, and the Q/dO tiles' reuse by the forward; use it to compare
orders, and check its absolute figure against Nsight Compute's DRAM bytes.
"""

from __future__ import annotations

import argparse
import collections
import json

KVB, KQB = 128, 64  # keys per CTA, query rows per item (launch.h: kBwdKvTile, kBwdKvStep)
WAVE_SMS = 132  # an H100 SXM's multiprocessors (the H200 has as many)
ORDER_WAVES = 2  # launch.h kOrderWaves
ORDERS = ("head-major", "heads-inner", "head-major-desc", "heads-inner-desc")


def ctas(docs: int, doc_len: int, hkv: int, grid: str = "tile-major") -> list[tuple[int, int, int, int]]:
    """(doc, kv head, key tile, q tiles seen) in index order: launch order of the causal grid.
    ``tile-major`` is main's (blockIdx.x = kv head, blockIdx.y = the packed key tile; linear index
    y * hkv + x); ``head-major``: every key tile of kv head 0, then of kv head 1, ..."""
    kt = doc_len // KVB
    out = [(d, h, j, doc_len // KQB - (j * KVB) // KQB) for d in range(docs) for j in range(kt) for h in range(hkv)]
    if grid == "head-major":
        out.sort(key=lambda c: c[1])  # stable: within a kv head, documents and key tiles in order
    return out


def longest_first(grid: list, sms: int) -> list:
    chunk = ORDER_WAVES * sms
    order = []
    for c0 in range(0, len(grid), chunk):
        part = list(enumerate(grid[c0:c0 + chunk]))
        part.sort(key=lambda t: (-t[1][3], t[0]))
        order += [g for _, g in part]
    return order


def items(cta, G: int, order: str, doc_len: int):
    d, h, j, n_q = cta
    qt_lo = doc_len // KQB - n_q
    ts = range(n_q - 1, -1, -1) if order.endswith("-desc") else range(n_q)
    if order.startswith("head-major"):
        for g in range(G):
            for t in ts:
                yield d, h * G + g, qt_lo + t
    else:
        for t in ts:
            for g in range(G):
                yield d, h * G + g, qt_lo + t


def simulate(docs: int, doc_len: int, hkv: int, G: int, l2_bytes: int, order: str, sms: int,
             grid: str = "tile-major") -> dict:
    q_bytes, dq_bytes = KQB * 128 * 2, KQB * 128 * 4
    cache: collections.OrderedDict = collections.OrderedDict()  # key -> dirty
    used = 0
    stats = collections.Counter()

    def touch(key, size, write):
        nonlocal used
        if key in cache:
            cache.move_to_end(key)
            stats["hit_bytes"] += size
            if write:
                cache[key] = True
            return
        stats["read_bytes"] += size
        cache[key] = write
        used += size
        while used > l2_bytes:
            (kind, *_), dirty = cache.popitem(last=False)
            sz = dq_bytes if kind == "dq" else q_bytes
            used -= sz
            if dirty:
                stats["write_bytes"] += sz

    pending = iter(longest_first(ctas(docs, doc_len, hkv, grid), sms))
    running = [iter(()) for _ in range(sms)]  # each SM takes its first CTA in the first step
    steps = 0
    while any(r is not None for r in running):
        for s in range(sms):
            it = running[s]
            if it is None:
                continue
            nxt = next(it, None)
            while nxt is None:
                c = next(pending, None)
                if c is None:
                    running[s] = None
                    break
                running[s] = it = items(c, G, order, doc_len)
                nxt = next(it, None)
            if nxt is None:
                continue
            d, hq, qt = nxt
            touch(("q", d, hq, qt), q_bytes, False)
            touch(("do", d, hq, qt), q_bytes, False)
            touch(("dq", d, hq, qt), dq_bytes, True)
        steps += 1
    stats["write_bytes"] += sum(dq_bytes for k, dirty in cache.items() if dirty)  # flushed at the end
    return {"order": order, "grid": grid, "steps": steps, **{k: int(v) for k, v in stats.items()},
            "dram_gb": round((stats["read_bytes"] + stats["write_bytes"]) / 1e9, 2),
            "hit_rate": round(stats["hit_bytes"] / (stats["hit_bytes"] + stats["read_bytes"]), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=32768)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--group", type=int, default=8, help="query heads per kv head")
    ap.add_argument("--l2-mib", type=float, default=50.0)
    ap.add_argument("--sms", type=int, default=WAVE_SMS)
    ap.add_argument("--order", default="head-major,heads-inner", help="comma list: head-major, heads-inner, head-major-desc, heads-inner-desc")
    ap.add_argument("--grid", default="tile-major", choices=("tile-major", "head-major"),
                    help="the grid's launch order (ctas)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.doc_len % KVB:
        ap.error(f"--doc-len must be a multiple of {KVB}")
    rows = []
    for order in a.order.split(","):
        if order not in ORDERS:
            ap.error(f"--order: unknown order {order!r}")
        r = simulate(a.docs, a.doc_len, a.hkv, a.group, int(a.l2_mib * 2**20), order, a.sms, a.grid)
        rows.append(r)
        print(f"{a.grid} grid, {order:16s} DRAM {r['dram_gb']:8.2f} GB (read {r['read_bytes'] / 1e9:.2f}, "
              f"write {r['write_bytes'] / 1e9:.2f}), hit rate {r['hit_rate']:.4f}, {r['steps']} steps", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
