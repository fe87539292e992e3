"""Every repro of issue 17 as a named test. Repros that can crash the process run in a subprocess.

Fixed here: the ``thd_partition_indices`` items. The others are marked ``xfail`` (not strict)
with the owner of the fix in the reason (LEAD: attention.py / flint.py / plan.c; H3: thd_layout.h)
and pass once that fix is merged. Elsewhere: ``NCP_PATCH=1`` in every torchrun rank
(``test_patch_hook.py``), the import time (``test_import_time.py``), the bootstrap stamp
(``test_bootstrap.py``), the sanitizer build (``test_sanitizers.py``), upstream helpers looked
up at call time (``test_compat_upstream.py``), and every entry point fuzzed (``test_fuzz.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native import flint
from nemo_cp_native.reference.sink_attention import attention_ref
from nemo_cp_native.reference.te_partition import thd_get_partitioned_indices as te_oracle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _subprocess(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)  # fmt: skip


def i32(values, **kw):
    return torch.tensor(values, dtype=torch.int32, **kw)


# =============================================================================================
# thd_partition_indices
# =============================================================================================


def test_thd_binary_search_midpoint_with_2_30_entries():
    """A cu_seqlens of 2**30 + 16 entries (zero pages of an anonymous mapping: 4 GiB of address
    space, almost no memory) made ``(left + right) / 2`` overflow and segfault, with either validate."""
    res = _subprocess("""
        import mmap
        import torch, nemo_cp_native as ncp
        n = 2**30 + 16
        buf = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        cu = torch.frombuffer(buf, dtype=torch.int32)
        cu[-1] = 8  # every document empty but the last one, [0, 8)
        for validate in (False, True):
            print(validate, ncp.thd_partition_indices(cu, 8, 2, 1, validate=validate).tolist())
    """)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stderr[-3000:]}"
    want = te_oracle(i32([0, 8]), 8, 2, 1).tolist()
    assert res.stdout.split("\n")[:2] == [f"False {want}", f"True {want}"]


def test_thd_validate_rejects_cu_seqlens_end_past_total_tokens():
    cu = i32([0, 8, 16])
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must be <= total_tokens \(8\); got 16"):
        ncp.thd_partition_indices(cu, 8, 2, 0)
    # validate=False keeps TE's answer bit for bit (documents past total_tokens are ignored)
    assert torch.equal(ncp.thd_partition_indices(cu, 8, 2, 0, validate=False), te_oracle(cu, 8, 2, 0))
    # a stream longer than cu_seqlens[-1] (tail slots, TE's behaviour) is still accepted
    assert torch.equal(ncp.thd_partition_indices(i32([0, 8]), 16, 2, 0), te_oracle(i32([0, 8]), 16, 2, 0))


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(cp_rank=2**63), "cp_rank"),
        (dict(cp_rank=-(2**63) - 1), "cp_rank"),
        (dict(cp_size=2**63), "cp_size"),
        (dict(cp_size=2**31), "cp_size"),
        (dict(total_tokens=2**64), "total_tokens"),
        (dict(total_tokens=2**65, cp_size=2), "total_tokens"),
    ],
)
def test_thd_int_limits_name_the_argument(kw, name):
    args = dict(cu_seqlens=i32([0, 8]), total_tokens=8, cp_size=2, cp_rank=0) | kw
    with pytest.raises(ValueError, match=rf"^{name} "):
        ncp.thd_partition_indices(**args)


@pytest.mark.parametrize("validate", [True, False])
def test_thd_meta_tensor_names_cu_seqlens(validate):
    with pytest.raises(ValueError, match="cu_seqlens must be on the CPU or a CUDA device; got device 'meta'"):
        ncp.thd_partition_indices(i32([0, 8], device="meta"), 8, 2, 0, validate=validate)


# =============================================================================================
# sink attention (NaN semantics and errors: the lead's attention.py)
# =============================================================================================


def _qkv(T=4, hq=1, hkv=1, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv)]


def test_sink_attention_nan_query_row_propagates():
    q, k, v = (t.requires_grad_() for t in _qkv())
    with torch.no_grad():
        q[2, 0, 1] = float("nan")
    out, lse = ncp.sink_attention(q, k, v, None, i32([0, 4]), return_lse=True)
    assert torch.isnan(out[2]).all() and torch.isnan(lse[0, 2])
    assert not torch.isnan(out[:2]).any()  # rows before it never see it
    (dq,) = torch.autograd.grad(out.sum(), [q])
    assert torch.isnan(dq[2]).any()


def test_sink_attention_nan_key_seen_alone_propagates():
    q, k, v = _qkv()
    k[0, 0, 0] = float("nan")  # query 0 sees only key 0
    out, lse = ncp.sink_attention(q, k, v, None, i32([0, 4]), return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, None, i32([0, 4]))
    assert torch.isnan(ref_out[0]).all()
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out)) and torch.isnan(lse[0, 0])


def test_sink_attention_infinite_sink_gives_the_documented_nan():
    """README: +inf in the sink gives NaN for that head's rows (inf - inf), not the limit; the
    other heads are untouched."""
    q, k, v = _qkv(hq=2)
    sink = torch.tensor([float("inf"), 0.0])
    out, lse = ncp.sink_attention(q, k, v, sink, i32([0, 4]), return_lse=True)
    assert torch.isnan(out[:, 0]).all() and torch.isnan(lse[0]).all()
    assert not torch.isnan(out[:, 1]).any() and not torch.isnan(lse[1]).any()


def test_sink_attention_infinite_score_gives_the_documented_nan():
    """README: a +inf score gives NaN for its row (inf - inf), not the limit lse = +inf."""
    q, k, v = _qkv(T=2, d=1)
    q[1, 0, 0], k[0, 0, 0], k[1, 0, 0] = float("inf"), 1.0, -1.0  # query 1: +inf on key 0, -inf on key 1
    out, lse = ncp.sink_attention(q, k, v, torch.zeros(1), i32([0, 2]), return_lse=True)
    assert torch.isnan(lse[0, 1]) and not torch.isnan(lse[0, 0])


def test_sink_attention_large_head_dim_on_cpu():
    q, k, v = _qkv(T=3, d=1100)
    out = ncp.sink_attention(q, k, v, None, i32([0, 3]))
    assert torch.allclose(out, attention_ref(q, k, v, None, i32([0, 3]))[0], rtol=1e-9, atol=1e-12)


def test_sink_attention_many_heads_on_cpu():
    q, k, v = _qkv(T=2, hq=4100, hkv=1, d=1)
    out = ncp.sink_attention(q, k, v, None, i32([0, 2]))
    assert torch.allclose(out, attention_ref(q, k, v, None, i32([0, 2]))[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("validate", [True, False])
def test_sink_attention_meta_tensors_name_the_argument(validate):
    q, k, v = (t.to("meta") for t in _qkv())
    with pytest.raises(ValueError, match=r"\b(q|k|v|cu_seqlens)\b.*meta|meta.*\b(q|k|v|cu_seqlens)\b"):
        ncp.sink_attention(q, k, v, None, i32([0, 4], device="meta"), validate=validate)


def test_sink_attention_scale_true_is_rejected():
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match="scale"):
        ncp.sink_attention(q, k, v, None, i32([0, 4]), scale=True)


# =============================================================================================
# Flint (the lead's flint.py / plan.c)
# =============================================================================================


def _config(**kw):
    base = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=0, magi_chunk_size=64)
    return SimpleNamespace(**(base | kw))


def test_flint_sliding_window_2_63_names_the_field():
    with pytest.raises(ValueError, match="sliding_window"):
        flint._build_magi_plan(i32([0, 128]), _config(sliding_window=2**63), None)


@pytest.mark.parametrize("value", ["abc", "1e3", "8.0", "-1", "0"])
def test_flint_malformed_min_chunks_env_names_the_variable(value, monkeypatch):
    monkeypatch.setenv("MAGI_ATTENTION_MIN_CHUNKS_PER_RANK", value)
    with pytest.raises(ValueError, match="MAGI_ATTENTION_MIN_CHUNKS_PER_RANK"):
        flint._build_magi_plan(i32([0, 128]), _config(), None)


def test_flint_plan_past_int32_schedule_is_refused_before_allocating():
    """2**31 - 2 tokens, chunk 3, cp 3: the padded pack fits int32, the schedule does not. Run with
    3 GiB of address space, so a plan that tries to allocate fails fast instead of eating the machine."""
    res = _subprocess("""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        from types import SimpleNamespace
        import torch
        from nemo_cp_native import flint, testing
        cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=1, magi_chunk_size=3)
        try:
            flint._build_magi_plan(torch.tensor([0, 2**31 - 2], dtype=torch.int32), cfg, testing.SimulatedGroup(3, 0))
            print("built")
        except Exception as exc:
            print(type(exc).__name__, exc)
    """, timeout=120)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stderr[-3000:]}"
    assert res.stdout.startswith("ValueError") and "cu_seqlens" in res.stdout, res.stdout
