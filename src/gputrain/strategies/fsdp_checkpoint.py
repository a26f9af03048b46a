"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and the optimizer-state key conversions.

A full checkpoint (what ``gputrain`` writes by default) gathers every tensor on rank 0, so it needs
one rank's memory for the whole model and optimizer. A sharded checkpoint is a folder in which each
rank writes only the shards it holds (``__<rank>_0.distcp``) and rank 0 a ``.metadata`` index; it
loads on any number of processes, each reading just the pieces of its own shards, or into a plain
one-process model. The folder must be on storage every rank can write (the run folder).

The functions work with any strategy (single, ddp, fsdp): they read the state through
``torch.distributed.checkpoint.state_dict``, which understands plain, DDP and FSDP2 modules alike.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from gputrain.strategies.base import Strategy


# -- optimizer state: torch's index keys <-> DCP's parameter names ----------------------------------
def optimizer_state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """A parameter-name-keyed optimizer state (``get_optimizer_state_dict``) in ``optimizer.state_dict()`` form.

    Indices follow the order of the parameters across ``param_groups``, as torch numbers them, so
    the result loads into a plain optimizer built over the plain model with ``load_state_dict``.
    """
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    groups = [dict(group, params=[index[name] for name in group["params"]]) for group in state["param_groups"]]
    return {"state": {index[name]: s for name, s in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_fqn(state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An ordinary index-keyed optimizer state keyed by the names of ``optimizer``'s parameters in ``module``."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = sum(len(group["params"]) for group in state["param_groups"])
    if saved != len(names):
        raise ValueError(f"the checkpoint's optimizer state has {saved} parameters but this optimizer has "
                         f"{len(names)}; resume with the same model and optimizer settings")
    groups = [dict(group, params=[names[i] for i in group["params"]]) for group in state["param_groups"]]
    return {"state": {names[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}


# -- sharded (DCP) checkpoints ------------------------------------------------------------------------
@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    # Without a process group DCP warns that it "assumes" one process: here that is the point.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _metadata_keys(folder: Path) -> set[str]:
    if not (folder / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} is not a sharded checkpoint (it has no .metadata); give the folder that "
                                "save_sharded wrote")
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def save_sharded(strategy: Strategy, module: nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path) -> Path:
    """Write model and optimizer state as a DCP folder, each rank its own shards. A collective on all ranks."""
    folder = Path(folder)
    # Replicated tensors are written once, from whichever rank DCP picks: make every rank hold rank 0's
    # buffers (BatchNorm statistics differ by rank after training) so the saved copy is well defined.
    strategy.prepare_eval(module)
    model = strategy.unwrap(module)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    with _one_process_is_intended():
        dcp.save(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    return folder


def load_sharded(strategy: Strategy, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 folder: str | Path) -> None:
    """Load a DCP folder written on any number of ranks into this run's (sharded or plain) model and optimizer.

    A collective on all ranks when a process group exists. ``optimizer=None`` loads the weights only.
    """
    folder = Path(folder)
    saved = {k.removeprefix("model.") for k in _metadata_keys(folder) if k.startswith("model.")}
    model = strategy.unwrap(module)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    missing, unexpected = sorted(set(state["model"]) - saved), sorted(saved - set(state["model"]))
    if missing or unexpected:
        raise ValueError(f"sharded checkpoint {folder} does not fit this model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}; load it into the model it was saved from")
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def dcp_model_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The model entry of a DCP folder as full tensors, read in this process alone (no process group, any number
    of ranks saved it); the optimizer state is not read. What ``gputrain eval``, ``export``, ``predict`` and
    ``report`` load from a sharded checkpoint."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    _metadata_keys(folder)
    state: dict[str, Any] = {}
    # What torch's own dcp_to_torch_save does, for the "model" key alone and without writing a file.
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(folder)),
                     planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    return state["model"]


def dcp_to_full(folder: str | Path) -> dict[str, Any]:
    """A DCP folder as full tensors in one process: ``{"model": plain state dict, "optimizer": ordinary state}``.

    The model entry loads into the plain model with ``load_state_dict(strict=True)``, the optimizer
    entry into an optimizer built over it with ``load_state_dict`` (the form of a gputrain checkpoint).
    """
    folder = Path(folder)
    _metadata_keys(folder)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(folder), str(path))
        state = torch.load(path, weights_only=True)
    full: dict[str, Any] = {"model": state["model"]}
    if "optimizer" in state:
        full["optimizer"] = optimizer_state_by_index(state["optimizer"])
    return full
