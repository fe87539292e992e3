"""The MiMo TE-THD oracles (``nemo_cp_native.reference.{te_partition,mimo}``) are right.

1. TE partition: every worked example of spec §11.4/§11.6, the host checks, and an independent
   closed form of DualChunkSwap on random valid layouts.
   Also the invariants of the shared batch generator ``nemo_cp_native.testing.make_mimo_batch``.
2. The end-to-end worked examples of §12.1 and §12.2.
3. Parity with the real upstream nemo-automodel (0.7.0 when this was written) for every oracle
   function: randomized over the test matrix (every rank), exact outputs (key order, dtypes,
   shapes, devices, values, aliasing of caller storage), every error of §4-§5, the sharder, and
   real gloo process groups. Upstream's ``import transformer_engine_torch`` is answered by our
   partition oracle (TE cannot be installed here); upstream tests skip without nemo_automodel.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from _mesh import FakeCPMesh, fake_dist, run_distributed
from _upstream import (
    assert_same,
    assert_same_outcome,
    call,
    FakeMiMoModel,
    case_meshes,
    draw_case,
    fake_transformer_engine,
    gen,
    parity,
    upstream_modules,
    upstream_version,
)

from nemo_cp_native import _compat
from nemo_cp_native.reference import mimo as ref
from nemo_cp_native.reference.te_partition import thd_get_partitioned_indices as te_oracle
from nemo_cp_native.testing import make_mimo_batch

HAVE_UP = upstream_modules() is not None
if HAVE_UP:
    _up_cp, _up_utils, _up_thd = upstream_modules()


def upstream(test):
    """Mark a test as needing upstream; it skips cleanly when nemo_automodel is not importable."""
    reason = "nemo_automodel's MiMo cp module is not importable"
    return pytest.mark.upstream(pytest.mark.skipif(not HAVE_UP, reason=reason)(test))


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# =============================================================================================
# 1. TE partition oracle (§11)
# =============================================================================================

TE_EXAMPLES = [  # (cu_seqlens, total_tokens, W, [indices per rank])
    ([0, 8], 16, 2, [[0, 1, 6, 7, 8, 9, 10, 11], [2, 3, 4, 5, 6, 7, 8, 9]]),  # §11.4 past cu[-1]
    ([0, 6, 8], 8, 2, [[0, 3, 4, 6], [1, 2, 3, 6]]),  # §11.4 non-divisible
    ([0, 8, 16], 16, 2, [[0, 1, 6, 7, 8, 9, 14, 15], [2, 3, 4, 5, 10, 11, 12, 13]]),  # §11.6
    ([0, 4, 12], 12, 2, [[0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]]),
    ([0, 16], 16, 4, [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]),
    ([0, 8, 16], 16, 4, [[0, 7, 8, 15], [1, 6, 9, 14], [2, 5, 10, 13], [3, 4, 11, 12]]),
]


@pytest.mark.parametrize("cu,total,world,expected", TE_EXAMPLES)
def test_te_worked_examples(cu, total, world, expected):
    for rank in range(world):
        out = te_oracle(i32(cu), total, world, rank)
        assert out.dtype == torch.int32 and out.device == torch.device("cpu")
        assert out.tolist() == expected[rank]


def test_te_ignores_documents_past_total_tokens():
    # §11.4: total_tokens < cu[-1] -> later documents are never reached.
    assert te_oracle(i32([0, 8, 16]), 8, 2, 0).tolist() == te_oracle(i32([0, 8]), 8, 2, 0).tolist()


@pytest.mark.parametrize(
    "cu,total,world,rank",
    [
        (torch.tensor([0, 8], dtype=torch.int64), 8, 2, 0),  # not int32
        (i32([[0, 8]]), 8, 2, 0),  # not 1-D
        (i32([8]), 8, 2, 0),  # fewer than 2 entries
        (i32([0, 8]), 8, 0, 0),  # world_size 0
        (i32([0, 8]), 8, 2, -1),  # rank < 0
        (i32([0, 8]), 8, 2, 2),  # rank >= world_size
        (i32([0, 8]), 0, 2, 0),  # total_tokens 0
        (i32([0, 8]), 6, 2, 0),  # total_tokens % 2W != 0
    ],
)
def test_te_host_checks(cu, total, world, rank):
    with pytest.raises(RuntimeError, match="thd_get_partitioned_indices"):
        te_oracle(cu, total, world, rank)


def test_te_matches_closed_form_dual_chunk_swap(ncp_seed):
    """On valid layouts: rank r holds, per document, chunk r then chunk 2W-1-r; ranks partition."""
    g = gen(ncp_seed)
    for _ in range(30):
        world = [1, 2, 4, 8][int(torch.randint(0, 4, (1,), generator=g))]
        lens = ((torch.randint(1, 5, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)) * 2 * world).tolist()
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        seen = []
        for rank in range(world):
            expected = []
            for start, n in zip(cu[:-1], lens):
                c = n // (2 * world)
                expected += list(range(start + rank * c, start + (rank + 1) * c))
                expected += list(range(start + (2 * world - 1 - rank) * c, start + (2 * world - rank) * c))
            got = te_oracle(i32(cu), cu[-1], world, rank).tolist()
            assert got == expected, (cu, world, rank)
            seen += got
        assert sorted(seen) == list(range(cu[-1]))


# The shared case generator (nemo_cp_native.testing) the parity tests and benchmarks draw from.


@pytest.mark.parametrize("absorption,min_doc", [(False, False), (True, False), (False, True)])
def test_make_mimo_batch_invariants(absorption, min_doc, ncp_seed):
    """The shared generator: deterministic per generator, and every batch is legal for its cp."""
    B, S, C, cp = 4, 48, 2, 2
    kw = dict(num_chunks=C, cp_size=cp, absorption=absorption, min_doc=min_doc, docs_per_row=(1, 5), image_token_id=9)
    a, b = (make_mimo_batch(B, S, generator=gen(ncp_seed), **kw) for _ in range(2))
    assert_same(a, b)
    assert list(a) == ["input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded", "qkv_format"]
    for row in range(B):
        real, padded = (a[k][row][a[k][row] != -1000].tolist() for k in ("seq_lens", "seq_lens_padded"))
        assert sum(padded) == S and all(p % (2 * cp) == 0 and 0 < r <= p for r, p in zip(real, padded))
        if min_doc and len(padded) > 1:
            assert 2 * cp in padded
        if absorption:  # only the last document of each chunk's stream is padded
            last_of_chunk = (row + 1) % (B // C) == 0
            assert real[:-1] == padded[:-1] and (real[-1] < padded[-1]) == last_of_chunk
        start = 0
        for r, p in zip(real, padded):
            assert a["position_ids"][row, start : start + p].tolist() == list(range(p))
            assert (a["labels"][row, start + r - 1 : start + p] == -100).all()
            assert (a["input_ids"][row, start + r : start + p] == 0).all()
            start += p


# =============================================================================================
# 2. End-to-end worked examples (§12)
# =============================================================================================


def _example_12_1():
    ids = torch.tensor([[62, 63, 7, 62, 8, 63, 63, 62]])
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "position_ids": torch.arange(8).reshape(1, 8),
        "seq_lens": torch.tensor([[8]]),
        "seq_lens_padded": torch.tensor([[8]]),
        "qkv_format": "thd",
    }


def _local_feature_rows(global_mask, local_indices):
    """The model's §10.2 mapping, to check the example's "model step" numbers."""
    g = global_mask.reshape(-1).bool()
    li = local_indices.reshape(-1)
    feat = torch.cumsum(g.long(), 0) - 1
    return feat[li][g[li]].tolist()


def _check_12_1(shard):
    mesh = FakeCPMesh(2, 1)
    with fake_dist(mesh), fake_transformer_engine():
        ctx, out, layout = shard(mesh, None, _example_12_1(), image_token_id=62, video_token_id=63)
    assert ctx is contextlib.nullcontext
    assert list(out) == [
        "input_ids", "position_ids", "cu_seqlens", "labels", "padding_mask", "max_seqlen", "qkv_format",
        "cp_size", "cp_rank", "_mimo_thd_local_indices", "_mimo_global_image_mask", "_mimo_global_video_mask",
    ]  # fmt: skip
    T, F = True, False
    expected = {
        "input_ids": torch.tensor([7, 62, 8, 63]),
        "position_ids": torch.tensor([2, 3, 4, 5]),
        "cu_seqlens": i32([0, 8]),
        "labels": torch.tensor([7, 62, 8, 63]),
        "padding_mask": torch.tensor([F, F, F, F]),
        "max_seqlen": torch.tensor(8, dtype=torch.int32),
        "qkv_format": "thd",
        "cp_size": 2,
        "cp_rank": 1,
        "_mimo_thd_local_indices": torch.tensor([2, 3, 4, 5]),
        "_mimo_global_image_mask": torch.tensor([T, F, F, T, F, F, F, T]),
        "_mimo_global_video_mask": torch.tensor([F, T, F, F, F, T, T, F]),
    }
    assert_same(out, expected)
    assert_same(layout, _compat.ShardLayout(torch.tensor([2, 3, 4, 5]), None, 8, (1, 8), None))
    assert _local_feature_rows(out["_mimo_global_image_mask"], out["_mimo_thd_local_indices"]) == [1]
    assert _local_feature_rows(out["_mimo_global_video_mask"], out["_mimo_thd_local_indices"]) == [1]
    mesh0 = FakeCPMesh(2, 0)
    with fake_dist(mesh0), fake_transformer_engine():
        assert shard(mesh0, None, _example_12_1())[1]["_mimo_thd_local_indices"].tolist() == [0, 1, 6, 7]


def _example_12_2():
    ids = torch.arange(100, 116).reshape(2, 8)
    return {
        "input_ids": ids,
        "labels": ids + 1000,
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3], list(range(8))]),
        "seq_lens": torch.tensor([[3, 4], [7, -1000]]),
        "seq_lens_padded": torch.tensor([[4, 4], [8, -1000]]),
        "qkv_format": "thd",
    }


def _check_12_2(shard, split):
    flat = split(_example_12_2(), num_chunks=2)
    assert flat["cu_seqlens"].tolist() == [[0, 3, 7], [0, 8, -1000]]  # chunk 1 absorbed 7 -> 8
    assert flat["cu_seqlens_padded"].tolist() == [[0, 4, 8], [0, 8, -1000]]
    assert flat["max_seqlen"].tolist() == [4, 8]
    mesh = FakeCPMesh(2, 0)
    with fake_dist(mesh), fake_transformer_engine():
        ctx, out, layout = shard(mesh, None, _example_12_2(), num_chunks=2)
    assert layout is None and ctx is contextlib.nullcontext
    local = torch.tensor([[0, 3, 4, 7], [0, 1, 6, 7]])
    stream = torch.arange(100, 116).reshape(2, 8)
    T, F = True, False
    expected = {
        "input_ids": stream.gather(1, local),
        "labels": stream.gather(1, local) + 1000,
        "position_ids": torch.tensor([[0, 3, 0, 3], [0, 1, 6, 7]]),
        "cu_seqlens": i32([[0, 4, 8], [0, 8, -1000]]),
        "max_seqlen": i32([4, 8]),
        "qkv_format": "thd",
        "padding_mask": torch.tensor([[F, T, F, F], [F, F, F, T]]),
        "cp_size": 2,
        "cp_rank": 0,
        "_mimo_thd_local_indices": local,
    }
    assert_same(out, expected)


def test_worked_example_12_1_oracle():
    _check_12_1(ref.shard_batch_for_mimo_te)


def test_worked_example_12_2_oracle():
    _check_12_2(ref.shard_batch_for_mimo_te, ref.split_batch_into_thd_chunks)


@upstream
def test_worked_examples_upstream():
    _check_12_1(_up_cp.shard_batch_for_mimo_te)
    _check_12_2(_up_cp.shard_batch_for_mimo_te, _up_thd.split_batch_into_thd_chunks)


# =============================================================================================
# 3. Parity with upstream
# =============================================================================================


def _check_all_functions(batch, opts, cp, g):
    """Every oracle function == upstream on this (valid) batch, for every rank's mesh; none raises."""
    C = opts["num_chunks"]
    fresh = lambda: (dict(batch),)  # noqa: E731
    ids = batch["input_ids"]
    outcomes = [
        parity("process_input_for_thd", fresh),
        parity("split_batch_into_thd_chunks", fresh, num_chunks=C),
        parity("_flatten_chunks", lambda: (ids, C)),
    ]
    for tid in (opts["image_token_id"], opts["video_token_id"]):
        outcomes.append(parity("_media_mask", lambda: (ids, tid, C)))  # noqa: B023
    for mesh in case_meshes(cp, g):
        run = lambda name, make, **kw: outcomes.append(parity(name, make, mesh=mesh, **kw))  # noqa: B023, E731
        run("_chunk_partition_indices", fresh, cp_mesh=mesh, num_chunks=C, seq_lens_padding_value=-1000)
        run("shard_batch_for_mimo_te", lambda: (mesh, None, dict(batch)), **opts)  # noqa: B023
        back = bool(torch.rand((), generator=g) < 0.5)
        run("make_cp_batch_for_te", lambda: (mesh, dict(batch)), num_chunks=C, return_local_indices=back)  # noqa: B023
        if cp > 1:
            flat = ref.process_input_for_thd(dict(batch))
            run("_shard_thd_chunk_for_te", lambda: (dict(flat), mesh, "thd", -1000, 0))  # noqa: B023
    assert all(kind == "ok" for kind, _ in outcomes), [v for k, v in outcomes if k != "ok"]


