"""A fake upstream ``flint.magi`` module for the patch tests: each replaced name is a distinct
placeholder (a class for the class names, a function for the others)."""

from __future__ import annotations

import sys
import types

FLINT = "nemo_automodel.components.models.flint.magi"
NAMES = ("FlintMagiPlan", "FlintMagiBatchPlans", "_build_magi_plan", "_prepare_magi_inputs")


def install_fake_flint(monkeypatch) -> tuple[types.ModuleType, dict]:
    """Puts the fake module in ``sys.modules`` (undone by ``monkeypatch``); returns it and its
    original objects by name."""
    originals = {n: type(n, (), {}) if n[0].isupper() else (lambda *a, n=n: n) for n in NAMES}
    magi = types.ModuleType(FLINT)
    for n, obj in originals.items():
        setattr(magi, n, obj)
    monkeypatch.setitem(sys.modules, FLINT, magi)
    return magi, originals
