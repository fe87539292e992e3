"""The native MiMo sharder in its surroundings: process groups, the framework, upstream, CUDA.

1. Real gloo process groups (one 4-rank spawn): cp = 4 (a 1-D mesh) and cp = 2 (the "cp" dim of a
   dp x cp mesh): native == oracle on every rank, the ranks' local indices cover every token of
   every chunk exactly once and their gathered tokens rebuild the stream; the sharder's
   ``gather_token_tensor`` undoes the shard.
2. ``make_mimo_te_cp_sharder`` unbound and rebound to a mesh, with a model (setup side effect,
   token verbs); parity with upstream's own ``shard_batch_for_mimo_te`` on a handful of matrix cases;
   ``ensure_mimo_te_context_parallel`` looked up on upstream's ``cp`` module at call time;
   ``nemo_cp_native.patch()`` / ``unpatch()`` / ``patched()`` swap and restore upstream's names.
3. The one native call writes every element of its outputs and nothing around them (STYLE 12).
4. CUDA (``@pytest.mark.cuda``): native on CUDA == native on CPU == oracle; devices of the outputs,
   with the metadata on the GPU or on the CPU; CPU/GPU mixes; the host-sync budget (at most 1 per
   call, 0 with the metadata on the CPU, while the reference makes many), and that the call does
   not wait for the GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from nemo_cp_native.testing import count_syncs as _count_syncs
from _mesh import FakeCPMesh, fake_dist, run_distributed
from _upstream import (
    FakeMiMoModel,
    assert_same,
    assert_same_outcome,
    call,
    case_meshes,
    draw_case,
    fake_transformer_engine,
    gen,
    upstream_modules,
    upstream_version,
)

import nemo_cp_native
from nemo_cp_native import _C, _compat
from nemo_cp_native import mimo as nat
from nemo_cp_native.reference import mimo as ref
from nemo_cp_native.testing import make_mimo_batch

IMG, VID = 151655, 151656
PATCHED_NAMES = ("shard_batch_for_mimo_te", "make_mimo_te_cp_sharder", "_chunk_partition_indices", "_media_mask",
                 "_flatten_chunks")  # fmt: skip
META = ("seq_lens", "seq_lens_padded")
TOKEN_OUT = ("input_ids", "labels", "position_ids", "padding_mask", "_mimo_thd_local_indices",
             "_mimo_global_image_mask", "_mimo_global_video_mask")  # fmt: skip
FRAMEWORK_META_OUT = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


# =============================================================================================
# 1. Real gloo process groups
# =============================================================================================


def _gloo_worker(rank, world_size, seed):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    g = gen(seed)  # the same draws on every rank
    for cp in (world_size, 2):
        if cp == world_size:
            mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        else:
            mesh = init_device_mesh("cpu", (world_size // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]
        group = mesh.get_group()
        for C in (1, 2, 4):
            batch, opts, _ = draw_case(g, B=4, C=C, cp=cp, S=2 * cp * 4, min_doc=C == 2, absorption=C == 4)
            r = call(ref.shard_batch_for_mimo_te, mesh, None, dict(batch), **opts)
            n = call(nat.shard_batch_for_mimo_te, mesh, None, dict(batch), **opts)
            assert nat.fast_path_info()["path"] == "native", nat.fast_path_info()
            assert r[0] == "ok", r
            assert_same_outcome(r, n)
            out = n[1][1]
            assert out["cp_rank"] == dist.get_rank(group=group) == rank % cp and out["cp_size"] == cp
            local = out["_mimo_thd_local_indices"].reshape(C, -1).contiguous()
            ids = out["input_ids"].reshape(C, -1).contiguous()
            all_local = [torch.empty_like(local) for _ in range(cp)]
            all_ids = [torch.empty_like(ids) for _ in range(cp)]
            dist.all_gather(all_local, local, group=group)
            dist.all_gather(all_ids, ids, group=group)
            stream = batch["input_ids"].reshape(C, -1).long()
            for c in range(C):
                idx = torch.cat([p[c] for p in all_local])
                assert torch.equal(idx.sort().values, torch.arange(stream.shape[1])), f"cp {cp} chunk {c}: not covered"
                rebuilt = torch.empty_like(stream[c])
                rebuilt[idx] = torch.cat([p[c] for p in all_ids])
                assert torch.equal(rebuilt, stream[c])
            if C == 1:  # the sharder's token verbs, through the real collective
                sharder = nat.make_mimo_te_cp_sharder(model=None, num_chunks=1, image_token_id=opts["image_token_id"],
                                                      video_token_id=opts["video_token_id"])  # fmt: skip
                bound = _compat.ContextParallelSharder(device_mesh=mesh, shard_batch=sharder.shard_batch,
                                                       local_token_global_indices=None, shard_layout=None)  # fmt: skip
                _, sharded = bound.shard(dict(batch))
                assert_same(sharded, out)
                back = bound.gather_token_tensor(sharded["labels"], seq_dim=0, trim=True)
                assert torch.equal(back, batch["labels"].long())


@pytest.mark.dist
def test_gloo_every_rank(ncp_seed):
    """One 4-rank gloo world (process start-up dominates the cost) covering cp = 4 and cp = 2."""
    run_distributed(_gloo_worker, 4, ncp_seed, timeout=150)


# =============================================================================================
# 2. The sharder, upstream, patch()
# =============================================================================================


def upstream(test):
    """Skips cleanly when nemo_automodel is not importable (checked at run time: the import is slow)."""

    def run(*args, **kwargs):
        if upstream_modules() is None:
            pytest.skip("nemo_automodel's MiMo cp module is not importable")
        return test(*args, **kwargs)

    return pytest.mark.upstream(functools.wraps(test)(run))


@pytest.mark.parametrize("num_chunks", [1, 2])
def test_sharder(num_chunks, ncp_seed, monkeypatch):
    """Unbound and rebound (§8.3) sharders, the model setup side effect (§9) and the token verbs."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: "stream")  # setup needs a CUDA stream
    g = gen(ncp_seed)
    batch = make_mimo_batch(4, 16, num_chunks=num_chunks, cp_size=2, generator=g, image_token_id=IMG,
                            video_token_id=VID)  # fmt: skip
    meshes = [FakeCPMesh(2, 0), FakeCPMesh(2, 1)]
    kw = {"num_chunks": num_chunks, "image_token_id": IMG, "video_token_id": None}
    seen = []
    for module in (ref, nat):
        model = FakeMiMoModel()
        sharder = module.make_mimo_te_cp_sharder(model=model, **kw)
        assert type(sharder) is _compat.ContextParallelSharder
        assert sharder.shard_batch.func is module.shard_batch_for_mimo_te
        assert sharder.shard_batch.keywords == {"model": model, **kw}
        assert sharder.local_token_global_indices is None and sharder.shard_layout is None
        got = [sharder.shard(dict(batch)), sharder.shard_layout]  # no mesh: cp 1, no setup
        assert model.calls == []
        for mesh in meshes:
            bound = _compat.ContextParallelSharder(device_mesh=mesh, shard_batch=sharder.shard_batch,
                                                   local_token_global_indices=None, shard_layout=None)  # fmt: skip
            with fake_dist(mesh):
                got += [bound.shard(dict(batch)), bound.shard_layout, call(bound.shard_token_tensor, batch["labels"])]
                assert module is ref or nat.fast_path_info()["path"] == "native"
                bad = dict(batch, seq_lens_padded=torch.tensor([[6, 10]] * 4))
                got.append(call(bound.shard, bad))  # rejected after the (cached) setup
                got.append(call(module.shard_batch_for_mimo_te, mesh, None, dict(batch), model=FakeMiMoModel(False)))
                assert str(got[-1][1]) == ("MiMo context parallelism requires layers.0.self_attn to expose "
                                           "setup_cp_attention(cp_mesh).")  # fmt: skip
        assert [m for m, _ in model.calls] == [m for m in meshes for _ in range(2)]  # once per group, 2 layers
        seen.append(got + [model.calls])
    for r, n in zip(*seen):
        (assert_same_outcome if isinstance(r, tuple) and r[0] in ("ok", "err") else assert_same)(r, n)