@upstream
@pytest.mark.parametrize("draw", range(24))
def test_parity_random(draw, ncp_seed):
    g = gen(ncp_seed)
    batch, opts, cp = draw_case(g)
    _check_all_functions(batch, opts, cp, g)


@upstream
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("C", [1, 2, 4])
def test_parity_matrix_corners(C, cp, ncp_seed):
    """Each (num_chunks, cp) with the largest B: ragged rows with min-length docs, then absorption."""
    g = gen(ncp_seed)
    for kw in ({"min_doc": True, "absorption": False, "docs_per_row": (1, 5)}, {"absorption": True}):
        batch, opts, _ = draw_case(g, B=8, C=C, cp=cp, S=2 * cp * 4, **kw)
        _check_all_functions(batch, opts, cp, g)


@upstream
def test_parity_padding_helpers(ncp_seed):
    g = gen(ncp_seed)
    for _ in range(20):
        reals = torch.randint(0, 6, (int(torch.randint(1, 5, (), generator=g)),), generator=g)
        slots = reals + torch.randint(0, 3, reals.shape, generator=g)
        total = int(slots.sum()) + int(torch.randint(0, 4, (), generator=g))
        padded = None if bool(torch.rand((), generator=g) < 0.3) else slots.to(torch.int32)
        parity("_thd_padding_mask", lambda: (), total_tokens=total, valid_seq_lens=reals,  # noqa: B023
               valid_seq_lens_padded=padded, device=torch.device("cpu"))  # fmt: skip
        ids = torch.randint(0, 3, (8,), generator=g)  # often not a clean tail of zeros
        parity("thd_padding_mask_from_token_ids", lambda: (ids, 0))  # noqa: B023
    parity("thd_padding_mask_from_token_ids", lambda: (torch.tensor([5, 6, 0, 0]), 0))


