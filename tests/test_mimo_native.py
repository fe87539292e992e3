"""The native MiMo sharder (``nemo_cp_native.mimo``) equals the oracle (``reference.mimo``) exactly.

Exact means: same outcome (values, or the same exception type and message), same keys in the
same order, dtypes, shapes, devices, non-tensor values and ShardLayout fields; views vs copies of
the caller's storage may differ. The caller's batch is never modified.

1. The test matrix (B 1..8, num_chunks 1/2/4 dividing B, cp 1/2/4/8, every rank) with ragged rows,
   -1000 sentinels, absorption, minimum-length documents, media placeholders, int32/int64
   tokens, lengths and positions, non-contiguous inputs: always on the native path
   (``fast_path_info()``), plus the worked examples of spec ``mimo_te.md`` §12.
2. Inputs the native path takes although they are odd, and the exotic ones it hands to the
   reference (still exact); every error of spec §4-§5 with its exact message; bad inputs of
   every kind; ``_flatten_chunks``, ``_media_mask`` and ``_chunk_partition_indices`` directly.
3. Random, mostly invalid ``seq_lens`` / ``seq_lens_padded`` tables: the oracle's outcome, whatever it is.
The sharder, upstream parity, ``patch()``, real gloo process groups, the shard pass's output guards
and the CUDA tests are in ``test_mimo_native_integration.py``.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import numpy as np
import pytest
import torch
from _mesh import FakeCPMesh, fake_dist
from _upstream import assert_same_outcome, assert_unchanged, call, case_meshes, draw_case, gen, snapshot

from nemo_cp_native import mimo as nat
from nemo_cp_native.reference import mimo as ref
from nemo_cp_native.testing import flat_cases, make_mimo_batch


def run_both(name, mesh, make_args, *, dist_mesh="same", **kw):
    """Oracle then native ``name`` on fresh args under ``fake_dist``; returns (oracle, native, path)."""
    outcomes = []
    for module in (ref, nat):
        args = make_args()
        snap = snapshot(args)
        with fake_dist(mesh if dist_mesh == "same" else dist_mesh):
            outcomes.append(call(getattr(module, name), *args, **kw))
        assert_unchanged(args, snap)
    return outcomes[0], outcomes[1], nat.fast_path_info()["path"]


def check(mesh, make_batch, *, path="native", dist_mesh="same", **opts):
    """``shard_batch_for_mimo_te``: native == oracle, and the native call took ``path``."""
    make = lambda: (mesh, None, make_batch())  # noqa: E731
    r, n, took = run_both("shard_batch_for_mimo_te", mesh, make, dist_mesh=dist_mesh, **opts)
    assert_same_outcome(r, n, "shard_batch_for_mimo_te")
    if path is not None:
        assert took == path, nat.fast_path_info()
    return n


def check_direct(name, make_args, mesh=None, **kw):
    r, n, _ = run_both(name, mesh, make_args, **kw)
    assert_same_outcome(r, n, name)
    return n


def _noncontiguous(t, g):
    """Same values, other strides: column-major storage or a stride-2 view."""
    if bool(torch.rand((), generator=g) < 0.5):
        return t.t().contiguous().t()
    return torch.stack([t, torch.full_like(t, 77)], dim=-1)[..., 0]


def _perturb(batch, g):
    """Random dtype mixes and memory layouts that must not change the answer."""
    flip = lambda p: bool(torch.rand((), generator=g) < p)  # noqa: E731
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor) and flip(0.3):
        batch["position_ids"] = pos.to(torch.int32 if pos.dtype == torch.int64 else torch.int64)
    for key in ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"):
        if isinstance(batch.get(key), torch.Tensor) and flip(0.25):
            batch[key] = _noncontiguous(batch[key], g)
    return batch


def _check_case(batch, opts, cp, g):
    """Every rank: the sharder and the three helpers, all native == oracle."""
    C = opts["num_chunks"]
    for mesh in case_meshes(cp, g):
        check(mesh, lambda: dict(batch), **opts)  # noqa: B023
        check_direct("_chunk_partition_indices", lambda: (dict(batch),), mesh, cp_mesh=mesh, num_chunks=C,  # noqa: B023
                     seq_lens_padding_value=-1000)  # fmt: skip
    ids = batch["input_ids"]
    check_direct("_flatten_chunks", lambda: (ids, C))
    for tid in (opts["image_token_id"], opts["video_token_id"]):
        check_direct("_media_mask", lambda: (ids, tid, C))  # noqa: B023


# =============================================================================================
# 1. The matrix
# =============================================================================================


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_matrix_every_rank(cp, ncp_seed):
    """Every (B, num_chunks) of the matrix at this cp, every rank; ragged, absorption and min-doc rows in turn."""
    g = gen(ncp_seed)
    cases = [c for c in flat_cases(units=(1, 3)) if c[3] == cp]
    for i, (B, S, C, _) in enumerate(cases):
        kind = [dict(min_doc=True, absorption=False, docs_per_row=(1, 6)), dict(absorption=True), {}][i % 3]
        batch, opts, _ = draw_case(g, B=B, S=S, C=C, cp=cp, **kind)
        _check_case(_perturb(batch, g), opts, cp, g)


@pytest.mark.parametrize("cp", [3, 6, 12])
def test_cp_sizes_off_the_matrix(cp, ncp_seed):
    """cp sizes that are not powers of two (the layout's divisibility check then divides; powers of
    two take a mask): every rank, one and two chunks, native == oracle."""
    g = gen(ncp_seed)
    for B, C, u in ((2, 1, 1), (4, 2, 3), (3, 1, 2)):
        batch, opts, _ = draw_case(g, B=B, S=2 * cp * u, C=C, cp=cp)
        _check_case(_perturb(batch, g), opts, cp, g)


@pytest.mark.parametrize("draw", range(8))
def test_random_draws(draw, ncp_seed):
    g = gen(ncp_seed)
    batch, opts, cp = draw_case(g)
    _check_case(_perturb(batch, g), opts, cp, g)


def test_worked_example_12_1():
    ids = torch.tensor([[62, 63, 7, 62, 8, 63, 63, 62]])
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(8).reshape(1, 8),
             "seq_lens": torch.tensor([[8]]), "seq_lens_padded": torch.tensor([[8]]), "qkv_format": "thd"}  # fmt: skip
    for rank, local in [(1, [2, 3, 4, 5]), (0, [0, 1, 6, 7])]:
        mesh = FakeCPMesh(2, rank)
        ctx, out, layout = check(mesh, lambda: dict(batch), image_token_id=62, video_token_id=63)[1]
        assert ctx is contextlib.nullcontext and out["_mimo_thd_local_indices"].tolist() == local
        assert out["input_ids"].tolist() == ids[0, local].tolist() and out["cp_rank"] == rank
        assert layout.padded_seq_len == 8 and layout.input_row_shape == (1, 8)
    assert out["_mimo_global_image_mask"].tolist() == [True, False, False, True, False, False, False, True]


def test_worked_example_12_2():
    ids = torch.arange(100, 116).reshape(2, 8)
    batch = {"input_ids": ids, "labels": ids + 1000, "position_ids": torch.tensor([[0, 1, 2, 3] * 2, list(range(8))]),
             "seq_lens": torch.tensor([[3, 4], [7, -1000]]), "seq_lens_padded": torch.tensor([[4, 4], [8, -1000]]),
             "qkv_format": "thd"}  # fmt: skip
    _, out, layout = check(FakeCPMesh(2, 0), lambda: dict(batch), num_chunks=2)[1]
    assert layout is None and out["_mimo_thd_local_indices"].tolist() == [[0, 3, 4, 7], [0, 1, 6, 7]]
    assert out["cu_seqlens"].tolist() == [[0, 4, 8], [0, 8, -1000]] and out["max_seqlen"].tolist() == [4, 8]
    assert out["padding_mask"].tolist() == [[False, True, False, False], [False, False, False, True]]


# =============================================================================================
# 2. Odd inputs, exotic inputs, errors
# =============================================================================================

_DROP = object()
M2, M4, M8 = FakeCPMesh(2, 1), FakeCPMesh(4, 2), FakeCPMesh(8, 5)
_BASE: dict = {}


@pytest.fixture(autouse=True)
def _fresh_base(ncp_seed):
    """The base batches of ``_b`` are drawn from this test's seed."""
    _BASE.clear()
    _BASE["seed"] = ncp_seed
    yield
    _BASE.clear()


