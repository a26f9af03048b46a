"""Atomic checkpoint writes and safe loads.

A checkpoint is written to a temporary file in the same folder, flushed to disk, and renamed
over the target, so a crash mid-write leaves the previous checkpoint intact. Loading always
uses ``weights_only=True``: a checkpoint holds tensors and plain containers, nothing that
needs arbitrary unpickling.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    # The rename is durable only once the folder entry is on disk too.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a gputrain checkpoint with ``weights_only=True``; errors name the file and the cause."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError or EOFError by cause
        raise ValueError(
            f"checkpoint {path} cannot be loaded safely ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "it is truncated, corrupt, or holds objects other than tensors and plain containers"
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"checkpoint {path} is not a gputrain checkpoint (no 'model' entry)")
    return state


def model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Just the model state_dict of a checkpoint, or of a bare state_dict file."""
    path = Path(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        return state["model"]
    if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
        return state
    raise ValueError(f"{path} holds neither a gputrain checkpoint nor a state_dict of tensors")


def rng_state() -> dict[str, Any]:
    """Random generator states that decide dropout and augmentation on this rank."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