ODD_CP1 = [  # (seq_lens, seq_lens_padded): metadata MiMo does not validate at cp 1 (S = 8 per row)
    ([[3, 5], [8, -1000]], [[3, 4], [8, -1000]]),  # real > padded on the last doc: no absorption
    ([[3, 4], [2, -1000]], [[3, 4], [2, -1000]]),  # slots short of S: trailing pack pad absorbed
    ([[0, 8], [8, -1000]], [[0, 8], [8, -1000]]),  # a zero-length document
    ([[4, 4], [8, -1000]], [[8, -1000], [8, -1000]]),  # real and padded disagree on document count
    ([[5, -1000], [-1000, -1000]], [[8, -1000], [-1000, -1000]]),  # an all-sentinel row
    ([[2, 2], [4, 4]], [[3, 5], [7, 9]]),  # padded overruns the chunk
]


@upstream
@pytest.mark.parametrize("num_chunks", [1, 2])
@pytest.mark.parametrize("lens,padded", ODD_CP1)
def test_parity_unvalidated_metadata_cp1(lens, padded, num_chunks):
    batch = make_mimo_batch(2, 8, num_chunks=1, cp_size=1, generator=gen(1))
    batch["seq_lens"], batch["seq_lens_padded"] = torch.tensor(lens), torch.tensor(padded)
    for mesh in (None, FakeCPMesh(1, 0)):
        parity("shard_batch_for_mimo_te", lambda: (mesh, None, dict(batch)), mesh=mesh,  # noqa: B023
               num_chunks=num_chunks, image_token_id=7)  # fmt: skip
    parity("split_batch_into_thd_chunks", lambda: (dict(batch), num_chunks))


