"""Shared by the ``gputrain predict`` tests (tests/e2e/test_predict*.py): the quiet CPU flags, and ``gputrain``
commands run in this process (``gputrain.cli.main``: the same code path, without seconds of imports each)."""

from __future__ import annotations

import json
from pathlib import Path

from gputrain.cli import main

QUIET = ["--accelerator", "cpu", "trainer.progress_bar=false", "trainer.loggers=[]", "trainer.pictures=0"]


def _run(args: list[str]) -> None:
    assert main([str(a) for a in args]) == 0, args


def _eval(checkpoint: Path, out: Path) -> dict[str, float]:
    _run(["eval", "--checkpoint", checkpoint, "--out", out, "--accelerator", "cpu", "trainer.progress_bar=false"])
    return json.loads((out / "eval.json").read_text())
