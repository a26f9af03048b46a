"""Fixtures that keep one test from poisoning the next."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)
# Inductor (trainer.compile) compiles in a pool of one process per core by default: each pool process imports torch
# again, and the suite already runs one pytest worker per core. One in-process compile thread is faster here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Shared helpers (multiproc.py, ...) live beside this file; test files in unit/, distributed/ and e2e/
# import them by name, never from each other.
sys.path.insert(0, str(Path(__file__).parent))

from hangs import pytest_timeout_set_timer  # noqa: E402,F401  (a test past its limit prints its ranks' stacks)

# A test longer than this by design is marked slow, or carries its own @pytest.mark.timeout with the reason.
SLOW_TIMEOUT_S = 600


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


TIERS = ("e2e", "distributed", "unit")
"""Collection order, which ``make test`` keeps (``--dist loadfile --no-loadscope-reorder``: each file runs whole on
one worker, so a module fixture such as a trained run is built once): the files of long tests first, the many
short unit tests last, to even out the two workers' ends."""


def pytest_collection_finish(session):
    import frozen_gc

    frozen_gc.freeze()  # the collected tests and every import stay to the end: out of the collector's scans


def pytest_collection_modifyitems(config, items):
    def tier(item: pytest.Item) -> int:
        parts = Path(str(item.path)).parts
        return next((i for i, name in enumerate(TIERS) if name in parts), len(TIERS))

    items.sort(key=tier)  # stable: each tier keeps its order
    for item in items:  # the default limit (pyproject.toml's timeout) is for the fast tier
        if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