@upstream
@pytest.mark.parametrize("cp", [1, 2])
def test_parity_embedding_input(cp, ncp_seed):
    """[B, S, H] float input_ids (PP stages): framework helpers only (MiMo itself rejects 3-D).

    Quirks kept: at cp 1 the returned identity map is ``arange(input_ids.shape[-1])`` (H, not T);
    at cp > 1 the embeddings are cast to int64.
    """
    batch = make_mimo_batch(2, 8, num_chunks=1, cp_size=2, generator=gen(ncp_seed))
    batch["input_ids"] = torch.randn(2, 8, 3, generator=gen(ncp_seed)) * 10
    meshes = [None] if cp == 1 else [FakeCPMesh(2, 0), FakeCPMesh(2, 1)]
    for mesh in meshes:
        parity("make_cp_batch_for_te", lambda: (mesh, dict(batch)), mesh=mesh, return_local_indices=True)  # noqa: B023
    assert parity("shard_batch_for_mimo_te", lambda: (None, None, dict(batch)))[0] == "err"


def test_helpers_restore_state():
    import sys

    import torch.distributed as dist

    saved = (dist.is_available, dist.is_initialized, dist.get_rank)
    mesh = FakeCPMesh(4, 3)
    with fake_dist(mesh), fake_transformer_engine() as tex:
        assert dist.is_initialized() and dist.get_rank(group=mesh.get_group()) == 3
        assert sys.modules["transformer_engine_torch"] is tex
        with pytest.raises(ValueError):
            dist.get_rank(group=FakeCPMesh(4, 3).get_group())  # another mesh's group
    with fake_dist(None):
        assert not dist.is_initialized()
    assert (dist.is_available, dist.is_initialized, dist.get_rank) == saved
    assert "transformer_engine_torch" not in sys.modules


