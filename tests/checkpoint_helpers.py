"""Helpers of the checkpoint writer's tests: compare two states leaf by leaf; hold a write at a known instant.

:class:`HeldSave`: a ``write`` function (what :class:`~gputrain.checkpoint.store.CheckpointStore` and
:class:`~gputrain.checkpoint.snapshot.CheckpointWriter` take) that opens a FIFO at a chosen instant of the write and
blocks until the test lets it go, so a kill or an in-place update lands inside the write rather than after a sleep.
The test injects it; production code has no switch for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint.files import write_temporary


class HeldSave:
    """Hold the writer at ``where`` until :meth:`release`: ``before`` the file is written, ``after`` it is written
    (its temporary whole, not yet committed), or ``inside`` it (the temporary holding part of the bytes)."""

    def __init__(self, folder: Path, where: str = "before") -> None:
        self.fifo = folder / "hold.fifo"
        os.mkfifo(self.fifo)
        self.where = where
        self.end: Any = None

    def write(self, state: Any, folder: Path, name: str) -> tuple[Path, int, dict[str, str]]:
        if self.where == "before":
            self._hold()
        path, size, checksum = write_temporary(state, folder, name)
        if self.where == "inside":
            os.truncate(path, size // 2)
        if self.where in ("after", "inside"):
            self._hold()
        return path, size, checksum

    def _hold(self) -> None:
        with open(self.fifo, "rb") as fifo:  # opening blocks until the test opens the other end
            fifo.read()  # returns once the test closes its end

    def reached(self) -> None:
        """Returns once the writer has opened the FIFO, i.e. it is held."""
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
