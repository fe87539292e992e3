"""patch() / unpatch() / patched() against stand-in upstream modules (the Flint module is not in
any public NeMo Automodel release, so its target is faked here), and the no-upstream case."""

from __future__ import annotations

import sys
import types

import pytest

import nemo_cp_native as ncp
from nemo_cp_native import flint
from nemo_cp_native.patch import is_patched

from _fake_flint import FLINT, NAMES, install_fake_flint  # noqa: E402

FLINT_MODEL = "nemo_automodel.components.models.flint.model"


@pytest.fixture
def fake_flint(monkeypatch):
    """A fake upstream flint.magi module plus a model module that imported one name directly."""
    magi, originals = install_fake_flint(monkeypatch)
    model = types.ModuleType(FLINT_MODEL)
    model._prepare_magi_inputs = originals["_prepare_magi_inputs"]
    monkeypatch.setitem(sys.modules, FLINT_MODEL, model)
    yield magi, model, originals
    ncp.unpatch()


def test_patch_swaps_flint_names_and_importers(fake_flint):
    magi, model, originals = fake_flint
    swapped = ncp.patch()
    for n in NAMES:
        assert getattr(magi, n) is getattr(flint, n)
        assert f"{FLINT}.{n}" in swapped
    assert model._prepare_magi_inputs is flint._prepare_magi_inputs
    assert f"{FLINT_MODEL}._prepare_magi_inputs" in swapped
    assert ncp.patch() == [] and is_patched()  # idempotent
    restored = ncp.unpatch()
    assert f"{FLINT}._build_magi_plan" in restored and not is_patched()
    for n in NAMES:
        assert getattr(magi, n) is originals[n]
    assert model._prepare_magi_inputs is originals["_prepare_magi_inputs"]


def test_patched_context_restores(fake_flint):
    magi, _, originals = fake_flint
    with ncp.patched() as swapped:
        assert swapped and magi._build_magi_plan is flint._build_magi_plan
    assert magi._build_magi_plan is originals["_build_magi_plan"]


def test_patch_without_upstream_is_a_noop(monkeypatch, caplog):
    for name in list(sys.modules):
        if name == "nemo_automodel" or name.startswith("nemo_automodel."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nemo_automodel", None)  # import raises ImportError
    with caplog.at_level("INFO", logger="nemo_cp_native.patch"):
        assert ncp.patch() == []
    assert not is_patched()
    assert "not importable" in caplog.text
    assert ncp.unpatch() == []