def _b(B=2, S=8, **over):
    """A small valid batch (cp 2 compatible), with per-key overrides (``_DROP`` removes the key)."""
    batch = make_mimo_batch(B, S, num_chunks=1, cp_size=2, generator=gen(0), docs_per_row=(1, 2))
    for k, v in over.items():
        if v is _DROP:
            batch.pop(k)
        else:
            batch[k] = v
    return batch


_DROP = object()
_M2 = FakeCPMesh(2, 1)

ERROR_CASES = [  # (id, mesh, batch factory, options); every case must raise on both sides
    ("loss_mask", None, lambda: _b(), {"loss_mask": torch.ones(2, 8)}),
    ("no_qkv_format", _M2, lambda: _b(qkv_format=_DROP), {}),
    ("bshd", _M2, lambda: _b(qkv_format="bshd"), {}),
    ("no_input_ids", _M2, lambda: _b(input_ids=_DROP), {}),
    ("input_ids_1d", _M2, lambda: _b(input_ids=torch.zeros(16, dtype=torch.long)), {}),
    ("input_ids_list", _M2, lambda: _b(input_ids=[[1, 2]]), {}),
    ("position_ids_3d_pp", _M2, lambda: _b(position_ids=torch.zeros(3, 2, 8, dtype=torch.long)), {"num_chunks": 2}),
    ("position_ids_3d_cp2", _M2, lambda: _b(position_ids=torch.zeros(3, 2, 8, dtype=torch.long)), {}),
    ("no_seq_lens_padded_cp1", None, lambda: _b(seq_lens_padded=_DROP), {}),
    ("seq_lens_padded_1d", _M2, lambda: _b(seq_lens_padded=torch.tensor([8, 8])), {}),
    ("B_not_divisible", _M2, lambda: _b(B=3), {"num_chunks": 2}),
    ("B_not_divisible_media", _M2, lambda: _b(B=3), {"num_chunks": 2, "image_token_id": 5}),
    ("num_chunks_0", _M2, lambda: _b(), {"num_chunks": 0}),
    ("num_chunks_0_media", _M2, lambda: _b(), {"num_chunks": 0, "video_token_id": 5}),
    ("num_chunks_negative", _M2, lambda: _b(), {"num_chunks": -1}),
    ("length_zero", _M2, lambda: _b(seq_lens_padded=torch.tensor([[8, 0], [8, 0]])), {}),
    ("all_sentinel", _M2, lambda: _b(seq_lens_padded=torch.full((2, 1), -1000)), {}),
    ("coverage", _M2, lambda: _b(seq_lens_padded=torch.tensor([[4, -1000], [8, -1000]])), {}),
    ("divisibility", _M2, lambda: _b(seq_lens_padded=torch.tensor([[6, 2], [8, -1000]])), {}),
    ("no_labels", _M2, lambda: _b(labels=_DROP), {}),
    ("no_seq_lens", _M2, lambda: _b(seq_lens=_DROP), {}),
    ("no_position_ids_key", None, lambda: _b(position_ids=_DROP), {}),
    ("position_ids_none_cp2", _M2, lambda: _b(position_ids=None), {}),
    ("position_ids_none_pp", None, lambda: _b(position_ids=None), {"num_chunks": 2}),
    ("pad_id_is_content", None, lambda: _b(seq_lens=None, input_ids=torch.tensor([[1, 0, 2, 3, 4, 5, 6, 7]] * 2)), {}),
    ("seq_lens_all_sentinel_cp1", None, lambda: _b(seq_lens=torch.full((2, 1), -1000)), {}),
]


