"""What a user would run instead of nemo_cp_native, and how both are measured.

Shared by ``python -m nemo_cp_native demo`` and ``benchmarks/`` so that the demo and the recorded
tables compare against the same baselines, counted and timed the same way:

- ``flex_sink_attention``: FlexAttention (compiled) with the document/window mask as a block mask
  and the learned sink applied as an LSE correction, ``out * sigmoid(lse - sink)`` (what
  Automodel's flex path does);
- ``sdpa_causal``: PyTorch SDPA, causal, one document per batch row, no sink (it has none);
- ``attention_flops``: 4 x exact visible (query, key) pairs x Hq x D, backward 2.5x;
- ``time_gpu``: triton ``do_bench`` style timing (L2 flushed before each repetition, CUDA events,
  median), optionally with a GPU spin queued ahead of each call (``queued=True``);
- ``mimo_reference_fast_te``: the MiMo reference path (the framework's own torch ops) with its
  Transformer Engine call answered by the native partition, as real TE would answer it in one
  kernel.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "attention_flops",
    "flex_sink_attention",
    "from_bhtd",
    "mimo_reference_fast_te",
    "queue_gap",
    "sdpa_causal",
    "tflops",
    "time_gpu",
    "to_bhtd",
    "to_documents",
    "visible_pairs",
]


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def visible_pairs(lengths: Sequence[int], window: int) -> int:
    """Exact (query, key) pairs visible under per-document causal attention; ``window`` counts the
    current token (0 = the whole causal document)."""
    total = 0
    for n in lengths:
        if window <= 0 or n <= window:
            total += n * (n + 1) // 2
        else:
            total += window * (window + 1) // 2 + (n - window) * window
    return total


def attention_flops(lengths: Sequence[int], window: int, num_heads: int, head_dim: int, *,
                    backward: bool = False) -> int:  # fmt: skip
    """4 x visible pairs x Hq x D for the forward (two GEMMs of 2 FLOPs per multiply-add);
    ``backward=True`` gives the backward alone, 2.5x the forward (forward+backward = 3.5x)."""
    fwd = 4 * visible_pairs(lengths, window) * num_heads * head_dim
    return int(fwd * 2.5) if backward else fwd


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    return flops / ms / 1e9


# ---------------------------------------------------------------------------------------------
# Layouts: ours is THD [T, H, D]; Flex and SDPA take [B, H, T, D]
# ---------------------------------------------------------------------------------------------


def to_bhtd(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> a contiguous [1, H, T, D] copy (detached)."""
    return t.detach().transpose(0, 1).unsqueeze(0).contiguous()


