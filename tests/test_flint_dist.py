"""Flint Magi CP over real gloo process groups (CPU, fp32): one spawn of 4 ranks tests cp = 4
(``init_device_mesh("cpu", (4,))``) and cp = 2 (the "cp" dim of a (dp=2, cp=2) mesh, so the cp rank
``rank % 2`` differs from the global rank).

Per cp: two packs (two PP microbatches) with documents shorter and longer than the window and tail
padding rows, plans selected through ``FlintMagiBatchPlans.select``; ``plan.attention`` under
autograd against the float64 whole-sequence oracle (out/dq/dk/dv of the rank's rows, all-reduced
partial dsink); activation checkpointing reproduces bitwise; the all-to-all split sizes and bytes
are exactly the plan's minimal exchange (forward) and its reverse (backward); bad input raises the
same error on every rank before any collective; ``_prepare_magi_inputs`` shards a 2-pack batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _mesh import run_distributed

from nemo_cp_native import flint
from nemo_cp_native.reference import cp_attention as rcp
from nemo_cp_native.reference import magi as rmagi
from nemo_cp_native.testing import doc_lengths, pack_documents

pytestmark = pytest.mark.dist

HQ, HKV = 4, 2
TOL = 1e-5  # of the largest magnitude; see test_flint_plan.test_simulated_cp_matches_whole_sequence_oracle


def _config(window, chunk, d):
    return SimpleNamespace(num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=d, sliding_window=window,
                           magi_chunk_size=chunk)  # fmt: skip


def _padded_length_with_tail(T, cp, chunk):
    """T nudged up until Magi's dispatch pads the tail (so pad rows are always exercised)."""
    while rmagi.padded_length(T, rmagi.effective_chunk_size(T, cp, chunk), cp) == T:
        T += 1
    return T


def _window_docs(T, window, g):
    """Lengths summing to T around the window (W-1, W, W+1, 1, 2W, shuffled), always with one
    document shorter and one longer than W."""
    head = [2 * window + 1, window - 1]
    lengths = head + doc_lengths(T - sum(head), "window", window=window, generator=g)
    return [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]


class _A2ASpy:
    """Records every ``dist.all_to_all_single`` (split sizes and bytes) and forwards it."""

    def __init__(self):
        self.calls, self._orig = [], None

    def __enter__(self):
        self._orig = dist.all_to_all_single

        def spy(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            self.calls.append({"out_splits": list(output_split_sizes), "in_splits": list(input_split_sizes),
                               "out_bytes": output.numel() * output.element_size(),
                               "in_bytes": input.numel() * input.element_size()})  # fmt: skip
            return self._orig(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = spy
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def _leaves(q, k, v, s):
    return [t.detach().clone().requires_grad_() for t in (q, k, v, s)]


def _check_rank_rows(tag, got, rr, ref):
    for name, x in zip(("out", "dq", "dk", "dv"), got):
        mag = float(getattr(ref, name).abs().max())
        err = float((x.detach().double() - getattr(rr, name)).abs().max())
        assert err <= TOL * mag, f"{tag} {name}: max err {err:.3g} > {TOL} * {mag:.3g}"


def _check_dsink(tag, dsink_sum, ref, sink, dout):
    p_sink = torch.exp(sink.double()[:, None] - ref.lse)  # [Hq, T]
    budget = (p_sink * (dout.double() * ref.out).abs().sum(-1).T).sum(1)  # sum of |terms| per head
    err = (dsink_sum.double() - ref.dsink).abs()
    assert torch.all(err <= TOL * budget + 1e-7), f"{tag} all-reduced dsink: err {err.tolist()}"


def _attention_and_comm(tag, plan, pack, w, group, cp, cp_rank):
    """One microbatch, one window: numerics against the oracle and the exact exchange volume."""
    q, k, v, s, cu, dout, d, scale = (pack[n] for n in ("q", "k", "v", "sink", "cu", "dout", "dispatch", "scale"))
    ref = rcp.cp_attention_ref(q, k, v, s, cu, dout, d, cp, window=w, scale=scale)
    rr = ref.ranks[cp_rank]
    loc = [rcp.local_rows(t, d, cp_rank) for t in (q, k, v, dout)]
    leaves = _leaves(*loc[:3], s)
    with _A2ASpy() as spy:
        out = plan.attention(*leaves, w, scale)
        n_fwd = len(spy.calls)
        out.backward(loc[3])
    _check_rank_rows(tag, [out] + [t.grad for t in leaves[:3]], rr, ref)
    # dsink is a signed sum over the rank's rows: bound the error by TOL x the sum of |terms| (the
    # fp32 accumulation error scales with it; a plain rtol fails when the terms cancel)
    terms = (torch.exp(s.double()[:, None] - ref.lse) * (dout.double() * ref.out).abs().sum(-1).T).T  # [T, Hq]
    budget = rcp.local_rows(terms, d, cp_rank).sum(0)
    err = (leaves[3].grad.double() - rr.dsink).abs()
    assert torch.all(err <= TOL * budget + 1e-7), f"{tag}: partial dsink err {err.tolist()} budget {budget.tolist()}"
    total = leaves[3].grad.clone()
    dist.all_reduce(total, group=group)  # what FSDP over dp x cp does with the partial dsinks
    _check_dsink(tag, total, ref, s, dout)

    key = plan.keys[w]
    assert n_fwd == 1 and len(spy.calls) == 2, f"{tag}: expected one all-to-all forward and one backward"
    fwd, bwd = spy.calls
    remote = rmagi.visible_remote_tokens(cu, d.partitions, d.chunk_size, d.total_seqlen_padded, cp_rank, w)
    n_remote = sum(int(t.numel()) for t in remote.values())
    row_bytes = HKV * 2 * q.shape[-1] * q.element_size()  # one token of K and V
    assert fwd["in_splits"] == list(key.send_counts) and fwd["out_splits"] == list(key.recv_counts), tag
    assert fwd["out_bytes"] == n_remote * row_bytes and sum(key.recv_counts) == n_remote, tag
    assert fwd["in_bytes"] == sum(key.send_counts) * row_bytes, tag
    assert bwd["in_splits"] == fwd["out_splits"] and bwd["out_splits"] == fwd["in_splits"], f"{tag}: bwd not reversed"
    assert bwd["in_bytes"] == fwd["out_bytes"] and bwd["out_bytes"] == fwd["in_bytes"], tag
    all_gather = (cp - 1) * key.num_local_tokens * row_bytes
    assert fwd["out_bytes"] <= all_gather, tag
    return fwd["out_bytes"], all_gather


def _check_checkpoint(tag, plan, pack, w, cp_rank):
    """AC recompute runs the exchange again and reproduces output and gradients bitwise."""
    d, scale = pack["dispatch"], pack["scale"]
    loc = [rcp.local_rows(pack[n], d, cp_rank) for n in ("q", "k", "v", "dout")]
    plain = _leaves(*loc[:3], pack["sink"])
    ckpt = _leaves(*loc[:3], pack["sink"])

    def fn(q, k, v, s):
        return plan.attention(q, k, v, s, w, scale)

    out1 = fn(*plain)
    g1 = torch.autograd.grad(out1, plain, loc[3])
    with _A2ASpy() as spy:
        out2 = torch.utils.checkpoint.checkpoint(fn, *ckpt, use_reentrant=False)
        g2 = torch.autograd.grad(out2, ckpt, loc[3])
    assert len(spy.calls) == 3, f"{tag}: forward, recompute and backward exchanges expected; got {len(spy.calls)}"
    assert torch.equal(out1, out2), f"{tag}: checkpointed output differs"
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), g1, g2):
        assert torch.equal(a, b), f"{tag}: checkpointed {name} differs"