@upstream
@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_parity_errors(case):
    _, mesh, make, opts = case
    kind, exc = parity("shard_batch_for_mimo_te", lambda: (mesh, None, make()), mesh=mesh, **opts)
    assert kind == "err", f"expected an error, got {exc}"


@upstream
def test_parity_direct_helper_errors():
    for args in [(torch.zeros(2, 2, 2), 1), (torch.zeros(4, 2), 0), (torch.zeros(4, 2), 3)]:
        assert parity("_flatten_chunks", lambda: args)[0] == "err"  # noqa: B023
    assert parity("make_cp_batch_for_te", lambda: (None, _b()), qkv_format="bshd")[0] == "err"
    # cp > 1 but no process group: MiMo falls back to get_local_rank, the framework cannot.
    ok = parity("_chunk_partition_indices", lambda: (_b(),), mesh=_M2, dist_mesh=None,
                cp_mesh=_M2, num_chunks=1, seq_lens_padding_value=-1000)  # fmt: skip
    assert ok[0] == "ok"
    assert parity("shard_batch_for_mimo_te", lambda: (_M2, None, _b()), dist_mesh=None)[0] == "err"
    no_local = types.SimpleNamespace(size=lambda: 2, get_group=lambda: None)  # rank defaults to 0
    ok = parity("_chunk_partition_indices", lambda: (_b(),), dist_mesh=None,
                cp_mesh=no_local, num_chunks=1, seq_lens_padding_value=-1000)  # fmt: skip
    lens = _b()["seq_lens_padded"].flatten()
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens[lens != -1000].cumsum(0)]).to(torch.int32)
    assert torch.equal(ok[1], te_oracle(cu, 16, 2, 0).long())
    flat = ref.process_input_for_thd(_b())
    del flat["cu_seqlens"]
    assert parity("_shard_thd_chunk_for_te", lambda: (dict(flat), _M2, "thd", -1000, 0), mesh=_M2)[0] == "err"


