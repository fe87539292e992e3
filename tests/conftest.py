"""Shared test fixtures: a fresh, reproducible seed per test, device helpers, markers.

Every test gets a new random seed unless ``NCP_TEST_SEED`` is set; the seed is printed in the
failure report so a failing draw can be replayed exactly:

    NCP_TEST_SEED=1234 pytest tests/test_x.py::test_y
"""

from __future__ import annotations

import os
import random

import pytest
import torch

_SEED_KEY = pytest.StashKey[int]()


def _draw_seed() -> int:
    env = os.environ.get("NCP_TEST_SEED")
    if env:
        return int(env)
    return random.SystemRandom().randrange(0, 2**31 - 1)


@pytest.fixture(autouse=True)
def ncp_seed(request) -> int:
    """Seed torch and Python's RNG for this test; returns the seed."""
    seed = _draw_seed()
    request.node.stash[_SEED_KEY] = seed
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    seed = item.stash.get(_SEED_KEY, None)
    if seed is not None and report.failed:
        report.sections.append(("ncp seed", f"reproduce with NCP_TEST_SEED={seed}"))
    return report


def _cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import nemo_cp_native as ncp
    except Exception:  # noqa: BLE001
        return False
    return ncp.has_cuda()


CUDA_READY = _cuda_ready()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of nemo_cp_native")
    for item in items:
        if "cuda" in item.keywords and not CUDA_READY:
            item.add_marker(skip_cuda)


def pytest_report_header(config):
    """The fuzz seed of this run (tests/test_fuzz.py), drawn here so the header can show it."""
    seed = os.environ.setdefault("NCP_FUZZ_SEED", str(random.SystemRandom().randrange(1, 2**31 - 1)))
    return f"ncp fuzz seed: NCP_FUZZ_SEED={seed} (tests/test_fuzz.py)"
