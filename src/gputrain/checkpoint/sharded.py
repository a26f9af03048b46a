"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes only the shards it holds.

A full checkpoint (what gputrain writes by default) gathers every tensor on rank 0, so it needs one rank's memory
for the whole model and optimizer. A sharded one (``parallel.sharded_checkpoint=true``) is a folder in which each
rank writes its shards (``__<rank>_0.distcp``) and rank 0 a ``.metadata`` index, beside the small ``.pt`` file that
names it; it loads on any number of processes, each reading just the pieces of its own shards, or into a plain
one-process model. The folder must be on storage every rank can write (the run folder).

The functions work with any strategy (single, ddp, fsdp): they read the state through
``torch.distributed.checkpoint.state_dict``, which understands plain, DDP and FSDP2 modules alike. In the
background, :func:`save_sharded_async` is DCP's own ``async_save`` (the state staged in host memory in the step,
written by DCP's thread over a gloo group of its own, as torchtitan does).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
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

from gputrain.strategies.fsdp import optimizer_state_by_index

if TYPE_CHECKING:
    from gputrain.strategies.base import Strategy

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


def _sharded_state(strategy: Strategy, module: nn.Module, optimizer: torch.optim.Optimizer,
                   ema: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    # Replicated tensors are written once, from whichever rank DCP picks: make every rank hold rank 0's
    # buffers (BatchNorm statistics differ by rank after training) so the saved copy is well defined.
    strategy.prepare_eval(module)
    model = strategy.unwrap(module)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:  # the EMA's own shards, under the model's keys (never gathered)
        state["ema"] = ema
    return state


def save_sharded(strategy: Strategy, module: nn.Module, optimizer: torch.optim.Optimizer, folder: str | Path,
                 ema: dict[str, torch.Tensor] | None = None) -> Path:
    """Write model and optimizer state (and ``ema``, this rank's tensors of the weights' moving average) as a DCP
    folder, each rank its own shards. A collective on all ranks."""
    folder = Path(folder)
    with _one_process_is_intended():
        dcp.save(_sharded_state(strategy, module, optimizer, ema), checkpoint_id=str(folder),
                 no_dist=not dist.is_initialized())
    return folder


def save_sharded_async(strategy: Strategy, module: nn.Module, optimizer: torch.optim.Optimizer,
                       folder: str | Path, group: dist.ProcessGroup | None,
                       ema: dict[str, torch.Tensor] | None = None) -> Future[Any]:
    """:func:`save_sharded` in the background: a collective that returns once the state is staged in host memory.

    The future completes once every rank's shards and (on rank 0) the ``.metadata`` are written; it raises what
    went wrong otherwise. The writes talk over ``group``, a gloo group of their own (:func:`new_write_group`), so
    they never queue behind (or in front of) the training's collectives. Wait for it before the next save.
    """
    state = _sharded_state(strategy, module, optimizer, ema)
    if not dist.is_initialized():
        done: Future[Any] = Future()
        with _one_process_is_intended():
            dcp.save(state, checkpoint_id=str(folder), no_dist=True)
        done.set_result(None)
        return done
    result = dcp.async_save(state, checkpoint_id=str(folder), process_group=group)
    return result if isinstance(result, Future) else result.upload_completion


def new_write_group() -> dist.ProcessGroup | None:
    """The gloo group background sharded saves write over (a collective; None without a process group).

    It lives as long as the run's :class:`~gputrain.checkpoint.checkpointer.Checkpointer`, not the process: a group
    still referenced at interpreter exit keeps gloo's threads into its teardown (see :func:`gputrain.dist.teardown`).
    """
    if not dist.is_initialized():
        return None
    group = dist.new_group(backend="gloo")
    return group if isinstance(group, dist.ProcessGroup) else None  # every rank is a member: never NON_GROUP_MEMBER


def prune_sharded_folders(folder: Path, keep: str = "") -> None:
    """Delete DCP folders that no checkpoint file in ``folder`` refers to (rotated away by ``trainer.keep_last``),
    except ``keep``: the folder of the save in flight, whose file is not committed yet."""
    _prune(folder, {keep})


def remove_uncommitted_folders(folder: Path) -> None:
    """Delete the DCP folders of saves never committed (a node killed mid-save): no checkpoint file refers to one,
    or has its name (a damaged file's folder is kept). At the start of a run, on rank 0, while nothing writes: a
    resumed run that saves the same step again then writes a new folder, never beside a lost world's shards."""
    _prune(folder, {f"{pt.stem}.dcp" for pt in folder.glob("*.pt")})


def _prune(folder: Path, keep: set[str]) -> None:
    used = set(keep)
    for pt in folder.glob("*.pt"):
        try:
            used.add(torch.load(pt, map_location="cpu", weights_only=True).get("sharded", ""))
        except Exception:  # noqa: BLE001  (a damaged file refers to nothing we can trust)
            continue
    for dcp_folder in folder.glob("*.dcp"):
        if dcp_folder.name not in used:
            shutil.rmtree(dcp_folder, ignore_errors=True)


def load_sharded(strategy: Strategy, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                 folder: str | Path, ema: dict[str, torch.Tensor] | None = None) -> None:
    """Load a DCP folder written on any number of ranks into this run's (sharded or plain) model and optimizer,
    and ``ema`` (this rank's tensors of the moving average) in place when given.

    A collective on all ranks when a process group exists. ``optimizer=None`` loads the weights only.
    """
    folder = Path(folder)
    keys = _metadata_keys(folder)
    saved = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    model = strategy.unwrap(module)
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    missing, unexpected = sorted(set(state["model"]) - saved), sorted(saved - set(state["model"]))
    if missing or unexpected:
        raise ValueError(f"sharded checkpoint {folder} does not fit this model: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}; load it into the model it was saved from")
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    if ema is not None:
        if not any(k.startswith("ema.") for k in keys):
            raise ValueError(f"sharded checkpoint {folder} holds no EMA of the weights, though its checkpoint file "
                             "says it does; resume from another checkpoint")
        state["ema"] = ema  # loaded in place, each rank its own shards
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def dcp_model_weights(folder: str | Path, key: str = "model") -> dict[str, torch.Tensor]:
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
                     planner=_EmptyStateDictLoadPlanner(keys={key}), no_dist=True)
    return state[key]


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