def _check_bad_input(tag, plan, pack, group, cp, cp_rank):
    """Every rank raises the same error, before any collective; the group stays usable."""
    L = plan.keys[0].num_local_tokens
    d = pack["q"].shape[-1]
    errors = []
    with _A2ASpy() as spy:
        for qk in [(torch.randn(L + 1, HQ, d), torch.randn(L, HKV, d)), (torch.randn(L, HQ, d), torch.randn(L, 1, d))]:
            try:
                plan.attention(*qk, torch.randn(L, HKV, d), pack["sink"], 0, 0.5)
            except ValueError as e:
                errors.append(str(e))
        try:
            flint._build_magi_plan(pack_documents([cp - 1]), _config(0, 512, d), group)
        except ValueError as e:
            errors.append(str(e))
    assert spy.calls == [] and len(errors) == 3, f"{tag}: {errors}, {spy.calls}"
    assert "query must have shape" in errors[0] and "key must have shape" in errors[1], errors
    assert f"too short for cp_size={cp}" in errors[2], errors
    everyone = [None] * cp
    dist.all_gather_object(everyone, errors, group=group)  # nobody hung; the group is still in step
    assert all(e == errors for e in everyone), f"{tag}: ranks raised different errors: {everyone}"


class _FakeFlint:
    def __init__(self, config, cp_mesh, pp_stage):
        self.config, self.cp_mesh, self._pp = config, cp_mesh, pp_stage

    def _is_pipeline_parallel_stage(self):
        return self._pp