@upstream
@pytest.mark.parametrize("B,C,cp", [(8, 4, 8), (4, 2, 2), (3, 1, 4), (6, 2, 1), (2, 1, 8)])
def test_upstream_parity(B, C, cp, ncp_seed):
    """A handful of matrix cases against upstream's own shard_batch_for_mimo_te (TE = our oracle)."""
    print(f"upstream nemo-automodel {upstream_version()}")
    up_cp = upstream_modules()[0]
    g = gen(ncp_seed)
    for kind in ({"min_doc": True, "absorption": False}, {"absorption": True}):
        batch, opts, _ = draw_case(g, B=B, C=C, cp=cp, S=2 * cp * 3, **kind)
        for mesh in case_meshes(cp, g):
            with fake_dist(mesh), fake_transformer_engine():
                up = call(up_cp.shard_batch_for_mimo_te, mesh, None, dict(batch), **opts)
            with fake_dist(mesh):
                mine = call(nat.shard_batch_for_mimo_te, mesh, None, dict(batch), **opts)
            assert nat.fast_path_info()["path"] == "native" and up[0] == "ok", up
            assert_same_outcome(up, mine)


@upstream
def test_ensure_is_looked_up_on_upstreams_cp_module(monkeypatch, ncp_seed):
    """Issue 17: upstream's ``shard_batch_for_mimo_te`` calls the ``ensure_mimo_te_context_parallel``
    that its ``cp`` module holds at call time; so do ours (function, sharder, patched upstream name),
    so a monkeypatch of ``cp.ensure_mimo_te_context_parallel`` reaches all of them, and one of
    ``parallelization.ensure_mimo_te_context_parallel`` (where we used to read it) reaches none."""
    import importlib

    up_cp = upstream_modules()[0]
    up_par = importlib.import_module(up_cp.__name__.rsplit(".", 1)[0] + ".parallelization")
    batch = make_mimo_batch(4, 16, num_chunks=1, cp_size=2, generator=gen(ncp_seed), image_token_id=IMG)
    mesh = FakeCPMesh(2, 1)
    monkeypatch.setattr(up_par, "ensure_mimo_te_context_parallel", lambda *a: pytest.fail("parallelization's copy"))

    def via_sharder(cp_mesh, tp_mesh, b, *, model, **kw):
        return nat.make_mimo_te_cp_sharder(model=model, num_chunks=1, **kw).shard_batch(cp_mesh, tp_mesh, b)

    def via_patched_upstream(*args, **kw):
        with nemo_cp_native.patched():
            assert up_cp.shard_batch_for_mimo_te is nat.shard_batch_for_mimo_te
            return up_cp.shard_batch_for_mimo_te(*args, **kw)

    entries = {"upstream": up_cp.shard_batch_for_mimo_te, "native": nat.shard_batch_for_mimo_te,
               "sharder": via_sharder, "patched": via_patched_upstream}  # fmt: skip
    for name, entry in entries.items():
        calls, model = [], object()
        monkeypatch.setattr(up_cp, "ensure_mimo_te_context_parallel", lambda m, c: calls.append((m, c)))  # noqa: B023
        with fake_dist(mesh), fake_transformer_engine():
            out = entry(mesh, None, dict(batch), model=model, image_token_id=IMG, video_token_id=None)
        assert calls == [(model, mesh)], name
        assert out[1]["cp_rank"] == 1


