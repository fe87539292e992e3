"""MiMo TE-THD sharding: native ``shard_batch_for_mimo_te`` against the reference path.

Cases: B = 8 rows of S = 32768 tokens, 16-64 packed documents per row, image and video
placeholders, cp = 8 seen from rank 3, num_chunks 1 and 4. Three implementations:

- ``native``: ``nemo_cp_native.mimo.shard_batch_for_mimo_te`` (C layout pass + one fused gather pass,
  at most one host sync per call);
- ``ref(pyTE)``: the reference path (``nemo_cp_native.reference.mimo``, the framework's torch ops with
  their host syncs) whose Transformer Engine call is our Python-loop TE oracle, which is slow;
- ``ref(fastTE)``: the same reference path with the TE call answered by the native
  ``thd_partition_indices`` (one kernel, like real TE; ``nemo_cp_native.baselines.
  mimo_reference_fast_te``, also the demo's baseline): the fair measure of the framework's own ops.

On CUDA a fourth row, ``native(metaCPU)``, keeps ``seq_lens*`` on the host (as a collator can),
which removes the one device-to-host copy.

Native == reference is verified once per case before timing. Reported: median ms per call, end to
end (``--device cuda``: wall clock with a device sync after each call), host syncs per call
(CUDA: counted with ``torch.cuda.set_sync_debug_mode`` in a separate untimed call), speedup over
native, and for the fused gather pass alone (``_C.mimo_shard`` on a prepared layout; CUDA events
with an L2 flush on the GPU) its time and bandwidth: bytes = the ids/labels/positions it gathers
(read in their dtype, written as int64), the padding mask and local index map it writes, and the
media masks (ids read once, one bool written per token per modality).

    python benchmarks/bench_mimo_shard.py [--device cpu|cuda] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # common.py, and the package when run from a checkout
from common import env_record, fake_mesh, make_mimo_batch, print_table, time_cpu, time_cuda, write_json  # noqa: E402

from nemo_cp_native import _C  # noqa: E402
from nemo_cp_native import mimo as nat  # noqa: E402
from nemo_cp_native.testing import count_syncs as _count_syncs  # noqa: E402
from nemo_cp_native._ops import dl, stream_of  # noqa: E402
from nemo_cp_native.baselines import mimo_reference_fast_te as _fast_te  # noqa: E402
from nemo_cp_native.reference import mimo as ref  # noqa: E402

IMG, VID = 151655, 151656


def _same(a, b, path="out"):
    """Exact equality of nested results: types, key order, dtypes, shapes, devices, values."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys differ"
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a is b or a == b, f"{path}: {a!r} != {b!r}"




def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _cpu(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return obj


def _pass_fn(batch, C, cp, rank):
    """The fused shard pass alone, on a layout and outputs prepared once."""
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    B, S = ids.shape
    L, Tc = B // C * S // cp, B // C * S
    lay = nat._Layout(batch["seq_lens"], batch["seq_lens_padded"], S, C, cp, -1000, ids.device)
    new = lambda n, dt: torch.empty(n, dtype=dt, device=ids.device)  # noqa: E731
    o = [new(C * L, torch.int64), new(C * L, torch.int64), new(C * L, torch.int64), new(C * L, torch.bool),
         new(C * L, torch.int64), new(C * Tc, torch.bool), new(C * Tc, torch.bool)]  # fmt: skip
    args = [dl(ids), dl(labels), dl(pos), dl(lay.table), *map(dl, o), C, cp, rank, IMG, VID, stream_of(ids.device)]

    def run():
        _C.mimo_shard(*args)

    return run, lay


def _native_bytes(batch, C, cp):
    ids = batch["input_ids"]
    T = ids.numel()
    L = T // cp  # local tokens over all chunks
    gathered = sum(batch[k].element_size() + 8 for k in ("input_ids", "labels", "position_ids"))
    n_media = 2
    return L * (gathered + 1 + 8) + T * (ids.element_size() + n_media)


def run_case(name, B, S, C, cp, rank, docs, device, reps, ref_reps, seed):
    g = torch.Generator().manual_seed(seed)
    batch = make_mimo_batch(B, S, num_chunks=C, cp_size=cp, docs_per_row=docs, image_token_id=IMG,
                            video_token_id=VID, generator=g, device=device)  # fmt: skip
    opts = {"num_chunks": C, "image_token_id": IMG, "video_token_id": VID}
    cuda = device == "cuda"
    nothing = contextlib.nullcontext

    def call(module, b):
        return lambda: module.shard_batch_for_mimo_te(mesh, None, dict(b), **opts)

    impls = {"native": (call(nat, batch), nothing)}
    if cuda:
        meta_cpu = {k: v.cpu() if k in ("seq_lens", "seq_lens_padded") else v for k, v in batch.items()}
        impls["native(metaCPU)"] = (call(nat, meta_cpu), nothing)
    impls["ref(pyTE)"] = (call(ref, batch), nothing)
    impls["ref(fastTE)"] = (call(ref, batch), _fast_te)
    rows = []
    with fake_mesh(cp, rank) as mesh:
        want = _cpu(impls["ref(pyTE)"][0]())
        for impl, (fn, ctx) in impls.items():  # validate before timing
            with ctx():
                _same(_cpu(fn()), want, impl)
            if impl.startswith("native"):
                assert nat.fast_path_info()["path"] == "native", nat.fast_path_info()
        for impl, (fn, ctx) in impls.items():
            native = impl.startswith("native")
            with ctx():
                ms = time_cpu(fn, warmup=3 if native else 1, reps=reps if native else ref_reps, sync_cuda=cuda)
                row = {"case": name, "impl": impl, "ms": round(ms, 3)}
                if cuda:
                    row["syncs"] = _count_syncs(fn)
            rows.append(row)
    run_pass, _ = _pass_fn(batch, C, cp, rank)
    pass_ms = time_cuda(run_pass, reps=reps, flush_l2=True) if cuda else time_cpu(run_pass, warmup=3, reps=reps)
    rows[0]["pass_ms"] = round(pass_ms, 4)
    rows[0]["pass_GB/s"] = round(_native_bytes(batch, C, cp) / (pass_ms * 1e-3) / 1e9, 1)
    for row in rows:
        row["speedup"] = round(row["ms"] / rows[0]["ms"], 1)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CI smoke)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions of the native call")
    ap.add_argument("--ref-reps", type=int, default=3, help="timed repetitions of the reference calls")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU")
    if args.quick:
        shape, docs, reps, ref_reps = (2, 256), (2, 4), 3, 1
    else:
        shape, docs, reps, ref_reps = (8, 32768), (16, 64), args.reps, args.ref_reps
    rows = []
    for C in (1, 4):
        B, S = shape
        C = min(C, B)
        name = f"B{B} S{S} C{C} cp8 r3"
        rows += run_case(name, B, S, C, 8, 3, docs, args.device, reps, ref_reps, args.seed)
    write_json(args.json, {"env": env_record(), "device": args.device, "rows": rows})
    columns = ["case", "impl", "ms"] + (["syncs"] if args.device == "cuda" else [])
    columns += ["speedup", "pass_ms", "pass_GB/s"]
    print(f"device: {args.device}  (ms: end to end, median; speedup = ms / native ms; "
          "pass: the fused gather pass alone)")  # fmt: skip
    print_table(rows, columns)


if __name__ == "__main__":
    main()