def _b(B=4, S=16, **over):
    """A valid batch (cp 2, num_chunks 1/2/4, drawn once per test) with per-key overrides (``_DROP`` removes)."""
    if (B, S) not in _BASE:
        _BASE[(B, S)] = make_mimo_batch(B, S, num_chunks=1, cp_size=2, generator=gen(_BASE["seed"] + B * S),
                                        docs_per_row=(1, 3), image_token_id=5, video_token_id=6,
                                        media_fraction=0.2)  # fmt: skip
    batch = dict(_BASE[(B, S)])
    for k, v in over.items():
        if v is _DROP:
            batch.pop(k)
        else:
            batch[k] = v(batch[k]) if callable(v) and not isinstance(v, torch.Tensor) else v
    return batch


def _lens(real, padded, rows=4):
    """seq_lens / seq_lens_padded overrides: the same row on every batch row."""
    return {"seq_lens": torch.tensor([real] * rows), "seq_lens_padded": torch.tensor([padded] * rows)}


def _empty(B, S):
    z = torch.zeros(B, S, dtype=torch.long)
    return dict(input_ids=z, labels=z, position_ids=z, seq_lens=torch.zeros(B, 1, dtype=torch.long),
                seq_lens_padded=torch.zeros(B, 1, dtype=torch.long))  # fmt: skip


def _odd(B, S, docs):
    """A B x S batch whose masks end off a word boundary (so a gap precedes the layout block)."""
    ids = torch.arange(B * S).reshape(B, S) % 9  # 5 and 6 (the media ids of _MEDIA) included
    lens = torch.tensor([docs] * B)
    return {"input_ids": ids, "labels": ids + 1, "position_ids": torch.arange(S).expand(B, S), "seq_lens": lens,
            "seq_lens_padded": lens.clone(), "qkv_format": "thd"}  # fmt: skip


_T = lambda t: t.t().contiguous().t()  # noqa: E731 - column-major copy
_ZERO_COL3 = lambda t: t.index_fill(1, torch.tensor([3]), 0)  # noqa: E731 - the pad id inside content
_S = lambda t: torch.stack([t, t * 0 - 3], -1)[..., 0]  # noqa: E731 - stride-2 view
_MEDIA = {"image_token_id": 5, "video_token_id": 6}
_PIXELS = torch.arange(6.0).reshape(3, 2)

