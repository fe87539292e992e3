"""Upstream helpers the native sharder still calls are looked up at call time, where upstream's
own code finds them: ``ensure_mimo_te_context_parallel`` on upstream's MiMo ``cp`` module (its
``shard_batch_for_mimo_te`` reads it from its module globals), so a recipe or test that
monkeypatches ``cp.ensure_mimo_te_context_parallel`` changes our behaviour exactly as upstream's."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import nemo_cp_native as ncp
from nemo_cp_native import _compat
from nemo_cp_native.testing import make_mimo_batch

MIMO_CP = "nemo_automodel.components.models.mimo_v2_flash.cp"


def _batch():
    return make_mimo_batch(2, 8, num_chunks=1, cp_size=1, generator=torch.Generator().manual_seed(0))


def test_ensure_is_read_from_upstream_cp_at_call_time(monkeypatch):
    try:
        cp = importlib.import_module(MIMO_CP)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"upstream MiMo cp module not importable: {exc}")
    calls = []
    monkeypatch.setattr(cp, "ensure_mimo_te_context_parallel", lambda model, mesh: calls.append((model, mesh)))
    model = torch.nn.Linear(1, 1)
    ncp.mimo.shard_batch_for_mimo_te(None, None, _batch(), model=model)
    assert calls == [(model, None)]


def test_ensure_falls_back_to_the_stand_in(monkeypatch):
    for name in [n for n in sys.modules if n == "nemo_automodel" or n.startswith("nemo_automodel.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nemo_automodel", None)
    assert _compat._resolve_ensure() is _compat._ensure_mimo_te_context_parallel_standalone
    ncp.mimo.shard_batch_for_mimo_te(None, None, _batch(), model=torch.nn.Linear(1, 1))  # cp_mesh None: no-op
