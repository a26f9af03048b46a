"""Helpers of the checkpoint writer's tests: compare two states leaf by leaf; hold a write at a known instant.

:class:`HeldSave`: the writer (the background thread, the writer process, or a synchronous save) opens the FIFO named
by ``GPUTRAIN_TEST_PAUSE_SAVE`` after its first bytes and blocks until the test lets it go, so a kill or an in-place
update lands inside the write rather than after a sleep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gputrain.checkpoint_io import PAUSE_ENV


class HeldSave:
    """Hold the writer inside ``torch.save`` (after its first bytes) until :meth:`release`."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fifo = folder / "hold.fifo"
        os.mkfifo(self.fifo)
        monkeypatch.setenv(PAUSE_ENV, str(self.fifo))
        self.end: Any = None

    def reached(self) -> None:
        """Returns once the writer has opened the FIFO, i.e. it is paused inside the write."""
        self.end = open(self.fifo, "wb")  # noqa: SIM115  (blocks until the reader, the writer, opens it)

    def release(self) -> None:
        self.end.close()


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of nested dicts, lists and tuples, with its key path (``['model']['w']``)."""
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from leaves(obj[key], f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, obj


def assert_same_state(a: Any, b: Any, *, strides: bool = False) -> None:
    """Same keys, and each tensor equal with the same dtype and shape (and strides, if asked)."""
    left, right = dict(leaves(a)), dict(leaves(b))
    assert left.keys() == right.keys()
    for key, value in left.items():
        if isinstance(value, torch.Tensor):
            other = right[key]
            assert (value.dtype, value.shape) == (other.dtype, other.shape), key
            assert not strides or value.stride() == other.stride(), key
            assert torch.equal(value, other), key
        else:
            assert value == right[key], key
