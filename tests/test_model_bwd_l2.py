"""benchmarks/model_bwd_l2.py, the L2 model of the dK/dV kernel's item orders, against counts worked
out by hand: an L2 that holds everything misses each tile once; an L2 that holds nothing misses every
access and writes every dQ add back; every order walks the same items."""

from __future__ import annotations

import collections
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import model_bwd_l2 as m  # noqa: E402

Q, DQ = m.KQB * 128 * 2, m.KQB * 128 * 4  # bytes of a Q or dO tile, of a dQ tile


def _items(docs, doc_len, hkv, G, order, grid="tile-major"):
    return [i for c in m.ctas(docs, doc_len, hkv, grid) for i in m.items(c, G, order, doc_len)]


def test_ctas_and_items_follow_the_causal_mask():
    # 512 tokens: key tiles 0..3 (128 keys), q tiles 0..7 (64 rows); key tile j is seen by q tiles >= 2j
    cs = m.ctas(1, 512, 2)
    assert [(j, h, n) for _, h, j, n in cs] == [(0, 0, 8), (0, 1, 8), (1, 0, 6), (1, 1, 6), (2, 0, 4), (2, 1, 4),
                                              (3, 0, 2), (3, 1, 2)]
    assert [c[1] for c in m.ctas(1, 512, 2, "head-major")] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(m.items((0, 1, 3, 2), 2, "head-major", 512)) == [(0, 2, 6), (0, 2, 7), (0, 3, 6), (0, 3, 7)]
    assert list(m.items((0, 1, 3, 2), 2, "heads-inner", 512)) == [(0, 2, 6), (0, 3, 6), (0, 2, 7), (0, 3, 7)]
    assert list(m.items((0, 1, 3, 2), 2, "heads-inner-desc", 512)) == [(0, 2, 7), (0, 3, 7), (0, 2, 6), (0, 3, 6)]


@pytest.mark.parametrize("order", m.ORDERS)
@pytest.mark.parametrize("grid", ["tile-major", "head-major"])
def test_orders_walk_the_same_items(order, grid):
    base = collections.Counter(_items(2, 512, 2, 3, "head-major"))
    assert collections.Counter(_items(2, 512, 2, 3, order, grid)) == base


def test_longest_first_within_chunks():
    grid = m.ctas(1, 1024, 1)  # key tiles 0..7, work 16, 14, ..., 2
    order = m.longest_first(grid, sms=2)  # chunks of 4 CTAs, each longest first
    assert [c[2] for c in order] == [0, 1, 2, 3, 4, 5, 6, 7]
    rev = m.longest_first(list(reversed(grid)), sms=2)
    assert [c[2] for c in rev] == [4, 5, 6, 7, 0, 1, 2, 3]


@pytest.mark.parametrize("order", m.ORDERS)
def test_an_l2_that_holds_everything_misses_each_tile_once(order):
    docs, doc_len, hkv, G = 2, 512, 2, 3
    items = _items(docs, doc_len, hkv, G, order)
    tiles = set(items)
    r = m.simulate(docs, doc_len, hkv, G, l2_bytes=1 << 40, order=order, sms=3)
    assert r["read_bytes"] == len(tiles) * (2 * Q + DQ)
    assert r["write_bytes"] == len(tiles) * DQ  # each dQ tile written back once, at the end
    assert r["hit_bytes"] == (len(items) - len(tiles)) * (2 * Q + DQ)
    # the makespan: 3 SMs, each free SM taking the next CTA, one item per step
    assert r["steps"] >= -(-len(items) // 3)


@pytest.mark.parametrize("order", m.ORDERS)
def test_an_l2_that_holds_nothing_misses_every_access(order):
    docs, doc_len, hkv, G = 1, 512, 2, 2
    n = len(_items(docs, doc_len, hkv, G, order))
    r = m.simulate(docs, doc_len, hkv, G, l2_bytes=0, order=order, sms=4)
    assert r["read_bytes"] == n * (2 * Q + DQ)
    assert r["write_bytes"] == n * DQ
    assert r.get("hit_bytes", 0) == 0


def test_reuse_between_ctas_in_step():
    # Two CTAs of one kv head start together; in head-major order both walk head 0 then head 1, CTA 1
    # two q tiles behind: with room for a few tiles, CTA 0's Q, dO and dQ tiles are still in L2 when
    # CTA 1 reaches them, and the misses are those of one pass over the tiles.
    r = m.simulate(1, 256, 1, 2, l2_bytes=8 * (2 * Q + DQ), order="head-major", sms=2)
    tiles = set(_items(1, 256, 1, 2, "head-major"))
    assert r["read_bytes"] == len(tiles) * (2 * Q + DQ)


def test_cli_rejects_unknown_order(capsys):
    with pytest.raises(SystemExit):
        m.main(["--order", "sideways"])
    assert "unknown order" in capsys.readouterr().err
