"""Upstream classes when ``nemo_automodel`` is importable, faithful stand-ins when it is not.

``ShardLayout`` and ``ContextParallelSharder`` are part of the contract of the functions we
replace: they must be upstream's own classes whenever upstream can be imported, so that
``isinstance`` checks and the framework's sharder resolution keep working after ``patch()``.
Without upstream (CI, users of the native ops alone) we provide dataclasses with the same
fields and the same direct-mode behaviour (``shard``, token verbs, error messages).

Upstream is imported lazily, on the first access to ``HAVE_UPSTREAM``, ``ShardLayout`` or
``ContextParallelSharder`` (module ``__getattr__``), never by ``import nemo_cp_native``: importing
``nemo_automodel.components.distributed`` costs seconds.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = [
    "HAVE_UPSTREAM",
    "ShardLayout",
    "ContextParallelSharder",
    "ensure_mimo_te_context_parallel",
    "upstream_version",
]

_UPSTREAM_SHARDER = "nemo_automodel.components.distributed.context_parallel.sharder"
_UPSTREAM_CP = "nemo_automodel.components.models.mimo_v2_flash.cp"
_UPSTREAM_PARALLELIZATION = "nemo_automodel.components.models.mimo_v2_flash.parallelization"
_LAZY = ("HAVE_UPSTREAM", "ShardLayout", "ContextParallelSharder")


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure means "no upstream"
        return None


def _resolve() -> None:
    """Binds the lazy names (once): upstream's classes when importable, else the stand-ins."""
    up = _try_import(_UPSTREAM_SHARDER)
    g = globals()
    g["HAVE_UPSTREAM"] = up is not None
    g["ShardLayout"] = up.ShardLayout if up is not None else _StandaloneShardLayout
    g["ContextParallelSharder"] = up.ContextParallelSharder if up is not None else _StandaloneContextParallelSharder


def have_upstream() -> bool:
    """True when ``nemo_automodel``'s context-parallel sharder can be imported (imports it once)."""
    if "HAVE_UPSTREAM" not in globals():
        _resolve()
    return globals()["HAVE_UPSTREAM"]


def __getattr__(name: str):
    if name in _LAZY:
        _resolve()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def upstream_version() -> str | None:
    """Version string of the importable ``nemo_automodel``, or None."""
    if not have_upstream():
        return None
    try:
        from importlib.metadata import version

        return version("nemo-automodel")
    except Exception:  # noqa: BLE001
        return "unknown"


@dataclasses.dataclass(frozen=True)
class _StandaloneShardLayout:
    """Stand-in for upstream ``ShardLayout`` (same fields, same defaults, frozen)."""

    local_token_global_indices: torch.Tensor | None = None
    original_seq_len: int | None = None
    padded_seq_len: int | None = None
    input_row_shape: tuple[int, ...] | None = None
    input_token_stream_positions: torch.Tensor | None = None


_StandaloneShardLayout.__name__ = _StandaloneShardLayout.__qualname__ = "ShardLayout"
_NO_SHARD_LAYOUT = _StandaloneShardLayout()