@upstream
def test_parity_model_setup(monkeypatch):
    """§5 step 6 / §9: configured once per group, before the partition checks; errors identical."""
    mesh = FakeCPMesh(2, 0)
    bad = lambda: _b(seq_lens_padded=torch.tensor([[6, 2], [8, -1000]]))  # noqa: E731
    models = {}
    for side in ("ref", "up"):
        fn = ref.shard_batch_for_mimo_te if side == "ref" else _up_cp.shard_batch_for_mimo_te
        if not torch.cuda.is_available():  # real setup needs torch.cuda.Stream: same error on both sides
            with fake_dist(mesh), fake_transformer_engine():
                models[side + "_nocuda"] = call(fn, mesh, None, _b(), model=FakeMiMoModel())
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "Stream", lambda *a, **k: "stream")
            model = FakeMiMoModel()
            with fake_dist(mesh), fake_transformer_engine():
                first = call(fn, mesh, None, bad(), model=model)  # rejected after setup ran
                second = call(fn, mesh, None, _b(), model=model)  # cached: no second setup
                unhooked = call(fn, mesh, None, _b(), model=FakeMiMoModel(with_hook=False))
                untouched = FakeMiMoModel()
                fn(None, None, _b(), model=untouched)  # cp <= 1: no setup, no attribute
        assert first[0] == "err" and second[0] == "ok"
        assert model.calls == [(mesh, "stream"), (mesh, "stream")]
        assert model._mimo_te_cp_configured_group is mesh.get_group()
        assert untouched.calls == [] and not hasattr(untouched, "_mimo_te_cp_configured_group")
        models[side] = (first, second, unhooked)
    for r, u in zip(models["ref"], models["up"]):
        assert_same_outcome(r, u)
    if "ref_nocuda" in models:
        assert_same_outcome(models["ref_nocuda"], models["up_nocuda"])