def from_bhtd(t: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> a [T, H, D] view."""
    return t[0].transpose(0, 1)


def to_documents(t: torch.Tensor, doc_len: int) -> torch.Tensor:
    """[T, H, D] with T = B * doc_len equal documents -> a contiguous [B, H, doc_len, D] copy."""
    T, H, D = t.shape
    if T % doc_len:
        raise ValueError(f"to_documents: {T} tokens are not a whole number of {doc_len}-token documents")
    return t.detach().reshape(T // doc_len, doc_len, H, D).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------


def flex_sink_attention(lengths: Sequence[int], window: int, *, device="cuda",
                        compile: bool = True) -> Callable:  # fmt: skip
    """FlexAttention over packed documents with a learned sink, as a user would build it.

    Returns ``run(q, k, v, sink) -> out`` for q ``[1, Hq, T, D]``, k/v ``[1, Hkv, T, D]`` (GQA) and
    sink fp32 ``[Hq]``: the document-causal mask (keys of the same document, key <= query, and
    query - key < window when window > 0) as a block mask, flex's LSE, and the sink as
    ``out * sigmoid(lse - sink)``. ``compile=False`` runs flex eagerly (small CPU checks only: the
    eager path materializes the T x T scores)."""
    from torch.nn.attention import flex_attention as fa

    create_block_mask, flex_attention = fa.create_block_mask, fa.flex_attention
    device = torch.device(device)
    T = int(sum(lengths))
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(list(lengths), device=device))  # fmt: skip

    def mask_mod(b, h, q_idx, kv_idx):
        m = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
        if window > 0:
            m = m & (q_idx - kv_idx < window)
        return m

    if compile:
        # A fresh compile per mask: past dynamo's recompile limit flex_attention falls back to
        # eager, which materializes the T x T scores.
        torch._dynamo.reset()
    # The eager block-mask builder materializes a T x T mask: fine up to 64k tokens; beyond, the
    # compiled builder.
    block_mask = create_block_mask(mask_mod, None, None, T, T, device=str(device), _compile=T > 65536)
    flex = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    if hasattr(fa, "AuxRequest"):  # torch >= 2.9; return_lse is deprecated there
        lse_kw = {"return_aux": fa.AuxRequest(lse=True)}
    else:
        lse_kw = {"return_lse": True}

    def run(q, k, v, sink):
        out, aux = flex(q, k, v, block_mask=block_mask, enable_gqa=True, **lse_kw)
        lse = aux.lse if hasattr(aux, "lse") else aux
        return out * torch.sigmoid(lse - sink[None, :, None]).unsqueeze(-1).to(out.dtype)

    return run


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch SDPA, causal, GQA, no sink: one document per batch row (``to_documents``)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

# GPU cycles of the spin queued ahead of a timed call (queued=True): about 0.5 ms on an H200,
# longer than the host work of one attention call, so that work overlaps the spin.
QUEUE_GAP_CYCLES = 1_000_000
_L2_FLUSH: dict = {}


def queue_gap(cycles: int = QUEUE_GAP_CYCLES) -> None:
    """Keeps the GPU busy (``torch.cuda._sleep``) while the host launches the next call's kernels."""
    torch.cuda._sleep(cycles)


def _flush_l2() -> None:
    dev = torch.cuda.current_device()
    if dev not in _L2_FLUSH:  # 256 MB, as triton's do_bench: larger than any GPU's L2
        _L2_FLUSH[dev] = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device="cuda")
    _L2_FLUSH[dev].zero_()


def time_gpu(fn: Callable[[], object], *, reps: int = 20, warmup: int = 3, flush_l2: bool = True,
             queued: bool = False, loop: bool = False, grad_to_none: Iterable[torch.Tensor] = ()) -> float:  # fmt: skip
    """Median milliseconds of ``fn()`` on the current CUDA stream (triton ``do_bench`` style).

    Each repetition: the gradients of ``grad_to_none`` reset (so backward never accumulates),
    the L2 cache flushed by zeroing 256 MB (``flush_l2``), CUDA events recorded around ``fn()``.
    By default the host waits for each repetition's end event, so the GPU is idle at the next
    start event and the host's work for the call (argument checks, allocations, launches, any
    host sync) counts, as a user sees it on an idle GPU. With ``loop`` the repetitions are queued
    back to back and the host waits once, after the last (triton's ``do_bench`` loop): the host
    runs ahead of the GPU as in a training loop, so its time per call counts only where it
    exceeds the GPU's (the flush and the call), and a host sync inside ``fn`` still drains the
    queue. With ``queued`` a GPU spin is queued first (``queue_gap``) and the host launches while
    it runs, so the events time the GPU work, as in a training step that keeps the queue full."""
    grads = list(grad_to_none)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        for t in grads:
            t.grad = None
        if flush_l2:
            _flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            queue_gap()
        start.record()
        fn()
        end.record()
        if not loop:
            end.synchronize()
        events.append((start, end))
    if loop:
        torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


# ---------------------------------------------------------------------------------------------
# MiMo: the framework's torch ops with a native TE-style partition
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def mimo_reference_fast_te():
    """Within the block, ``nemo_cp_native.reference.mimo`` answers its Transformer Engine call
    (``thd_get_partitioned_indices``) with the native partition (one kernel, as real TE), so the
    reference path costs what the framework's own torch ops cost, not our Python TE oracle."""
    from . import thd_partition_indices
    from .reference import mimo as ref

    saved = ref.thd_get_partitioned_indices
    ref.thd_get_partitioned_indices = lambda cu, total, w, r: thd_partition_indices(cu, total, w, r, validate=False)
    try:
        yield ref
    finally:
        ref.thd_get_partitioned_indices = saved
