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


def pytest_configure(config):
    """Draw the fuzz seed of this run (tests/test_fuzz.py) up front, so that the header and the
    summary can show it; NCP_FUZZ_SEED set by the caller replays a run."""
    os.environ.setdefault("NCP_FUZZ_SEED", str(random.SystemRandom().randrange(1, 2**31 - 1)))


def pytest_report_header(config):
    return f"ncp fuzz seed: NCP_FUZZ_SEED={os.environ['NCP_FUZZ_SEED']} (tests/test_fuzz.py)"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The fuzz seed again at the end, where ``-q`` (which hides the header) still shows it."""
    seed = os.environ.get("NCP_FUZZ_SEED")
    if seed:
        terminalreporter.write_line(f"ncp fuzz seed: NCP_FUZZ_SEED={seed} (replays tests/test_fuzz.py)")