def _check_sharder(tag, mesh, packs, cfg, cp_rank, g):
    S = packs[0]["cu"][-1].item()
    n_docs = max(len(p["lengths"]) for p in packs)
    lens = torch.full((2, n_docs + 1), -1000, dtype=torch.int64)  # -1000 sentinels, as Automodel pads
    for i, p in enumerate(packs):
        lens[i, : len(p["lengths"])] = torch.tensor(p["lengths"])
    pos = torch.cat([torch.arange(n) for n in packs[0]["lengths"]])
    batch = {"input_ids": torch.randint(1, 1000, (2, S), generator=g),
             "labels": torch.randint(0, 1000, (2, S), generator=g),
             "position_ids": torch.stack([pos, torch.cat([torch.arange(n) for n in packs[1]["lengths"]])]),
             "padding_mask": torch.rand((2, S), generator=g) < 0.2, "seq_lens_padded": lens}  # fmt: skip
    for pp in (True, False):
        sharder = flint._prepare_magi_inputs(_FakeFlint(cfg, mesh, pp), dict(batch), 2)["cp_sharder"]
        _, out = sharder.shard(dict(batch))
        for name, fill in (("labels", -100), ("position_ids", 0), ("padding_mask", True)) + (
            () if pp else (("input_ids", 0),)
        ):
            want = torch.stack([rcp.local_rows(batch[name][i], p["dispatch"], cp_rank, fill)
                                for i, p in enumerate(packs)])  # fmt: skip
            assert out[name].dtype == batch[name].dtype and torch.equal(out[name], want), f"{tag} pp={pp} {name}"
        if pp:
            assert torch.equal(out["input_ids"], batch["input_ids"]), f"{tag}: PP keeps token ids global"
        idx = out["flint_magi_microbatch_index"]
        assert idx.dtype == torch.int64 and idx.tolist() == [0, 1] and out["qkv_format"] == "thd"
        for i, part in enumerate(idx.chunk(2)):  # how PP splits it: [1] per microbatch
            key = out["flint_magi_plans"].select(part).keys[0]
            assert torch.equal(key.local_token_global_indices, packs[i]["dispatch"].local_token_global_indices(cp_rank))
            assert key.group is mesh.get_group()
    bad = lens.clone()
    bad[1, 0] += 1
    cases = [(3, batch, "must evenly divide batch size 2"), (1, batch, "one pack per pipeline microbatch"),
             (2, {**batch, "seq_lens_padded": bad}, f"lengths of pack 1 sum to {S + 1}, not to the pack length {S}")]
    for chunks, b, match in cases:
        sharder = flint._prepare_magi_inputs(_FakeFlint(cfg, mesh, False), dict(b), chunks)["cp_sharder"]
        with pytest.raises(ValueError, match=match):
            sharder.shard(dict(b))


def _worker(rank, world_size, seed):
    from torch.distributed.device_mesh import init_device_mesh

    g = torch.Generator().manual_seed(seed)  # identical draws on every rank
    for cp in (world_size, 2):
        if cp == world_size:
            mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        else:
            mesh = init_device_mesh("cpu", (world_size // cp, cp), mesh_dim_names=("dp", "cp"))["cp"]
        group = mesh.get_group()
        cp_rank = dist.get_rank(group=group)
        assert cp_rank == rank % cp
        window = int(torch.randint(16, 48, (1,), generator=g))
        d = [16, 32, 64][int(torch.randint(0, 3, (1,), generator=g))]
        chunk = [8, 16, 512][int(torch.randint(0, 3, (1,), generator=g))]
        cfg = _config(window, chunk, d)
        T = _padded_length_with_tail(int(torch.randint(300, 600, (1,), generator=g)), cp, chunk)
        packs = []
        for _ in range(2):  # two microbatches: same pack length, different documents
            cu = pack_documents(_window_docs(T, window, g))
            packs.append(dict(lengths=torch.diff(cu).tolist(), cu=cu, dispatch=rmagi.dispatch(cu, cp, chunk),
                              scale=d**-0.5, q=torch.randn(T, HQ, d, generator=g),
                              k=torch.randn(T, HKV, d, generator=g), v=torch.randn(T, HKV, d, generator=g),
                              sink=torch.rand(HQ, generator=g) * 8 - 4,
                              dout=torch.randn(T, HQ, d, generator=g)))  # fmt: skip
        plans = flint.FlintMagiBatchPlans(plans=tuple(flint._build_magi_plan(p["cu"], cfg, group) for p in packs))
        volume = torch.zeros(2, 2, dtype=torch.float64)  # [window 0 / W] x [received, all-gather]
        for i, part in enumerate(torch.arange(2).chunk(2)):
            plan = plans.select(part)
            for j, w in enumerate((0, window)):
                tag = f"cp={cp} rank={cp_rank} microbatch={i} window={w}"
                volume[j] += torch.tensor(_attention_and_comm(tag, plan, packs[i], w, group, cp, cp_rank))
        dist.all_reduce(volume, group=group)
        assert bool((volume[:, 0] < volume[:, 1]).all()), f"cp={cp}: exchange not below an all-gather: {volume}"
        if rank == 0:
            r = (volume[:, 0] / volume[:, 1]).tolist()
            print(f"[flint dist cp={cp} W={window} T={T}] K/V bytes received / all-gather: "
                  f"full causal {r[0]:.3f}, window {r[1]:.3f}")  # fmt: skip
        plan = plans.select(torch.tensor([1]))
        _check_checkpoint(f"cp={cp} AC", plan, packs[1], window, cp_rank)
        _check_bad_input(f"cp={cp} bad input", plan, packs[1], group, cp, cp_rank)
        _check_sharder(f"cp={cp} sharder", mesh, packs, cfg, cp_rank, g)


def test_flint_magi_cp_over_gloo(ncp_seed):
    run_distributed(_worker, 4, ncp_seed, timeout=120)