NATIVE_CASES = [  # (id, mesh, batch factory, options): odd but fully supported; path "native"
    ("transposed_all_pp", M2, lambda: _b(**{k: _T for k in ("input_ids", "labels", "position_ids", "seq_lens",
                                                             "seq_lens_padded")}), {"num_chunks": 2, **_MEDIA}),
    ("strided_all_cp1", None, lambda: _b(**{k: _S for k in ("input_ids", "labels", "position_ids", "seq_lens",
                                                             "seq_lens_padded")}), {"num_chunks": 2, **_MEDIA}),
    ("expanded_rows", M2, lambda: _b(input_ids=lambda t: t[:1].expand(4, 16), labels=lambda t: t[:1].expand(4, 16)),
     _MEDIA),
    ("pos_int32_ids_int64", M2, lambda: _b(position_ids=lambda t: t.int()), {}),
    ("ids_int32_pos_int64", M2, lambda: _b(input_ids=lambda t: t.int(), labels=lambda t: t.int()), _MEDIA),
    ("lens_int32_padded_int64", M2, lambda: _b(seq_lens=lambda t: t.int()), {"num_chunks": 4}),
    ("pos_none_cp1", None, lambda: _b(position_ids=None), _MEDIA),
    ("size1_mesh_no_dist", FakeCPMesh(1, 0), lambda: _b(), {"num_chunks": 2}),
    ("cp3", FakeCPMesh(3, 2), lambda: _b(S=12, **_lens([6, 5], [6, 6])), {}),
    ("only_min_docs_cp8", M8, lambda: _b(S=32, **_lens([16, 1], [16, 16])), {}),
    ("sentinel_mid_row", M2, lambda: _b(**_lens([4, -1000, 4], [4, -1000, 12])), {}),
    ("widths_differ", M2, lambda: _b(**_lens([16, -1000, -1000], [16])), {}),
    ("negative_lens_cp1", None, lambda: _b(**_lens([20, -4], [20, -4])), {}),
    ("negative_real_cp2", M2, lambda: _b(**_lens([-3, 4], [12, 4])), {}),
    ("wrapping_lens_cp1", None, lambda: _b(seq_lens=torch.tensor([[2**33, 16 - 2**33]] * 4),
                                           seq_lens_padded=torch.tensor([[2**62, 2**62]] * 4)), {"num_chunks": 2}),
    ("wrapping_lens_cp2", M2, lambda: _b(seq_lens_padded=torch.tensor([[2**32 + 8, 8]] * 4)), {}),
    ("real_over_padded_cp1", None, lambda: _b(**_lens([3, 5], [3, 4])), {}),
    ("short_slots_cp1", None, lambda: _b(**_lens([3, 4], [3, 4])), {"num_chunks": 2}),
    ("overrun_cp1", None, lambda: _b(**_lens([2, 2], [7, 9])), {}),
    ("doc_count_differs_cp1", None, lambda: _b(**_lens([4, 4], [16, -1000])), {}),
    ("padded_no_columns_cp1", None, lambda: _b(seq_lens_padded=torch.zeros(4, 0, dtype=torch.long)), {}),
    ("0d_tensor_c1", M2, lambda: _b(scale=torch.tensor(3.0)), {}),
    ("stale_framework_keys", M2, lambda: _b(cu_seqlens=torch.tensor([0, 3]), max_seqlen=torch.tensor(3),
                                            padding_mask=torch.ones(4, 16, dtype=torch.bool)), {}),
    ("extra_keys_cp1_pp", None, lambda: _b(attention_mask=torch.ones(4, 16), pixel_values=_PIXELS, note="x",
                                           _vlm_pp_media_chunks={"pixel_values": [torch.ones(2)]}), {"num_chunks": 2}),
    ("extra_keys_cp2", M2, lambda: _b(attention_mask=torch.ones(4, 16), pixel_values=_PIXELS, nothing=None,
                                      _vlm_pp_media_chunks={"grid": [None]}), {}),
    ("token_id_bool", M2, lambda: _b(), {"image_token_id": True}),
    ("token_id_numpy", M2, lambda: _b(), {"image_token_id": np.int64(5), "video_token_id": np.int32(6)}),
    ("token_id_0d_tensor", M2, lambda: _b(), {"video_token_id": torch.tensor(6)}),
    ("token_id_negative_and_pad", M2, lambda: _b(), {"image_token_id": -100, "video_token_id": 0}),
    ("token_id_int32_max", M2, lambda: _b(input_ids=lambda t: t.int()), {"image_token_id": 2**31 - 1}),
    ("padding_token_id", M2, lambda: _b(), {"padding_token_id": 7, "num_chunks": 2}),
    ("mask_gap_cp1", None, lambda: _odd(3, 7, [3, 4]), _MEDIA),
    ("pad_only_gap_cp1", None, lambda: _odd(3, 7, [7]), {}),
    ("mask_gap_cp2", M2, lambda: _odd(1, 12, [4, 8]), _MEDIA),
    ("mask_gap_cp2_pp", M2, lambda: _odd(2, 12, [4, 8]), {"num_chunks": 2, **_MEDIA}),
]  # fmt: skip

