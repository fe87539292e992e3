"""Type stubs of the native extension ``nemo_cp_native._C`` (csrc/python). Tensors cross as DLPack
capsules (``torch.utils.dlpack.to_dlpack``); ``stream`` is the caller's current CUDA stream as an
int (None on the CPU). Errors: ValueError (a bad argument, named in the message),
NotImplementedError, MemoryError, RuntimeError (CUDA), and ``Fallback`` (valid input outside the
native fast path: the caller runs the reference)."""

from types import NotImplementedType
from typing import Any, Optional

Capsule = Any  # a DLPack capsule ("dltensor" or "dltensor_versioned"), borrowed for the call

CUDA: int

class Fallback(Exception): ...

def build_info() -> dict[str, Any]: ...

# ---- THD partition and the MiMo sharder -------------------------------------------------------
def thd_partition(
    cu_seqlens: Capsule, out: Capsule, total_tokens: int, cp_size: int, cp_rank: int, stream: Optional[int], /
) -> None: ...
def thd_partition_validate(cu_seqlens_host: Capsule, cp_size: int, total_tokens: int = ..., /) -> None: ...
def mimo_plan(
    B: int, S: int, n_real: int, n_pad: int, num_chunks: int, cp_size: int, outputs: int, /
) -> tuple[int, ...]: ...
def mimo_run_x(
    input_ids: Any, labels: Any, position_ids: Any, seq_lens: Any, seq_lens_padded: Any, out: Any, host: Any,
    num_chunks: int, cp_size: int, cp_rank: int, image_token_id: Optional[int], video_token_id: Optional[int],
    sentinel: int, outputs: int, /,
) -> tuple[int, int, int, int, int, int] | NotImplementedType: ...  # tensors read through the DLPack C exchange API
def mimo_run(
    *,
    input_ids: Capsule,
    labels: Capsule,
    position_ids: Optional[Capsule] = None,
    seq_lens: Capsule,
    seq_lens_padded: Capsule,
    out: Capsule,
    host: Optional[Capsule] = None,
    num_chunks: int,
    cp_size: int,
    cp_rank: int,
    image_token_id: Optional[int],
    video_token_id: Optional[int],
    sentinel: int,
    outputs: int,
    stream: Optional[int] = None,
) -> tuple[int, int, int, int, int, int]: ...

# ---- learned-sink attention ------------------------------------------------------------------
def sink_attn_fwd(
    *,
    q: Capsule,
    k: Capsule,
    v: Capsule,
    out: Capsule,
    lse: Capsule,
    sink: Optional[Capsule] = None,
    scale: float,
    cu_seqlens: Optional[Capsule] = None,
    window: int = 0,
    row_lo: Optional[Capsule] = None,
    row_hi: Optional[Capsule] = None,
    stream: Optional[int] = None,
) -> None: ...
def sink_attn_bwd(
    *,
    q: Capsule,
    k: Capsule,
    v: Capsule,
    out: Capsule,
    lse: Capsule,
    dout: Capsule,
    dq: Capsule,
    dk: Capsule,
    dv: Capsule,
    sink: Optional[Capsule] = None,
    dsink: Optional[Capsule] = None,
    workspace: Optional[Capsule] = None,
    scale: float,
    cu_seqlens: Optional[Capsule] = None,
    window: int = 0,
    row_lo: Optional[Capsule] = None,
    row_hi: Optional[Capsule] = None,
    deterministic: int = 0,
    stream: Optional[int] = None,
) -> None: ...
def exchange_init(types: tuple[type, ...], /) -> bool: ...
def sink_attn_fwd_x(
    q: Any, k: Any, v: Any, out: Any, lse: Any, sink: Any, cu_seqlens: Any, row_lo: Any, row_hi: Any, scale: float,
    window: int, /,
) -> None | NotImplementedType: ...  # tensors read through the DLPack C exchange API
def sink_attn_bwd_x(
    q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dq: Any, dk: Any, dv: Any, sink: Any, dsink: Any,
    workspace: Any, cu_seqlens: Any, row_lo: Any, row_hi: Any, scale: float, window: int, deterministic: int, /,
) -> None | NotImplementedType: ...
def sink_attn_bwd_workspace(*, Tq: int, Tk: int, Hq: int, D: int, has_sink: int, deterministic: int, device: int) -> int: ...
def sink_attn_kernels(*, deterministic: int = 0, device: int = 0) -> tuple[str, str]: ...
def sink_attn_check_mask(
    *, Tq: int, Tk: int, cu_seqlens: Optional[Capsule] = None, row_lo: Optional[Capsule] = None,
    row_hi: Optional[Capsule] = None
) -> None: ...
def attn_debug(
    *, portable: Optional[int] = None, grid: Optional[int] = None, whole_tiles: Optional[int] = None,
    order_waves: Optional[int] = None
) -> tuple[int, int, int, int]: ...

# ---- Flint CP: plans and the rank step --------------------------------------------------------
def magi_dispatch(
    cu_seqlens_host: Capsule, cp_size: int, chunk_size: int, total_padded: int, owner_out: Capsule, /
) -> None: ...
def plan_build(
    cu_seqlens_host: Capsule, cp_size: int, cp_rank: int, requested_chunk: int, min_chunks_per_rank: int,
    windows: tuple[int, ...], /
) -> dict[str, Any]: ...
def kv_gather(*, a: Capsule, b: Capsule, idx: Capsule, out: Capsule, stream: Optional[int] = None) -> None: ...
def kv_assemble(
    *, k: Capsule, v: Capsule, recv: Capsule, slot_src: Capsule, kbuf: Capsule, vbuf: Capsule,
    stream: Optional[int] = None
) -> None: ...
def kv_grad_sum(
    *, dkbuf: Capsule, dvbuf: Capsule, local_slot: Capsule, back: Capsule, ret_off: Capsule, ret_idx: Capsule,
    dk: Capsule, dv: Capsule, stream: Optional[int] = None
) -> None: ...
def runs_expand(
    *, runs: Capsule, out: Capsule, runs_dev: Optional[Capsule] = None, stream: Optional[int] = None
) -> None: ...
