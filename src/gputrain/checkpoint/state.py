"""What a checkpoint holds, and putting it back: the engine's live objects in, a plain dict out, and the reverse.

A checkpoint is plain containers and tensors only (``torch.load(weights_only=True)`` reads it): ``model`` and
``optimizer`` (gathered through the strategy; empty when a sharded folder holds them, named by ``sharded``),
``scheduler``, ``precision`` (the GradScaler's state), ``state`` (:class:`TrainState`), ``rng`` (each rank's
generators), ``loss_window`` (the epoch's loss sums so far), ``world_size``, ``global_batch`` and ``config``
(the resolved config). The format is the same as every earlier gputrain wrote; keys an older file lacks take
their defaults.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gputrain.checkpoint.files import tensors_finite
from gputrain.dist import DistInfo, comm, node_name

if TYPE_CHECKING:
    from torch import nn

    from gputrain.precision import Precision
    from gputrain.strategies.base import Strategy


@dataclass
class TrainState:
    """Where the run is; saved in checkpoints."""

    epoch: int = 0
    """Epochs completed."""
    global_step: int = 0
    """Optimizer steps taken."""
    samples_seen: int = 0
    """Training samples consumed, over all ranks (each sample of an epoch once)."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch: the cursor a mid-epoch checkpoint resumes from."""


@dataclass
class Parts:
    """The engine's live objects a checkpoint is made of (and restored into)."""

    dist: DistInfo
    strategy: Strategy
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    precision: Precision
    ema: dict[str, torch.Tensor] | None = None
    """This rank's tensors of the EMA of the weights, which a sharded checkpoint writes beside the model's."""


def checkpoint_state(parts: Parts, extra: dict[str, Any], sharded: str = "") -> dict[str, Any]:
    """Everything needed to continue the run exactly; plain containers and tensors only (a collective).

    ``extra``: what the engine adds (``state``, ``loss_window``, ``global_batch``, ``config``). With ``sharded`` (a
    DCP folder's name beside the file), model and optimizer are in that folder instead.
    """
    gathered = comm.gather_objects((rng_state(), node_name()))
    weights: dict[str, Any] = {"model": {}, "optimizer": {}, "sharded": sharded} if sharded else {
        "model": parts.strategy.model_state_dict(parts.module),
        "optimizer": parts.strategy.optimizer_state_dict(parts.module, parts.optimizer),
    }
    return {
        **weights,
        "scheduler": parts.scheduler.state_dict(),
        "precision": parts.precision.state_dict(),
        "rng": {str(rank): state for rank, (state, _) in enumerate(gathered)} if gathered else {},
        "world_size": parts.dist.world_size,
        "nodes": sorted({node for _, node in gathered}) if gathered else [],  # whom a membership record names
        **extra,
    }


def check_same_run(saved: dict[str, Any], task: str, model: str, path: str) -> None:
    """A checkpoint of another task or model cannot be continued: said first, before any adjustment or optimizer
    mismatch that would only follow from it. ``saved``: the config the checkpoint recorded (absent: not checked)."""
    saved_task, saved_model = saved.get("task"), (saved.get("model") or {}).get("name")
    if saved_task is None or (saved_task, saved_model or "") == (task, model or ""):
        return
    raise ValueError(
        f"checkpoint {path} was trained by task {saved_task} with model {saved_model or '(the task default)'}, and "
        f"this run is task {task} with model {model or '(the task default)'}: --resume continues the run that wrote "
        "it; give that run's recipe (its config.yaml beside checkpoints/), or start a new run without --resume")


def restore(parts: Parts, state: dict[str, Any], path: str) -> TrainState:
    """Load model (unless sharded: the caller loads its folder), optimizer, schedule, precision and this rank's RNG;
    returns where the run is. Every rank must reach the same step (a collective checks it)."""
    saved_optim = state.get("config", {}).get("optim", {}).get("name")
    optim = type(parts.optimizer).__name__.lower()
    if saved_optim and saved_optim != optim:
        raise ValueError(
            f"checkpoint {path} was trained with optim.name={saved_optim} but this run sets optim.name={optim}; "
            "resume with the same optimizer, or load only the weights (model.weights) to start a new run"
        )
    if not state.get("sharded"):
        parts.strategy.load_model_state_dict(parts.module, state["model"])
        parts.strategy.load_optimizer_state_dict(parts.module, parts.optimizer, state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    parts.precision.load_state_dict(state.get("precision", {}))
    known = {f.name for f in dataclasses.fields(TrainState)}
    progress = TrainState(**{k: v for k, v in state["state"].items() if k in known})
    rng = state.get("rng", {})
    if state.get("world_size") == parts.dist.world_size and str(parts.dist.rank) in rng:
        set_rng_state(rng[str(parts.dist.rank)])  # dropout continues its stream only on the same layout
    steps = comm.all_gather_objects(progress.global_step)
    if len(set(steps)) != 1:
        raise ValueError(f"ranks resumed at different steps {steps} from {path}; resume all ranks from one folder")
    return progress


def all_finite(parts: Parts, loss: float | None = None) -> bool:
    """Whether loss, weights, buffers and optimizer state are finite on every rank (a collective)."""
    local_ok = tensors_finite([t for t in parts.strategy.local_tensors(parts.module, parts.optimizer)
                               if t.is_floating_point() or t.is_complex()])
    if loss is not None and not torch.isfinite(torch.tensor(loss)):
        local_ok = False
    bad = torch.tensor([0.0 if local_ok else 1.0], device=parts.strategy.root_device)
    return float(comm.all_reduce(bad, op="max")) == 0.0


def position(state: TrainState) -> str:
    """Where a run stands, as every line that names a place in a run counts it: the epoch (1-based), the step within
    it and the global step, each named."""
    where = (f"epoch {state.epoch + 1}, after step {state.step_in_epoch} of that epoch" if state.step_in_epoch
             else f"the start of epoch {state.epoch + 1}")
    return f"{where} (global step {state.global_step})"


def resumed_line(path: str, state: TrainState) -> str:
    """Where a resumed run continues, counted as the line of the interrupted run counts it (:func:`position`)."""
    return f"gputrain: resumed from {path} at {position(state)}"


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