def test_ensure_without_upstream_runs_the_stand_in(monkeypatch, ncp_seed):
    """Without an importable upstream ``cp`` module the package's stand-in runs, also looked up at call time."""
    import sys

    monkeypatch.setitem(sys.modules, ref._UPSTREAM_CP, None)  # import fails as if upstream were absent
    monkeypatch.setattr(ref, "_no_upstream_cp", [])
    calls = []
    monkeypatch.setattr(_compat, "ensure_mimo_te_context_parallel", lambda m, c: calls.append((m, c)))
    batch = make_mimo_batch(4, 16, num_chunks=1, cp_size=2, generator=gen(ncp_seed))
    mesh, model = FakeCPMesh(2, 0), object()
    with fake_dist(mesh):
        nat.shard_batch_for_mimo_te(mesh, None, dict(batch), model=model)
        nat.shard_batch_for_mimo_te(mesh, None, dict(batch), model=model)
    assert calls == [(model, mesh)] * 2 and ref._no_upstream_cp == [True]


@upstream
def test_patch_and_unpatch():
    import sys

    up_cp = upstream_modules()[0]
    up_model = sys.modules.get("nemo_automodel.components.models.mimo_v2_flash.model")
    if up_model is None:
        import nemo_automodel.components.models.mimo_v2_flash.model as up_model
    originals = {n: getattr(up_cp, n) for n in PATCHED_NAMES}
    original_model_sharder = up_model.make_mimo_te_cp_sharder
    assert original_model_sharder is originals["make_mimo_te_cp_sharder"]
    try:
        swapped = nemo_cp_native.patch()
        assert {f"{up_cp.__name__}.{n}" for n in PATCHED_NAMES} <= set(swapped)
        assert f"{up_model.__name__}.make_mimo_te_cp_sharder" in swapped
        for n in PATCHED_NAMES:
            assert getattr(up_cp, n) is getattr(nat, n)
        assert up_model.make_mimo_te_cp_sharder is nat.make_mimo_te_cp_sharder
        assert nemo_cp_native.patch() == []  # idempotent
        sharder = up_model.make_mimo_te_cp_sharder(model=None, num_chunks=1, image_token_id=IMG, video_token_id=None)
        assert sharder.shard_batch.func is nat.shard_batch_for_mimo_te
    finally:
        nemo_cp_native.unpatch()
    for n in PATCHED_NAMES:
        assert getattr(up_cp, n) is originals[n]
    assert up_model.make_mimo_te_cp_sharder is original_model_sharder
    with nemo_cp_native.patched():
        assert up_cp.shard_batch_for_mimo_te is nat.shard_batch_for_mimo_te
    assert up_cp.shard_batch_for_mimo_te is originals["shard_batch_for_mimo_te"]