class _StandaloneContextParallelSharder:
    """Stand-in for upstream ``ContextParallelSharder`` in *direct* mode.

    Only the direct construction (``shard_batch=``) exists without upstream: strategy
    resolution belongs to the framework. ``shard`` and the token verbs follow upstream.
    """

    def __init__(
        self,
        model=None,
        device_mesh=None,
        batch=None,
        *,
        shard_batch: Callable[..., tuple] | None = None,
        local_token_global_indices: Callable[..., torch.Tensor] | None = None,
        shard_layout: _StandaloneShardLayout | None = None,
        padding_token_id: int = 0,
        num_chunks: int = 1,
        loss_mask: torch.Tensor | None = None,
        invoke_pre_embed: bool = True,
        extra_seq_buffers: dict[str, int] | None = None,
    ) -> None:
        if shard_batch is None:
            if local_token_global_indices is not None or shard_layout is not None:
                raise TypeError("local_token_global_indices and shard_layout require shard_batch")
            if batch is None:
                raise TypeError("batch is required when shard_batch is not provided")
            raise NotImplementedError(
                "strategy resolution needs nemo_automodel; construct the sharder with shard_batch="
            )
        if (
            model is not None
            or batch is not None
            or num_chunks != 1
            or not invoke_pre_embed
            or extra_seq_buffers is not None
        ):
            raise TypeError("shard_batch is mutually exclusive with model, batch, and strategy-resolution options")
        self.shard_batch = shard_batch
        self.local_token_global_indices = local_token_global_indices
        self.shard_layout = shard_layout
        names = getattr(device_mesh, "mesh_dim_names", None) or ()
        self._cp_mesh = device_mesh["cp"] if "cp" in names else None
        self._tp_mesh = device_mesh["tp"] if "tp" in names else None
        self._loss_mask = loss_mask
        self._padding_token_id = padding_token_id

    def shard(self, batch: dict[str, Any]):
        """Shard a batch and retain its layout for token-aligned tensors."""
        ctx, batch, self.shard_layout = self.shard_batch(
            self._cp_mesh,
            self._tp_mesh,
            batch,
            loss_mask=self._loss_mask,
            padding_token_id=self._padding_token_id,
        )
        return ctx, batch

    def _cp_size(self) -> int:
        return self._cp_mesh.size() if self._cp_mesh is not None else 1

    def _indices(self, padded_seq_len: int, device) -> torch.Tensor:
        layout = self.shard_layout or _NO_SHARD_LAYOUT
        captured = layout.local_token_global_indices
        if captured is not None:
            cp_size = self._cp_size()
            expected = captured.numel() * cp_size
            if padded_seq_len != expected:
                raise ValueError(
                    f"the reported CP indices cover a padded stream of {expected} tokens "
                    f"({captured.numel()} local x cp_size {cp_size}), got {padded_seq_len=}. "
                    "The tensor does not match the batch this sharder last sharded."
                )
            return captured.reshape(-1).to(device=device, dtype=torch.long)
        if self.local_token_global_indices is None:
            raise NotImplementedError(
                "This ContextParallelSharder has a data-dependent token layout; its index map arrives "
                "with the shard layout \u2014 token-tensor shard/gather are unavailable before the first shard."
            )
        return self.local_token_global_indices(padded_seq_len, device)

    def shard_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1, fill=None) -> torch.Tensor:
        """Select this rank's tokens of a global token-aligned tensor."""
        layout = self.shard_layout or _NO_SHARD_LAYOUT
        if layout.input_row_shape is not None and tuple(tensor.shape[:2]) == tuple(layout.input_row_shape):
            tensor = tensor.reshape(-1, *tensor.shape[2:])
            seq_dim = 0
        n = tensor.shape[seq_dim]
        if layout.padded_seq_len is not None and n != layout.padded_seq_len:
            raise ValueError(
                f"This ContextParallelSharder sharded a batch of padded_seq_len={layout.padded_seq_len} "
                f"(original_seq_len={layout.original_seq_len}), got a tensor of length {n} on dim {seq_dim}. "
                "Pass the original-length tensor with an explicit `fill`, or pre-pad it yourself."
            )
        idx = self._indices(n, tensor.device)
        return tensor.index_select(seq_dim, idx).contiguous()

    def gather_token_tensor(self, tensor: torch.Tensor, seq_dim: int = 1, trim: bool = False, fill=None):
        """All-gather local token tensors and restore global order (differentiable)."""
        cp_size = self._cp_size()
        padded = tensor.shape[seq_dim] * cp_size
        idx = self._indices(padded, tensor.device)
        if cp_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return tensor
        from torch.distributed.nn.functional import all_gather

        group = self._cp_mesh.get_group()
        parts = list(all_gather(tensor.contiguous(), group=group))
        index_parts = [torch.empty_like(idx) for _ in range(cp_size)]
        dist.all_gather(index_parts, idx.contiguous(), group=group)
        full = torch.cat(parts, dim=seq_dim)
        out = full.index_select(seq_dim, torch.argsort(torch.cat(index_parts)))
        if trim:
            layout = self.shard_layout or _NO_SHARD_LAYOUT
            if out.shape[seq_dim] != layout.padded_seq_len:
                raise ValueError(
                    f"gathered length {out.shape[seq_dim]} on dim {seq_dim} != reported padded_seq_len "
                    f"{layout.padded_seq_len}; the local shard does not match the batch this sharder last "
                    "sharded (or no collective ran)."
                )
            if layout.input_row_shape is not None:
                out = out.reshape(*layout.input_row_shape, *out.shape[1:])
        return out


_StandaloneContextParallelSharder.__name__ = _StandaloneContextParallelSharder.__qualname__ = "ContextParallelSharder"


def _unwrap_checkpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "_checkpoint_wrapped_module"):
        module = module._checkpoint_wrapped_module
    return module


def _ensure_mimo_te_context_parallel_standalone(model: torch.nn.Module, cp_mesh) -> None:
    """Spec mimo_te.md section 9, for when upstream's parallelization module is absent."""
    if cp_mesh is None or cp_mesh.size() <= 1:
        return
    group = cp_mesh.get_group()
    if getattr(model, "_mimo_te_cp_configured_group", None) is group:
        return
    stream = torch.cuda.Stream() if torch.cuda.is_available() else None
    for name, wrapped in model.named_modules():
        if not name.endswith("self_attn"):
            continue
        attn = _unwrap_checkpoint_module(wrapped)
        setup = getattr(attn, "setup_cp_attention", None)
        if not callable(setup):
            raise ValueError(f"MiMo context parallelism requires {name} to expose setup_cp_attention(cp_mesh).")
        setup(cp_mesh, cp_stream=stream)
    model._mimo_te_cp_configured_group = group


def _resolve_ensure():
    """Upstream's helper, looked up at call time on upstream's ``cp`` module (as upstream's own
    ``shard_batch_for_mimo_te`` does through its module globals, so a monkeypatch of
    ``cp.ensure_mimo_te_context_parallel`` reaches us too), then on ``parallelization``."""
    for name in (_UPSTREAM_CP, _UPSTREAM_PARALLELIZATION):
        fn = getattr(sys.modules.get(name) or _try_import(name), "ensure_mimo_te_context_parallel", None)
        if callable(fn):
            return fn
    return _ensure_mimo_te_context_parallel_standalone


def ensure_mimo_te_context_parallel(model: torch.nn.Module, cp_mesh) -> None:
    """Upstream's ``ensure_mimo_te_context_parallel`` when importable, else the spec'd equivalent."""
    _resolve_ensure()(model, cp_mesh)
