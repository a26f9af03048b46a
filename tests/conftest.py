"""Fixtures that keep one test from poisoning the next."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)

# Shared helpers (multiproc.py, ...) live beside this file; test files in unit/, distributed/ and e2e/
# import them by name, never from each other.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