REFERENCE_CASES = [  # (id, mesh, batch factory, options): outside the fast path; exact all the same
    ("mrope_cp1", None, lambda: _b(position_ids=torch.zeros(3, 4, 16, dtype=torch.long)), {}),
    ("mrope_cp2", M2, lambda: _b(position_ids=torch.zeros(3, 4, 16, dtype=torch.long)), {}),
    ("seq_lens_none_cp1", None, lambda: _b(seq_lens=None, input_ids=torch.ones(4, 16, dtype=torch.long)), _MEDIA),
    ("seq_lens_none_content_pad", M2, lambda: _b(seq_lens=None), {}),
    ("float_ids_cp1", None, lambda: _b(input_ids=lambda t: t.float()), _MEDIA),
    ("float_ids_cp2", M2, lambda: _b(input_ids=lambda t: t.float()), {"image_token_id": 5.7}),
    ("bool_ids", M2, lambda: _b(input_ids=lambda t: t.bool()), {"image_token_id": 1}),
    ("int16_ids", M2, lambda: _b(input_ids=lambda t: t.short()), _MEDIA),
    ("uint8_ids", M2, lambda: _b(input_ids=lambda t: t.to(torch.uint8)), _MEDIA),
    ("float_labels", M2, lambda: _b(labels=lambda t: t.float()), {}),
    ("float_positions", M2, lambda: _b(position_ids=lambda t: t.float()), {}),
    ("float_seq_lens", M2, lambda: _b(seq_lens=lambda t: t.float()), {}),
    ("float_seq_lens_padded", M2, lambda: _b(seq_lens_padded=lambda t: t.float()), {}),
    ("int16_seq_lens_padded", M2, lambda: _b(seq_lens_padded=lambda t: t.short()), {}),
    # dtypes DLPack carries but C does not map, and ranks beyond a view's: C's Fallback, not an error
    ("uint32_ids", M2, lambda: _b(input_ids=lambda t: t.to(torch.uint32)), _MEDIA),
    ("uint16_labels", M2, lambda: _b(labels=lambda t: t.to(torch.uint16)), {}),
    ("int8_positions", M2, lambda: _b(position_ids=lambda t: t.to(torch.int8)), {"num_chunks": 2}),
    ("uint64_seq_lens", M2, lambda: _b(seq_lens=lambda t: t.to(torch.uint64)), {}),
    ("uint8_seq_lens_padded_cp1", None, lambda: _b(seq_lens_padded=lambda t: t.to(torch.uint8)), _MEDIA),
    ("positions_9d_cp1", None, lambda: _b(position_ids=lambda t: t.reshape(4, 16, *[1] * 7)), {}),
    ("num_chunks_true", M2, lambda: _b(), {"num_chunks": True}),
    ("num_chunks_numpy", M2, lambda: _b(), {"num_chunks": np.int64(2)}),
    ("num_chunks_tensor", M2, lambda: _b(), {"num_chunks": torch.tensor(2)}),
    ("num_chunks_float", M2, lambda: _b(), {"num_chunks": 2.0}),
    ("num_chunks_0", M2, lambda: _b(), {"num_chunks": 0}),
    ("num_chunks_0_media", M2, lambda: _b(), {"num_chunks": 0, "video_token_id": 5}),
    ("num_chunks_negative", M2, lambda: _b(), {"num_chunks": -1}),
    ("num_chunks_not_dividing", M2, lambda: _b(), {"num_chunks": 3}),
    ("num_chunks_huge", M2, lambda: _b(), {"num_chunks": 2**31}),
    ("num_chunks_huger", None, lambda: _b(), {"num_chunks": 2**64 + 4, **_MEDIA}),
    ("B0_cp2", M2, lambda: _b(**_empty(0, 16)), {}),
    ("B0_cp1", None, lambda: _b(**_empty(0, 16)), {}),
    ("S0_cp2", M2, lambda: _b(**_empty(4, 0)), {"num_chunks": 2}),
    ("S0_cp1", None, lambda: _b(**_empty(4, 0)), {}),
    ("cu_seqlens_padded_in_batch", M2, lambda: _b(cu_seqlens_padded=torch.tensor([0, 16], dtype=torch.int32)), {}),
    ("0d_tensor_pp", M2, lambda: _b(scale=torch.tensor(3.0)), {"num_chunks": 2}),
    ("rows_mismatch_seq_lens", M2, lambda: _b(seq_lens=lambda t: t[:2]), {}),
    ("rows_mismatch_padded_cp2", M2, lambda: _b(seq_lens_padded=lambda t: t[:2]), {}),
    ("rows_mismatch_padded_cp1", None, lambda: _b(seq_lens_padded=lambda t: t[:2]), {}),
    ("seq_lens_1d", M2, lambda: _b(seq_lens=lambda t: t.reshape(-1)), {}),
    ("seq_lens_3d", M2, lambda: _b(seq_lens=lambda t: t[None]), {}),
    ("seq_lens_list", M2, lambda: _b(seq_lens=[[16]] * 4), {}),
    ("seq_lens_no_columns", None, lambda: _b(seq_lens=torch.zeros(4, 0, dtype=torch.long)), {}),
    ("labels_wrong_shape", M2, lambda: _b(labels=lambda t: t[:, :8]), {}),
    ("labels_1d", M2, lambda: _b(labels=lambda t: t.reshape(-1)), {}),
    ("positions_wrong_shape", M2, lambda: _b(position_ids=lambda t: t[:, :8]), {}),
    ("positions_1d", M2, lambda: _b(position_ids=lambda t: t.reshape(-1)), {}),
    ("pos_none_cp2", M2, lambda: _b(position_ids=None), {}),
    ("pos_none_pp", None, lambda: _b(position_ids=None), {"num_chunks": 2}),
    ("no_labels", M2, lambda: _b(labels=_DROP), {}),
    ("no_position_ids", None, lambda: _b(position_ids=_DROP), {}),
    ("no_seq_lens", M2, lambda: _b(seq_lens=_DROP), {}),
    ("all_sentinel_real_cp1", None, lambda: _b(seq_lens=torch.full((4, 2), -1000)), {}),
    ("all_sentinel_real_cp2", M2, lambda: _b(seq_lens=torch.full((4, 1), -1000)), {"num_chunks": 2}),
    ("token_id_too_big_for_int32", M2, lambda: _b(input_ids=lambda t: t.int()), {"image_token_id": 2**31 + 5}),
    ("token_id_too_big", M2, lambda: _b(), {"video_token_id": 2**70}),
    ("token_id_float", M2, lambda: _b(), {"image_token_id": 5.0}),
    ("token_id_str", M2, lambda: _b(), {"image_token_id": "5"}),
    ("cp2_without_process_group", M2, lambda: _b(), {"dist_mesh": None}),
    ("cp_size_over_int32", FakeCPMesh(2**31, 3), lambda: _b(), {}),
    ("cp_size_2_pow_40", FakeCPMesh(2**40, 3), lambda: _b(), {}),
]  # fmt: skip


