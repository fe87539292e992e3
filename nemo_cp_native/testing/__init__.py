"""Test and benchmark helpers, apart from the product code: case generators (MiMo packed batches,
attention documents), a one-process stand-in for a CP device mesh, every CP rank simulated in one
process, and the attention dispatcher's test hooks. Users' own tests may import them too."""

from .attention_cases import attention_flops, doc_lengths, make_attention_case, pack_documents, visible_pairs
from .cp import SimulatedGroup, simulate_cp_attention
from .debug import attn_debug, kernels
from .mesh import fake_mesh
from .mimo_cases import SEQ_LENS_SENTINEL, count_syncs, flat_cases, make_mimo_batch, random_case

__all__ = [
    "SEQ_LENS_SENTINEL",
    "SimulatedGroup",
    "attention_flops",
    "attn_debug",
    "count_syncs",
    "doc_lengths",
    "fake_mesh",
    "flat_cases",
    "kernels",
    "make_attention_case",
    "make_mimo_batch",
    "pack_documents",
    "random_case",
    "simulate_cp_attention",
    "visible_pairs",
]
