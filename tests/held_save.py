"""Hold a checkpoint write inside ``torch.save`` at a known instant, rather than after a sleep.

The writer (the background thread, the writer process, or a synchronous save) opens the FIFO named by
``GPUTRAIN_TEST_PAUSE_SAVE`` after its first bytes and blocks until the test lets it go.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

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