@pytest.mark.parametrize("case", NATIVE_CASES, ids=[c[0] for c in NATIVE_CASES])
def test_odd_inputs_on_the_native_path(case):
    _, mesh, make, opts = case
    kind, result = check(mesh, make, **opts)
    assert kind == "ok", result
    if "_vlm_pp_media_chunks" in (batch := make()):  # the very same object, not a copy
        with fake_dist(mesh):
            out = nat.shard_batch_for_mimo_te(mesh, None, batch, **opts)[1]
        assert out["_vlm_pp_media_chunks"] is batch["_vlm_pp_media_chunks"]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=[c[0] for c in REFERENCE_CASES])
def test_exotic_inputs_take_the_reference_path(case):
    _, mesh, make, opts = case
    opts = dict(opts)
    check(mesh, make, path="reference", dist_mesh=opts.pop("dist_mesh", "same"), **opts)


# torch warns once per process when the reference casts complex values to real: only the first call
# (the oracle's or the native one's) would see it, so the warning is not part of the outcome here
@pytest.mark.filterwarnings("ignore:Casting complex values to real:UserWarning")
@pytest.mark.parametrize("key", ["input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"])
@pytest.mark.parametrize("cp", [1, 2])
def test_complex_inputs_take_the_reference_path(key, cp):
    """A complex token or length tensor reaches C (Python checks no dtypes), whose DLPack parser does
    not map it: _C.Fallback, then the reference, exactly as before the check moved."""
    mesh = M2 if cp == 2 else None
    check(mesh, lambda: _b(**{key: lambda t: t.to(torch.complex64)}), path="reference", **_MEDIA)
    if key == "seq_lens_padded":
        check_direct("_chunk_partition_indices", lambda: (_b(seq_lens_padded=lambda t: t.to(torch.complex64)),),
                     M2, cp_mesh=M2, num_chunks=1, seq_lens_padding_value=-1000)  # fmt: skip


@pytest.mark.parametrize("mesh,C", [(None, 1), (M2, 2)])
def test_nested_seq_lens_take_the_reference_path(mesh, C):
    """seq_lens as a nested tensor (2-D, int64): DLPack refuses it before any shape is read, so the
    reference decides (the snapshot helpers cannot compare nested tensors: outcomes by hand)."""
    with warnings.catch_warnings():  # nested tensors warn that they are a prototype
        warnings.simplefilter("ignore")
        lens = torch.nested.nested_tensor([torch.tensor([16])] * 4)
    outcomes = []
    for module in (ref, nat):
        with fake_dist(mesh):
            outcomes.append(call(module.shard_batch_for_mimo_te, mesh, None, _b(seq_lens=lens), num_chunks=C))
    (rk, rv), (nk, nv) = outcomes
    assert nat.fast_path_info()["path"] == "reference", nat.fast_path_info()
    assert (rk, type(rv), str(rv)) == (nk, type(nv), str(nv)) and rk == "err"


def test_mimo_run_unmapped_inputs_are_fallback():
    """``_C.mimo_run``: a token or length tensor a DLPack view cannot hold (a dtype C does not map, more
    than 8 dimensions) raises ``_C.Fallback`` with the parser's message; misuse stays an error."""
    from torch.utils.dlpack import to_dlpack

    from nemo_cp_native import _C

    z, lens = torch.zeros(4, 16, dtype=torch.long), torch.full((4, 1), 16)
    plan = nat._plan((4, 16, 1, 1, 1, 2, 7))
    out = torch.empty(plan.out_words, dtype=torch.int64)

    def run(**over):
        caps = {k: to_dlpack(t) for k, t in (("input_ids", z), ("labels", z), ("position_ids", z), ("seq_lens", lens),
                                             ("seq_lens_padded", lens), ("out", out))}  # fmt: skip
        caps.update(over)
        return _C.mimo_run(**caps, num_chunks=1, cp_size=2, cp_rank=0, image_token_id=None, video_token_id=None,
                           sentinel=-1000, outputs=7, stream=None)  # fmt: skip

    run()
    unmapped = [("input_ids", z.to(torch.complex64), "input_ids: unsupported dtype (DLPack code 5, 64 bits)"),
                ("labels", z.to(torch.uint8), "labels: unsupported dtype (DLPack code 1, 8 bits)"),
                ("position_ids", z.reshape(4, 16, *[1] * 7), "position_ids: ndim 9 is out of range [0, 8]"),
                ("seq_lens", lens.short(), "seq_lens: unsupported dtype (DLPack code 0, 16 bits)"),
                ("seq_lens_padded", lens.to(torch.complex128),
                 "seq_lens_padded: unsupported dtype (DLPack code 5, 128 bits)")]  # fmt: skip
    for key, t, message in unmapped:
        with pytest.raises(_C.Fallback) as info:
            run(**{key: to_dlpack(t)})
        assert str(info.value) == message
    used = to_dlpack(z)
    torch.from_dlpack(used)  # consumed: a caller's bug, not an input outside the path
    with pytest.raises(ValueError, match="not an unconsumed DLPack tensor"):
        run(labels=used)
    with pytest.raises(ValueError, match="out: unsupported dtype"):
        run(out=to_dlpack(torch.zeros(8, dtype=torch.complex64)))
    with pytest.raises(ValueError, match="input_ids must be a tensor, not None"):
        run(input_ids=None)


