"""Small checkpoint states and the store's manifest read strictly: shared by the checkpoint store's tests
(tests/unit/test_checkpoint_store.py, tests/unit/test_checkpoint_damage.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gputrain.checkpoint import load_checkpoint


def _state(step: int, numel: int = 1000) -> dict:
    return {"model": {"w": torch.full((numel,), float(step))}, "state": {"global_step": step, "epoch": step // 10}}


def _manifest(folder: Path) -> dict:
    def refuse(token: str) -> None:
        raise AssertionError(f"manifest.json holds {token}, which strict JSON does not allow")

    return json.loads((folder / "manifest.json").read_text(), parse_constant=refuse)


def _saved_step(path: Path) -> int:
    return load_checkpoint(path)["state"]["global_step"]