# =============================================================================================
# 3. Output guards of the one native call
# =============================================================================================

PATTERN = 0xA5  # every byte of the poisoned buffers; no int64 output and no bool byte can hold it
GUARD = 9  # int64 words of guard band on each side


def _guarded(words, device):
    """(buffer, view): ``words`` poisoned int64 words with poisoned guard bands on both sides."""
    buf = torch.full(((words + 2 * GUARD) * 8,), PATTERN, dtype=torch.uint8, device=device).view(torch.int64)
    return buf, buf[GUARD : GUARD + words]


@pytest.mark.parametrize(
    "device,meta", [("cpu", "cpu"), pytest.param("cuda", "cpu", marks=pytest.mark.cuda),
                    pytest.param("cuda", "cuda", marks=pytest.mark.cuda)],
    ids=["cpu", "cuda_meta_cpu", "cuda_meta_cuda"],
)  # fmt: skip
@pytest.mark.parametrize("cp,C", [(1, 1), (1, 2), (2, 1), (4, 4), (8, 2)])
def test_one_call_writes_every_output_and_nothing_else(cp, C, device, meta, ncp_seed):
    """``_C.mimo_run`` into a poisoned buffer inside guard bands (STYLE 12): every element of every
    output is written, nothing outside ``out`` / ``host`` is, and the values are the sharder's."""
    from torch.utils.dlpack import to_dlpack

    g = gen(ncp_seed)
    batch, _, _ = draw_case(g, B=4, C=C, cp=cp, S=2 * cp * 3, image_token_id=IMG, video_token_id=VID)
    batch = {k: v.to(meta if k in META else device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    rank = int(torch.randint(0, cp, (), generator=g))
    outputs = nat._OUT_PAD | nat._OUT_IMAGE | nat._OUT_VIDEO | (nat._OUT_TOKENS | nat._OUT_POS if cp > 1 else 0)
    assert pos is not None or cp == 1  # draw_case leaves position_ids out only where upstream allows it
    sl, slp = (batch[k].cpu() for k in META)
    plan = nat._plan((4, ids.shape[1], sl.shape[1], slp.shape[1], C, cp, outputs))
    out_buf, out = _guarded(plan.out_words, device)
    host_buf, host = _guarded(plan.lay_words, "cpu") if (device, meta) == ("cuda", "cpu") else (None, None)
    info = _C.mimo_run(input_ids=to_dlpack(ids), labels=to_dlpack(labels),
                       position_ids=None if pos is None else to_dlpack(pos), seq_lens=to_dlpack(sl),
                       seq_lens_padded=to_dlpack(slp), out=to_dlpack(out), host=None if host is None else to_dlpack(host),
                       num_chunks=C, cp_size=cp, cp_rank=rank, image_token_id=IMG, video_token_id=VID, sentinel=-1000,
                       outputs=outputs, stream=nat._stream(ids.device))  # fmt: skip
    poison = int(torch.full((8,), PATTERN, dtype=torch.uint8).view(torch.int64))
    for buf in (out_buf, host_buf):
        if buf is not None:
            assert (buf[:GUARD] == poison).all() and (buf[-GUARD:] == poison).all(), "wrote outside the buffer"
    got = {}
    for name, is_bool, size, stride, offset in plan.views:
        base = out.view(torch.bool) if is_bool else out
        view = base.as_strided(size, stride, base.storage_offset() + offset)  # out sits inside the guards
        raw = view.view(torch.uint8) if is_bool else view
        assert ((raw <= 1) if is_bool else (raw != poison)).all(), f"{name}: element not written"
        got[name] = view
    total = info[4] + (C + 1) // 2  # maxlen_off + its words: the end of the layout block
    if host is not None:  # the host pass writes the host block itself (its guards are checked above)
        assert (host[:total] != poison).any()
    mesh = FakeCPMesh(cp, rank)
    with fake_dist(mesh):
        _, want, _ = ref.shard_batch_for_mimo_te(mesh, None, _to(batch, "cpu"), num_chunks=C, image_token_id=IMG,
                                                 video_token_id=VID)  # fmt: skip
    expect = {"local": "_mimo_thd_local_indices", "pad": "padding_mask", "image": "_mimo_global_image_mask",
              "video": "_mimo_global_video_mask", "ids": "input_ids", "labels": "labels", "pos": "position_ids"}
    for name, view in got.items():
        w = want[expect[name]]
        assert torch.equal(view.cpu(), w.reshape(view.shape).to(view.dtype)), name


@pytest.mark.parametrize("cp,C", [(1, 1), (8, 1), (8, 4), (6, 2)])
def test_kernel_table_holds_what_the_rows_hold(cp, C, ncp_seed):
    """The kernel table (the launch's parameter block on CUDA) is packed to the documents the rows
    hold, not to the tables' width: 1 + 8 words a chunk of descriptors, then per chunk its TE
    boundaries (int32, W > 1), its padding starts (documents + 1) and its real lengths."""
    from torch.utils.dlpack import to_dlpack

    g = gen(ncp_seed)
    batch = make_mimo_batch(8, 2 * cp * 64, num_chunks=C, cp_size=cp, docs_per_row=(2, 9), generator=g)
    sl, slp = batch["seq_lens"], batch["seq_lens_padded"]
    pad = torch.cat([slp, torch.full((8, 7), -1000, dtype=slp.dtype)], 1)  # wider tables, same documents
    real = torch.cat([sl, torch.full((8, 5), -1000, dtype=sl.dtype)], 1)
    outputs = nat._OUT_PAD | (nat._OUT_TOKENS | nat._OUT_POS if cp > 1 else 0)
    words = []
    for a, b in ((sl, slp), (real, pad)):
        plan = nat._plan((8, 2 * cp * 64, a.shape[1], b.shape[1], C, cp, outputs))
        out = torch.empty(plan.out_words, dtype=torch.int64)
        info = _C.mimo_run(input_ids=to_dlpack(batch["input_ids"]), labels=to_dlpack(batch["labels"]),
                           position_ids=to_dlpack(batch["position_ids"]), seq_lens=to_dlpack(a),
                           seq_lens_padded=to_dlpack(b), out=to_dlpack(out), host=None, num_chunks=C, cp_size=cp,
                           cp_rank=0, image_token_id=None, video_token_id=None, sentinel=-1000, outputs=outputs,
                           stream=None)  # fmt: skip
        words.append(info[0])  # cu_off: the int32 outputs follow the kernel table
    want = 1 + 8 * C
    for c in range(C):
        n_p = int((slp[c * 8 // C : (c + 1) * 8 // C] != -1000).sum())
        n_r = int((sl[c * 8 // C : (c + 1) * 8 // C] != -1000).sum())
        want += ((n_p + 2) // 2 if cp > 1 else 0) + n_p + 1 + n_r
    assert words == [want, want]


@pytest.mark.parametrize("device,meta", [("cpu", "cpu"), pytest.param("cuda", "cpu", marks=pytest.mark.cuda)],
                         ids=["cpu", "cuda_meta_cpu"])  # fmt: skip
@pytest.mark.parametrize("cp,C", [(1, 1), (1, 2), (2, 1), (8, 1), (4, 4)])
def test_outputs_are_disjoint(cp, C, device, meta, ncp_seed):
    """The outputs of one call are pieces of one buffer (``unsafe_split_with_sizes``: no autograd view
    tracking) or views of the caller's tensors: an in-place write into any one of them changes no
    other output and no input, and every output stays equal to the oracle's until written."""
    g = gen(ncp_seed)
    batch, _, _ = draw_case(g, B=4, C=C, cp=cp, S=2 * cp * 3, image_token_id=IMG, video_token_id=VID)
    batch = {k: v.to(meta if k in META else device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    mesh = FakeCPMesh(cp, int(torch.randint(0, cp, (), generator=g))) if cp > 1 else None
    with fake_dist(mesh):
        _, out, layout = nat.shard_batch_for_mimo_te(mesh, None, dict(batch), num_chunks=C, image_token_id=IMG,
                                                     video_token_id=VID)  # fmt: skip
        assert nat.fast_path_info()["path"] == "native"
        _, want, _ = ref.shard_batch_for_mimo_te(mesh, None, _to(batch, "cpu"), num_chunks=C, image_token_id=IMG,
                                                 video_token_id=VID)  # fmt: skip
    inputs = {v.untyped_storage().data_ptr() for v in batch.values() if isinstance(v, torch.Tensor) and v.numel()}
    made = {k: v for k, v in out.items()  # views of the caller's tensors (as the reference's reshape makes) left out
            if isinstance(v, torch.Tensor) and v.numel() and v.untyped_storage().data_ptr() not in inputs}
    assert {"cu_seqlens", "padding_mask", "_mimo_thd_local_indices", "_mimo_global_image_mask"} <= set(made)
    if layout is not None:
        assert layout.local_token_global_indices is out["_mimo_thd_local_indices"]
    snap = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    for key in made:
        before = {k: v.clone() for k, v in made.items()}
        t = made[key]
        t.logical_not_() if t.dtype == torch.bool else t.add_(1)
        for other, v in made.items():
            if other != key:
                assert torch.equal(v, before[other]), f"writing {key} changed {other}"
        for k, v in snap.items():
            assert torch.equal(batch[k], v), f"writing {key} changed the input {k}"
        t.logical_not_() if t.dtype == torch.bool else t.sub_(1)
    for key, v in made.items():
        assert torch.equal(v.cpu(), want[key].to(v.dtype)), key


# =============================================================================================
# 4. CUDA
# =============================================================================================


def _to(obj, device, keep_cpu=()):
    """Tensors of nested dicts/lists/tuples/ShardLayouts moved to ``device`` (keys in keep_cpu stay)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: v if k in keep_cpu else _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)})
    return obj




def _check_devices(out, token_device, meta_device):
    for key in TOKEN_OUT:
        if isinstance(out.get(key), torch.Tensor):
            assert out[key].device == token_device, key
    for key in FRAMEWORK_META_OUT:
        if isinstance(out.get(key), torch.Tensor):
            assert out[key].device == meta_device, key


@pytest.mark.cuda
@pytest.mark.parametrize("draw", range(6))
def test_cuda_matches_cpu_and_oracle(draw, ncp_seed):
    """Metadata on the GPU, then on the CPU: values equal the CPU oracle's, devices as documented."""
    g = gen(ncp_seed)
    batch, opts, cp = draw_case(g)
    cuda = torch.device("cuda", torch.cuda.current_device())
    for mesh in case_meshes(cp, g):
        with fake_dist(mesh):
            want = ref.shard_batch_for_mimo_te(mesh, None, dict(batch), **opts)
            assert_same(nat.shard_batch_for_mimo_te(mesh, None, dict(batch), **opts), want)
            for keep in ((), META):
                got = nat.shard_batch_for_mimo_te(mesh, None, _to(batch, cuda, keep), **opts)
                assert nat.fast_path_info()["path"] == "native", nat.fast_path_info()
                _check_devices(got[1], cuda, torch.device("cpu") if keep else cuda)
                assert_same(_to(got, "cpu"), want)
                C = opts["num_chunks"]
                local = nat._chunk_partition_indices(_to(batch, cuda, keep), cp_mesh=mesh, num_chunks=C,
                                                     seq_lens_padding_value=-1000)  # fmt: skip
                assert local.device == cuda and torch.equal(local.cpu(), want[1]["_mimo_thd_local_indices"])


@pytest.mark.cuda
def test_cuda_large_batch_matches_cpu(ncp_seed):
    """B=8, S=32768, cp=8, 4 chunks, 16-64 documents per row: CUDA == CPU (both native)."""
    g = gen(ncp_seed)
    batch = make_mimo_batch(8, 32768, num_chunks=4, cp_size=8, docs_per_row=(16, 64), image_token_id=IMG,
                            video_token_id=VID, generator=g, min_doc=True)  # fmt: skip
    for rank in (0, 3, 7):
        mesh = FakeCPMesh(8, rank)
        with fake_dist(mesh):
            kw = {"num_chunks": 4, "image_token_id": IMG, "video_token_id": VID}
            cpu = nat.shard_batch_for_mimo_te(mesh, None, dict(batch), **kw)
            gpu = nat.shard_batch_for_mimo_te(mesh, None, _to(batch, "cuda"), **kw)
        assert_same(_to(gpu, "cpu"), cpu)


# csrc/cuda/thd_shard.cu: parameter blocks of 1024, 2048 and 3840 words; larger kernel tables are staged
PARAM_BLOCKS = (1024, 2048, 3840)


@pytest.mark.cuda
@pytest.mark.parametrize("C", [1, 4])
@pytest.mark.parametrize("docs,block", [((56, 64), 2048), ((110, 150), 3840), ((400, 600), None)],
                         ids=["table_in_16k_launch", "table_in_30k_launch", "table_staged"])  # fmt: skip
def test_cuda_meta_cpu_kernel_table_paths(docs, block, C, ncp_seed):
    """``seq_lens*`` on the host, tokens on the GPU (B=8, S=32768, cp=8): the kernel table rides in
    the launch's parameters when it fits in 30 KiB (the smallest of three blocks that holds it) and
    is staged through pinned memory otherwise; each equals the native CPU pass, at two ranks.
    (Small batches take the 8 KiB block: test_cuda_matches_cpu_and_oracle.) The table takes about
    2.5 words per document (csrc/core/thd_layout.h: half a word per TE boundary, one per padding
    start and one per real length, plus 8 a chunk): 8 rows of 56-64 documents make 1130-1290
    words, of 110-150 make 2210-3010, of 400-600 over 8000, so every seed's table lands in the block
    named."""
    from torch.utils.dlpack import to_dlpack

    g = gen(ncp_seed)
    batch = make_mimo_batch(8, 32768, num_chunks=C, cp_size=8, docs_per_row=docs, image_token_id=IMG,
                            video_token_id=VID, generator=g)  # fmt: skip
    gpu_batch = _to(batch, "cuda", META)
    kw = {"num_chunks": C, "image_token_id": IMG, "video_token_id": VID}
    for rank in (0, 5):
        mesh = FakeCPMesh(8, rank)
        with fake_dist(mesh):
            cpu = nat.shard_batch_for_mimo_te(mesh, None, dict(batch), **kw)
            gpu = nat.shard_batch_for_mimo_te(mesh, None, dict(gpu_batch), **kw)
            assert nat.fast_path_info()["path"] == "native", nat.fast_path_info()
        _check_devices(gpu[1], torch.device("cuda", torch.cuda.current_device()), torch.device("cpu"))
        assert_same(_to(gpu, "cpu"), cpu)
    # which path ran: the kernel table is host[0, cu_off) (the int32 outputs follow it)
    ids, sl, slp = gpu_batch["input_ids"], gpu_batch["seq_lens"], gpu_batch["seq_lens_padded"]
    outputs = nat._OUT_PAD | nat._OUT_IMAGE | nat._OUT_VIDEO | nat._OUT_TOKENS | nat._OUT_POS
    plan = nat._plan((8, 32768, sl.shape[1], slp.shape[1], C, 8, outputs))
    out = torch.empty(plan.out_words, dtype=torch.int64, device="cuda")
    host = torch.empty(plan.lay_words, dtype=torch.int64)
    info = _C.mimo_run(input_ids=to_dlpack(ids), labels=to_dlpack(gpu_batch["labels"]),
                       position_ids=to_dlpack(gpu_batch["position_ids"]), seq_lens=to_dlpack(sl),
                       seq_lens_padded=to_dlpack(slp), out=to_dlpack(out), host=to_dlpack(host), num_chunks=C,
                       cp_size=8, cp_rank=0, image_token_id=IMG, video_token_id=VID, sentinel=-1000, outputs=outputs,
                       stream=nat._stream(ids.device))  # fmt: skip
    torch.cuda.synchronize()
    words = info[0]  # the kernel table's extent
    assert next((b for b in PARAM_BLOCKS if words <= b), None) == block, (words, block)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "where",
    [{"labels": "cpu"}, {"position_ids": "cpu"}, {"seq_lens": "cuda"}, {"seq_lens_padded": "cpu", "seq_lens": "cpu"}],
    ids=["labels_cpu", "positions_cpu", "seq_lens_gpu_only", "meta_cpu_tokens_gpu"],
)
@pytest.mark.parametrize("cp", [1, 2])
def test_cuda_device_mixes(where, cp, ncp_seed):
    """CPU/GPU mixes: the oracle's outcome exactly (on the reference path where the native one cannot go)."""
    g = gen(ncp_seed)
    batch = make_mimo_batch(4, 16, num_chunks=1, cp_size=2, generator=g, image_token_id=5)
    base = "cpu" if where == {"seq_lens": "cuda"} else "cuda"
    mixed = lambda: {k: v.to(where.get(k, base)) if torch.is_tensor(v) else v for k, v in batch.items()}  # noqa: E731
    mesh = None if cp == 1 else FakeCPMesh(2, 1)
    with fake_dist(mesh):
        r = call(ref.shard_batch_for_mimo_te, mesh, None, mixed(), image_token_id=5)
        n = call(nat.shard_batch_for_mimo_te, mesh, None, mixed(), image_token_id=5)
    if "seq_lens_padded" in where:  # the supported mix: native, values of the all-CPU oracle
        assert nat.fast_path_info()["path"] == "native"
        with fake_dist(mesh):
            want = ref.shard_batch_for_mimo_te(mesh, None, dict(batch), image_token_id=5)
        assert_same(_to(n[1], "cpu"), want)
    else:
        assert nat.fast_path_info()["path"] == "reference"
        assert_same_outcome(r, n)


SYNC_CASES = [(8, 1, 128), (8, 4, 128), (1, 2, 16), (4, 2, 64), (8, 1, 32768), (8, 4, 32768)]


@pytest.mark.cuda
@pytest.mark.parametrize("cp,C,S", SYNC_CASES, ids=[f"cp{cp}-C{C}-S{S}" for cp, C, S in SYNC_CASES])
def test_cuda_host_sync_budget(cp, C, S, ncp_seed):
    """Issue 16's budget, through ``shard_batch_for_mimo_te`` and through the sharder that
    ``make_mimo_te_cp_sharder`` builds (bound to the mesh as the framework does): not one sync with
    ``seq_lens*`` on the CPU (``set_sync_debug_mode("error")`` around the call), at most one with them
    on the GPU, B=8 up to S=32768 and every num_chunks; the reference makes many."""
    g = gen(ncp_seed)
    docs = (16, 64) if S > 1024 else (1, 4)
    batch = make_mimo_batch(8, S, num_chunks=C, cp_size=cp, docs_per_row=docs, image_token_id=IMG, video_token_id=VID,
                            generator=g, min_doc=True)  # fmt: skip
    opts = {"num_chunks": C, "image_token_id": IMG, "video_token_id": VID}
    mesh = FakeCPMesh(cp, 3 % cp)
    sharder = nat.make_mimo_te_cp_sharder(model=None, **opts)
    bound = _compat.ContextParallelSharder(device_mesh=mesh, shard_batch=sharder.shard_batch,
                                           local_token_global_indices=None, shard_layout=None)  # fmt: skip
    calls = {"function": lambda b: nat.shard_batch_for_mimo_te(mesh, None, b, **opts)[1],
             "sharder": lambda b: bound.shard(b)[1]}  # fmt: skip
    with fake_dist(mesh):
        want = ref.shard_batch_for_mimo_te(mesh, None, dict(batch), **opts)[1]
        for keep, budget in ((META, 0), ((), 1)):
            gpu = _to(batch, "cuda", keep)
            for name, fn in calls.items():
                fn(dict(gpu))  # warm up (plan cache, staging slots, allocator)
                torch.cuda.synchronize()
                if budget == 0:
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        out = fn(dict(gpu))
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                else:
                    assert _count_syncs(lambda: fn(dict(gpu))) <= budget, (name, keep)  # noqa: B023
                    out = fn(dict(gpu))
                assert nat.fast_path_info()["path"] == "native", (name, nat.fast_path_info())
                assert_same(_to(out, "cpu"), want)
        if cp == 8 and S <= 1024:  # the count can fail: the reference path syncs several times per chunk
            gpu = _to(batch, "cuda")
            assert _count_syncs(lambda: ref.shard_batch_for_mimo_te(mesh, None, dict(gpu), **opts)) >= 5 * C


@pytest.mark.cuda
@pytest.mark.parametrize("S,C", [(4096, 2), (32768, 1), (32768, 4)])
def test_cuda_call_does_not_wait_for_the_gpu(S, C, ncp_seed):
    """With seq_lens* on the CPU the call returns while earlier GPU work is still running, and its
    host time is far below the queued GPU work (a sync would wait about a second)."""
    import time

    g = gen(ncp_seed)
    batch = make_mimo_batch(8, S, num_chunks=C, cp_size=8, docs_per_row=(4, 64), generator=g, image_token_id=IMG)
    gpu = _to(batch, "cuda", META)
    mesh = FakeCPMesh(8, 5)
    with fake_dist(mesh):
        nat.shard_batch_for_mimo_te(mesh, None, dict(gpu), num_chunks=C, image_token_id=IMG)  # warm up
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU spinning, queued on the current stream
        t0 = time.perf_counter()
        out = nat.shard_batch_for_mimo_te(mesh, None, dict(gpu), num_chunks=C, image_token_id=IMG)
        host_s = time.perf_counter() - t0
        still_busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        want = ref.shard_batch_for_mimo_te(mesh, None, dict(batch), num_chunks=C, image_token_id=IMG)
    assert still_busy and host_s < 0.1, f"shard_batch_for_mimo_te waited for the GPU ({host_s * 1e3:.1f} ms)"
    assert_same(_to(out, "cpu"), want)


@pytest.mark.cuda
def test_cuda_staging_ring_under_a_deep_queue(ncp_seed):
    """More calls queued behind a GPU spin than the pinned staging ring has slots per device (32):
    no slot is rewritten before its copy to the GPU has run (each call keeps its own table), and the
    calls beyond the ring wait for the oldest copy instead of corrupting it."""
    n = 40
    batches = [make_mimo_batch(4, 64, num_chunks=2, cp_size=2, docs_per_row=(1, 6), generator=gen(ncp_seed + i),
                               image_token_id=IMG) for i in range(n)]  # fmt: skip
    mesh = FakeCPMesh(2, 1)
    with fake_dist(mesh):
        gpu = [_to(b, "cuda", META) for b in batches]
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s: every copy below queues behind it
        outs = [nat.shard_batch_for_mimo_te(mesh, None, dict(b), num_chunks=2, image_token_id=IMG)[1] for b in gpu]
        torch.cuda.synchronize()
        for b, out in zip(batches, outs):
            want = ref.shard_batch_for_mimo_te(mesh, None, dict(b), num_chunks=2, image_token_id=IMG)[1]
            assert_same(_to(out, "cpu"), want)