_COVER = "MiMo TE THD seq_lens_padded must cover each pipeline chunk: got {} slots for {} tokens"
_DIVIS = "MiMo TE context parallelism requires every padded document length to be divisible by 2 * cp_size ({}); got {}"
_POS = "MiMo TE THD padded document lengths must be positive"
_THD = ("MiMo packed context parallelism requires qkv_format='thd'; "
        "packed NEAT masks cannot be represented by TE context parallelism")
_IDS = "MiMo TE THD sharding requires input_ids [batch, sequence]"
_PADDED = "MiMo TE THD sharding requires seq_lens_padded [batch, documents]"

ERROR_CASES = [  # (id, mesh, batch factory, options, type, exact message, path of the native call)
    ("loss_mask", M2, _b, {"loss_mask": torch.ones(4, 16)}, ValueError,
     "MiMo TE THD sharding does not support an external loss_mask; encode it in labels", None),
    ("no_qkv_format", M2, lambda: _b(qkv_format=_DROP), {}, ValueError, _THD, None),
    ("bshd", None, lambda: _b(qkv_format="bshd"), {}, ValueError, _THD, None),
    ("no_input_ids", M2, lambda: _b(input_ids=_DROP), {}, ValueError, _IDS, None),
    ("input_ids_1d", M2, lambda: _b(input_ids=lambda t: t.reshape(-1)), {}, ValueError, _IDS, None),
    ("input_ids_3d", M2, lambda: _b(input_ids=lambda t: t[None]), {}, ValueError, _IDS, None),
    ("input_ids_list", M2, lambda: _b(input_ids=[[1, 2]]), {}, ValueError, _IDS, None),
    ("mrope_pp", M2, lambda: _b(position_ids=torch.zeros(3, 4, 16, dtype=torch.long)), {"num_chunks": 2}, ValueError,
     "MiMo THD pipeline parallelism currently requires one-dimensional position_ids", None),
    ("no_seq_lens_padded_cp1", None, lambda: _b(seq_lens_padded=_DROP), {}, ValueError, _PADDED, "reference"),
    ("seq_lens_padded_1d", M2, lambda: _b(seq_lens_padded=lambda t: t.reshape(-1)), {}, ValueError, _PADDED,
     "reference"),
    ("seq_lens_padded_list", M2, lambda: _b(seq_lens_padded=[[16]] * 4), {}, ValueError, _PADDED, "reference"),
    ("B_not_divisible_media", M2, lambda: _b(B=3), {"num_chunks": 2, "image_token_id": 5}, ValueError,
     "MiMo THD num_chunks=2 must evenly divide batch size 3", "reference"),
    ("B_not_divisible", None, lambda: _b(B=6), {"num_chunks": 4}, ValueError,
     "MiMo THD num_chunks=4 must evenly divide batch size 6", "reference"),
    ("num_chunks_0", M2, _b, {"num_chunks": 0}, ZeroDivisionError, "integer modulo by zero", "reference"),
    ("zero_length", M2, lambda: _b(seq_lens_padded=torch.tensor([[16, 0]] * 4)), {}, ValueError, _POS, "native"),
    ("negative_length", M4, lambda: _b(seq_lens_padded=torch.tensor([[24, -8]] * 4)), {}, ValueError, _POS, "native"),
    ("all_sentinel", M2, lambda: _b(seq_lens_padded=torch.full((4, 2), -1000)), {}, ValueError, _POS, "native"),
    ("chunk1_all_sentinel", M2, lambda: _b(seq_lens_padded=torch.tensor([[16], [16], [-1000], [-1000]])),
     {"num_chunks": 2}, ValueError, _POS, "native"),
    ("wraps_to_zero_int32", M2, lambda: _b(seq_lens_padded=torch.tensor([[2**32, 16]] * 4)), {}, ValueError, _POS,
     "native"),
    ("coverage_short", M2, lambda: _b(seq_lens_padded=torch.tensor([[4, -1000]] + [[16, -1000]] * 3)), {},
     ValueError, _COVER.format(52, 64), "native"),
    ("coverage_chunk1", M4, lambda: _b(seq_lens_padded=torch.tensor([[16], [16], [16], [24]])), {"num_chunks": 2},
     ValueError, _COVER.format(40, 32), "native"),
    ("divisibility", M2, lambda: _b(seq_lens_padded=torch.tensor([[6, 10]] * 4)), {}, ValueError,
     _DIVIS.format(4, [6, 10] * 4), "native"),
    ("divisibility_before_later_chunk", M8,
     lambda: _b(seq_lens_padded=torch.tensor([[8, 8], [16, -1000], [0, 16], [16, 0]])),
     {"num_chunks": 2}, ValueError, _DIVIS.format(16, [8, 8, 16]), "native"),
    ("divisibility_cp_2_pow_30", FakeCPMesh(2**30, 1), _b, {}, ValueError,
     lambda: _DIVIS.format(2**31, [v for v in _b()["seq_lens_padded"].flatten().tolist() if v != -1000]), None),
    ("divisibility_cp_3", FakeCPMesh(3, 2), lambda: _b(S=24, **_lens([9, 15], [9, 15])), {}, ValueError,
     _DIVIS.format(6, [9, 15] * 4), "native"),
    ("divisibility_cp_6", FakeCPMesh(6, 4), lambda: _b(S=24, **_lens([18, 6], [18, 6])), {}, ValueError,
     _DIVIS.format(12, [18, 6] * 4), "native"),
    ("divisibility_cp_3_pow_29", FakeCPMesh(3 * 2**29, 7), _b, {}, ValueError,
     lambda: _DIVIS.format(3 * 2**30, [v for v in _b()["seq_lens_padded"].flatten().tolist() if v != -1000]), None),
    ("S_below_2cp", M8, lambda: _b(S=8, **_lens([8], [8])), {},
     ValueError, _DIVIS.format(16, [8] * 4), "native"),
    ("padding_id_is_content", None, lambda: _b(seq_lens=None, input_ids=_ZERO_COL3), {}, ValueError,
     "padding_token_id=0 also occurs as content, so padding cannot be inferred from token values. Supply "
     "seq_lens/seq_lens_padded (or an unused padding_token_id).", "reference"),
    ("no_labels", M2, lambda: _b(labels=_DROP), {}, KeyError, "labels", "reference"),
    ("no_position_ids", None, lambda: _b(position_ids=_DROP), {}, KeyError, "position_ids", "reference"),
    ("no_seq_lens", None, lambda: _b(seq_lens=_DROP), {}, KeyError, "seq_lens", "reference"),
]  # fmt: skip


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_match_the_oracle(case):
    """Every error of spec §4-§5 (and the framework's on MiMo's path): type and exact message."""
    _, mesh, make, opts, exc, message, path = case
    r, n, took = run_both("shard_batch_for_mimo_te", mesh, lambda: (mesh, None, make()), **opts)
    assert_same_outcome(r, n)
    message = message() if callable(message) else message
    assert n[0] == "err" and type(n[1]) is exc, n
    assert str(n[1]) == (repr(message) if exc is KeyError else message)
    if path is not None:
        assert took == path