@upstream
@pytest.mark.parametrize("num_chunks", [1, 2])
def test_parity_sharder(num_chunks, ncp_seed):
    """§6 and §8.3: the unresolved sharder, then the framework's rebinding to the real mesh."""
    kw = {"model": None, "num_chunks": num_chunks, "image_token_id": 151655, "video_token_id": None}
    s_ref, s_up = ref.make_mimo_te_cp_sharder(**kw), _up_cp.make_mimo_te_cp_sharder(**kw)
    assert type(s_ref) is type(s_up) is _compat.ContextParallelSharder
    p_ref, p_up = s_ref.shard_batch, s_up.shard_batch
    assert p_ref.func is ref.shard_batch_for_mimo_te and p_up.func is _up_cp.shard_batch_for_mimo_te
    assert p_ref.args == p_up.args == () and p_ref.keywords == p_up.keywords
    for attr in ("local_token_global_indices", "shard_layout", "_cp_mesh", "_tp_mesh", "_loss_mask"):
        assert getattr(s_ref, attr) is getattr(s_up, attr) is None
    assert s_ref._padding_token_id == s_up._padding_token_id == 0
    g = gen(ncp_seed)
    batch = make_mimo_batch(4, 16, num_chunks=num_chunks, cp_size=2, generator=g, image_token_id=151655)
    for rank in range(2):
        mesh, got = FakeCPMesh(2, rank), []
        for s in (s_ref, s_up):
            bound = _compat.ContextParallelSharder(device_mesh=mesh, shard_batch=s.shard_batch,
                                                   local_token_global_indices=None, shard_layout=None)  # fmt: skip
            with fake_dist(mesh), fake_transformer_engine():
                out = bound.shard(dict(batch))
            verb = call(bound.shard_token_tensor, batch["labels"])
            got.append((out, bound.shard_layout, verb))
        assert_same(got[0][:2], got[1][:2])
        assert_same_outcome(got[0][2], got[1][2])
        if num_chunks == 1:
            assert torch.equal(got[0][2][1], got[0][0][1]["labels"])
        else:
            assert isinstance(got[0][2][1], NotImplementedError)


# ---------------------------------------------------------------------------------------------
# Real gloo process groups
# ---------------------------------------------------------------------------------------------


def _gloo_parity_worker(rank, world_size, seed):
    """One rank of 4: oracle == upstream on real cp meshes of size 4 and 2; indices partition every chunk.

    cp = 4 is ``init_device_mesh("cpu", (4,))``; cp = 2 is the "cp" dim of a (dp=2, cp=2) mesh, so the
    cp rank (``rank % 2``) differs from the global rank.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    g = gen(seed)  # same draws on every rank
    for cp in (world_size, 2):
        if cp == world_size:
            mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        else:
            mesh = init_device_mesh("cpu", (world_size // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]
        assert dist.get_rank(group=mesh.get_group()) == rank % cp
        for C in (1, 2):
            batch, opts, _ = draw_case(g, B=4, C=C, cp=cp, S=2 * cp * 4)
            kind, result = parity("shard_batch_for_mimo_te", lambda: (mesh, None, dict(batch)),  # noqa: B023
                                  dist_mesh="real", **opts)  # fmt: skip
            assert kind == "ok", result
            out = result[1]
            parity("make_cp_batch_for_te", lambda: (mesh, dict(batch)), dist_mesh="real", num_chunks=C)  # noqa: B023
            parity("_chunk_partition_indices", lambda: (dict(batch),), dist_mesh="real",  # noqa: B023
                   cp_mesh=mesh, num_chunks=C, seq_lens_padding_value=-1000)  # fmt: skip
            assert out["cp_rank"] == rank % cp and out["cp_size"] == cp
            local = out["_mimo_thd_local_indices"].reshape(C, -1).contiguous()
            parts = [torch.empty_like(local) for _ in range(cp)]
            dist.all_gather(parts, local, group=mesh.get_group())
            for c in range(C):
                got = torch.cat([p[c] for p in parts]).sort().values
                assert torch.equal(got, torch.arange(local.shape[1] * cp)), f"cp {cp} chunk {c}: not a partition"


@upstream
@pytest.mark.dist
def test_parity_gloo(ncp_seed):
    """One 4-rank gloo world (process start-up dominates the cost) covering cp = 4 and cp = 2."""
    run_distributed(_gloo_parity_worker, 4, ncp_seed, timeout=150)


def test_records_upstream_version():
    """Which upstream the parity suite ran against (spec §15 asks to record it)."""
    version = upstream_version() if HAVE_UP else None
    print(f"upstream nemo-automodel: {version}")
    assert (version is not None) == HAVE_UP
