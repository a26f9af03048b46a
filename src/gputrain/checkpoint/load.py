"""Reading checkpoints safely: checked first (manifest or the file's own CRCs), then ``torch.load(weights_only=True)``.

``weights_only=True`` loads tensors and plain containers only, so a malicious pickle runs nothing; every failure
is one line naming the file (missing, truncated, bit-flipped, unsafe, not a gputrain checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint.manifest import check_against, check_unlisted, manifest_entries


def verify(path: str | Path) -> None:
    """Raise naming ``path`` and what is wrong when it is missing, empty, truncated or corrupt.

    A file the manifest of its folder lists is checked for size and checksum; any other file (a copy shared
    elsewhere, a download) against the CRC-32 that torch's zip format stores for each of its records, so a
    damaged file is refused wherever it lies.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    entries = manifest_entries(path)
    problem = check_against(path, entries) if entries else check_unlisted(path, legacy_ok=True)
    if problem:
        raise ValueError(f"checkpoint {path} is damaged ({problem}); --resume auto skips it, or pass an older "
                         "checkpoint")


def _load_safely(path: Path, map_location: str | torch.device) -> Any:
    """``torch.load(weights_only=True)``; torch's several-paragraph refusal becomes one line naming the file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError or EOFError by cause
        raise ValueError(
            f"checkpoint {path} cannot be loaded safely ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "it is truncated, corrupt, or holds objects other than tensors and plain containers"
        ) from None


WEIGHTS = ("model", "ema")
"""What a tool may load from a checkpoint: the trained weights, or their moving average (``trainer.ema_decay``)."""


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *,
                    gather_sharded: bool = False, weights: str = "model") -> dict[str, Any]:
    """Load a gputrain checkpoint with ``weights_only=True`` after :func:`verify`; errors name the file.

    ``gather_sharded``: a sharded checkpoint's weights (``parallel.sharded_checkpoint``, in a DCP folder beside
    the file) are gathered into ``state["model"]`` in this process, as the tools that evaluate, export or
    predict need them; resuming leaves them in the folder, for each rank to read its own shards.
    ``weights="ema"``: ``state["model"]`` holds the moving average of the weights instead (tools only).
    """
    path = Path(path)
    verify(path)
    state = _load_safely(path, map_location)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"checkpoint {path} is not a gputrain checkpoint (no 'model' entry)")
    if weights == "ema":
        ema = state.get("ema")
        if not ema:
            raise ValueError(f"checkpoint {path} holds no moving average of the weights (its run had "
                             "trainer.ema_decay=0); drop --weights ema to use its trained weights")
        state["model"] = _sharded_weights(path, state["sharded"], "ema") if state.get("sharded") else ema["weights"]
    elif weights != "model":
        raise ValueError(f"--weights {weights} is unknown; choose {' or '.join(WEIGHTS)}")
    elif gather_sharded and state.get("sharded"):
        state["model"] = _sharded_weights(path, state["sharded"])
    return state


def _sharded_weights(path: Path, folder_name: str, key: str = "model") -> dict[str, torch.Tensor]:
    """The full model weights of sharded checkpoint ``path``, read from its DCP folder without a process group."""
    from gputrain.checkpoint.sharded import dcp_model_weights

    folder = path.parent / folder_name
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {path} is sharded: its weights are in the folder {folder}, which is "
                                f"missing; copy {folder_name}/ beside it (it sits beside the file in the run's "
                                "checkpoints/), or use a checkpoint saved without parallel.sharded_checkpoint")
    return dcp_model_weights(folder, key)


def model_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Just the model state_dict of a checkpoint (a sharded one's gathered), or of a bare state_dict file."""
    path = Path(path)
    verify(path)
    state = _load_safely(path, "cpu")
    if isinstance(state, dict) and state.get("sharded"):  # model and optimizer live in a DCP folder beside it
        return _sharded_weights(path, state["sharded"])
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        return state["model"]
    if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
        return state
    raise ValueError(f"{path} holds neither a gputrain checkpoint nor a state_dict of tensors")