def test_cp_size_over_int32_is_the_oracle_error():
    """A mesh wider than int32 (impossible, but not a crash): the oracle's error, exactly."""
    for size in (2**31, 2**40):
        mesh = FakeCPMesh(size, 1)
        r, n, _ = run_both("_chunk_partition_indices", mesh, lambda: (_b(),), cp_mesh=mesh, num_chunks=1,  # noqa: B023
                           seq_lens_padding_value=-1000)  # fmt: skip
        assert_same_outcome(r, n)


# Direct calls of the helpers --------------------------------------------------------------

FLATTEN_ARGS = [lambda i, c=c: (i, c) for c in (1, 2, 4, 3, 0, -1, 2**40, True, 2.0)] + [
    lambda i: (i.t(), 2), lambda i: (i[:, ::2], 2), lambda i: (torch.zeros(2, 2, 2), 1), lambda i: (torch.zeros(8), 1),
    lambda i: (torch.zeros(0, 5), 2), lambda i: (torch.zeros(4, 0), 2), lambda i: (i.float(), 2),
    lambda i: (i.bool(), 4)]  # fmt: skip
_TOKEN_IDS = (None, 5, 5.9, True, -1, 2**40, torch.tensor(5))
MEDIA_ARGS = [lambda i, t=t, c=c: (i, t, c) for t in _TOKEN_IDS for c in (1, 2, 0, 3)]
MEDIA_ARGS += [lambda i: (i.float(), 5, 2), lambda i: (i.int(), 2**33 + 5, 2), lambda i: (i[None], 5, 1),
               lambda i: (i, "5", 1)]  # fmt: skip


@pytest.mark.parametrize("i", range(len(FLATTEN_ARGS)))
def test_flatten_chunks_direct(i):
    ids = _b()["input_ids"]
    check_direct("_flatten_chunks", lambda: FLATTEN_ARGS[i](ids))


@pytest.mark.parametrize("i", range(len(MEDIA_ARGS)))
def test_media_mask_direct(i):
    ids = _b()["input_ids"]
    check_direct("_media_mask", lambda: MEDIA_ARGS[i](ids))


_NO_LOCAL_RANK = types.SimpleNamespace(size=lambda: 2, get_group=lambda: None)  # rank falls back to 0
PARTITION_CASES = [  # (id, batch factory, kwargs, dist mesh)
    ("process_group", _b, {"cp_mesh": M2, "num_chunks": 2}, M2),
    ("local_rank_without_dist", _b, {"cp_mesh": FakeCPMesh(2, 0), "num_chunks": 4}, None),
    ("no_get_local_rank", _b, {"cp_mesh": _NO_LOCAL_RANK, "num_chunks": 2}, None),
    ("cp1_none", _b, {"cp_mesh": None, "num_chunks": 4}, None),
    ("cp1_mesh", lambda: _b(seq_lens_padded=lambda t: t[:2]), {"cp_mesh": FakeCPMesh(1, 0), "num_chunks": 2}, None),
    ("num_chunks_true", _b, {"cp_mesh": M2, "num_chunks": True}, M2),
    ("num_chunks_0", _b, {"cp_mesh": M2, "num_chunks": 0}, M2),
    ("num_chunks_negative", _b, {"cp_mesh": None, "num_chunks": -2}, None),
    ("num_chunks_not_dividing", _b, {"cp_mesh": M2, "num_chunks": 3}, M2),
    ("num_chunks_huge", _b, {"cp_mesh": M2, "num_chunks": 2**62}, M2),
    ("num_chunks_float", _b, {"cp_mesh": M2, "num_chunks": 2.0}, M2),
    ("sentinel_0", lambda: _b(seq_lens_padded=torch.tensor([[16, 0]] * 4)), {"seq_lens_padding_value": 0}, M2),
    ("sentinel_float", _b, {"seq_lens_padding_value": -1000.0}, M2),
    ("sentinel_beyond_int32", lambda: _b(seq_lens_padded=lambda t: t.int()), {"seq_lens_padding_value": 2**40}, M2),
    # torch compares an int32 table with the sentinel cast to int32 (wrapped mod 2^32): -2^63 drops the
    # zero lengths, 2^32 - 1000 drops the -1000 entries (fuzz seed 99173, mimo_helpers:44811)
    ("sentinel_wraps_to_0", lambda: _b(seq_lens_padded=torch.tensor([[0, 16]] * 4, dtype=torch.int32)),
     {"seq_lens_padding_value": -(2**63)}, M2),
    ("sentinel_wraps_to_0_coverage", lambda: _b(seq_lens_padded=torch.tensor([[0, 4, 4]] * 4, dtype=torch.int32)),
     {"seq_lens_padding_value": -(2**63)}, M2),
    ("sentinel_wraps_to_-1000", lambda: _b(seq_lens_padded=torch.tensor([[8, -1000, 8]] * 4, dtype=torch.int32)),
     {"seq_lens_padding_value": 2**32 - 1000}, M2),
    ("sentinel_wraps_int64_table", lambda: _b(seq_lens_padded=torch.tensor([[8, -1000, 8]] * 4)),
     {"seq_lens_padding_value": 2**32 - 1000}, M2),
    ("float_ids", lambda: _b(input_ids=lambda t: t.float()), {"cp_mesh": M2, "num_chunks": 2}, M2),
    ("float_padded", lambda: _b(seq_lens_padded=lambda t: t.float()), {}, M2),
    ("uint32_padded", lambda: _b(seq_lens_padded=lambda t: t.to(torch.uint32)), {}, M2),
    ("int16_ids", lambda: _b(input_ids=lambda t: t.short()), {"num_chunks": 2}, M2),
    ("strided_padded", lambda: _b(seq_lens_padded=_S), {"num_chunks": 4}, M2),
    ("no_padded", lambda: _b(seq_lens_padded=_DROP), {}, M2),
    ("padded_no_columns", lambda: _b(seq_lens_padded=torch.zeros(4, 0, dtype=torch.long)), {"num_chunks": 2}, M2),
    ("B0", lambda: _b(**_empty(0, 16)), {}, M2),
    ("B0_cp1", lambda: _b(**_empty(0, 16)), {"cp_mesh": None}, None),
    ("S0_cp2", lambda: _b(**_empty(4, 0)), {"num_chunks": 2}, M2),
    ("divisibility", lambda: _b(seq_lens_padded=torch.tensor([[6, 10]] * 4)), {"num_chunks": 2}, M2),
    ("coverage", lambda: _b(seq_lens_padded=torch.tensor([[4, 8]] * 4)), {"num_chunks": 2}, M2),
    ("cp3", lambda: _b(input_ids=torch.zeros(4, 12, dtype=torch.long), seq_lens_padded=torch.tensor([[6, 6]] * 4)),
     {"cp_mesh": FakeCPMesh(3, 2)}, None),
]  # fmt: skip


@pytest.mark.parametrize("case", PARTITION_CASES, ids=[c[0] for c in PARTITION_CASES])
def test_chunk_partition_indices_direct(case):
    _, make, kw, dist_mesh = case
    kw = {"cp_mesh": M2, "num_chunks": 1, "seq_lens_padding_value": -1000, **kw}
    check_direct("_chunk_partition_indices", lambda: (make(),), dist_mesh, **kw)


_FUZZ_VALUES = torch.tensor([-1000, -1000, -1000, 0, 1, 2, 3, 4, 5, 8, 12, 16, -1, -7, 2**31 - 1, 2**31, 2**32 + 4,
                             2**62, -(2**62), 2**63 - 1, -(2**63)])  # fmt: skip


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_metadata_fuzz(cp, ncp_seed):
    """Random, mostly invalid length tables (widths 0..3, sentinels anywhere, zero, negative, wrapping
    values, int32/int64): native and oracle agree on the outcome, whatever it is."""
    g = gen(ncp_seed)
    flip = lambda p: bool(torch.rand((), generator=g) < p)  # noqa: E731

    def table():
        shape = (4, int(torch.randint(0, 4, (), generator=g)))
        if flip(0.4):
            t = _FUZZ_VALUES[torch.randint(0, len(_FUZZ_VALUES), shape, generator=g)]
        else:
            t = torch.randint(-3, 20, shape, generator=g)
            t = t.where(torch.rand(shape, generator=g) > 0.2, torch.tensor(-1000))
        return t.int() if flip(0.3) else t

    for _ in range(50):
        C = [1, 2, 4][int(torch.randint(0, 3, (), generator=g))]
        lens = table()
        padded = _b()["seq_lens_padded"] if cp == 2 and flip(0.4) else table()
        mesh = None if cp == 1 else FakeCPMesh(cp, int(torch.randint(0, cp, (), generator=g)))
        make = lambda: _b(seq_lens=lens, seq_lens_padded=padded)  # noqa: B023, E731
        check(mesh, make, path=None, num_chunks=C, image_token_id=5)
