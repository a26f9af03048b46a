"""FSDP2: parameters, gradients and optimizer state sharded over ranks (``torch.distributed.fsdp.fully_shard``).

Each rank holds 1/N of every sharded block's parameters (DTensors on a 1-D device mesh). Forward
and backward all-gather a block's parameters just before it runs and free them after (with
``reshard_after_forward``); backward reduce-scatters gradients so each rank keeps the averaged
gradient of its own shard, and the optimizer steps on shards only. The model itself stays an
unmodified ``nn.Module``: :func:`shard_units` picks the blocks from parameter counts alone.

Because forward runs collectives, every rank joins every micro-batch (an empty slice where it has
no samples) and evaluation runs in lockstep. Checkpoints hold the full, unsharded state with the
plain model's keys, so they load anywhere; sharded (DCP) checkpoints are in :mod:`gputrain.checkpoint.sharded`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from gputrain.dist import DistInfo, device_mesh
from gputrain.strategies.base import Strategy, strip_module_prefix, tensors_of

if TYPE_CHECKING:
    from gputrain.config import RunConfig

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


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Unsharded tensors gathered to rank 0's CPU memory (other ranks get an empty dict)."""


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def shard_units(model: nn.Module, min_fraction: float = 0.005) -> list[str]:
    """Names of the submodules that become their own FSDP unit (the root takes whatever is left).

    Every top-level child holding at least ``min_fraction`` of the model's parameters is a unit
    (torchvision's ResNet: ``layer1`` .. ``layer4`` and ``fc``; the stem's few parameters stay with
    the root). A container holding more than half of the model (a ``features`` Sequential, a
    ``backbone``) is split into its own children instead, so no single unit gathers most of the
    model at once.
    """
    total = _param_count(model)
    units: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            n = _param_count(child)
            if n == 0 or n < min_fraction * total:
                continue
            if n > total / 2 and any(_param_count(c) for c in child.children()):
                visit(f"{prefix}{name}.", child)
            else:
                units.append(f"{prefix}{name}")

    visit("", model)
    return units


class FSDP(Strategy):
    """Fully sharded data parallelism: one process per device, each holding a shard of the model."""

    name = "fsdp"
    eval_in_lockstep = True

    def __init__(self, dist_info: DistInfo, *, reshard_after_forward: bool = True, min_fraction: float = 0.005) -> None:
        super().__init__(dist_info)
        self.reshard_after_forward = reshard_after_forward
        self.min_fraction = min_fraction
        self.units: list[str] = []

    @classmethod
    def from_config(cls, dist_info: DistInfo, cfg: RunConfig) -> FSDP:
        return cls(dist_info, reshard_after_forward=cfg.parallel.reshard_after_forward)

    def describe(self) -> str:
        units = ",".join(self.units) if self.units else "root only"
        return (f"strategy=fsdp world_size={self.dist.world_size} units=[{units}]+root "
                f"reshard_after_forward={self.reshard_after_forward}")

    # -- model and optimizer ---------------------------------------------------------------
    def setup_module(self, model: nn.Module) -> nn.Module:
        if not self._collective:
            # One process without a process group: nothing to shard, and the plain model computes
            # exactly what a 1-rank FSDP would.
            return model.to(self.dist.device)
        # No model.to(device) first: fully_shard moves each unit to the mesh's device as it shards
        # it, so the whole unsharded model never has to fit on one GPU at once.
        mesh = device_mesh(self.dist.device.type, self.dist.world_size)
        self.units = shard_units(model, self.min_fraction)
        for name in self.units:
            fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        return model

    def compile_module(self, module: nn.Module, mode: str) -> None:
        """Compile each sharded block's ``forward``: FSDP's gather and free hooks stay outside the graphs (as in
        torchtitan's per-block compile), and the parameters keep their names."""
        if not self._sharded(module):
            return super().compile_module(module, mode)
        import torch

        for name in self.units:
            unit = module.get_submodule(name)
            unit.forward = torch.compile(unit.forward, mode=mode)  # type: ignore[method-assign]
        return None

    @staticmethod
    def _sharded(module: nn.Module) -> bool:
        return isinstance(module, FSDPModule)

    def has_forward_collectives(self, module: nn.Module) -> bool:
        return self._sharded(module) or super().has_forward_collectives(module)

    def prepare_eval(self, module: nn.Module) -> None:
        # Buffers (BatchNorm running statistics) are replicated, not sharded, and each rank updated
        # its own from its own samples: adopt rank 0's, the ones a checkpoint saves.
        if not self._collective:
            return
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The full unsharded weights on rank 0 (CPU tensors, plain keys); ``{}`` on other ranks. A collective."""
        if not self._sharded(module):
            return super().model_state_dict(module)
        return cast(dict[str, torch.Tensor], get_model_state_dict(module, options=FULL))

    def load_model_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a full state dict that every rank read (resume loads the file on each); each keeps its shard."""
        if not self._sharded(module):
            return super().load_model_state_dict(module, state)
        set_model_state_dict(module, strip_module_prefix(state), options=StateDictOptions(full_state_dict=True))
        return None

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state in torch's ordinary index-keyed form (rank 0; ``{}`` elsewhere). A collective."""
        if not self._sharded(module):
            return super().optimizer_state_dict(module, optimizer)
        state = get_optimizer_state_dict(module, optimizer, options=FULL)
        return optimizer_state_by_index(state) if state else {}

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        if not self._sharded(module):
            return super().load_optimizer_state_dict(module, optimizer, state)
        by_fqn = optimizer_state_by_fqn(state, module, optimizer)
        set_optimizer_state_dict(module, optimizer, by_fqn, options=StateDictOptions(full_state_dict=True))
        return None

    def local_tensors(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        """This rank's shards: checking them needs no collective, and every element is checked on some rank."""
        for t in itertools.chain(module.parameters(), module.buffers(), tensors_of(optimizer.state_dict()["state"])):
            yield t.to_local() if isinstance(t, DTensor) else t

    # -- the step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        # Without sync, FSDP2 keeps the unsharded gradients and adds the next micro-batch's to them;
        # the last micro-batch of the step reduce-scatters the sum once.
        if not self._sharded(module):
            yield
            return
        module.set_requires_gradient_sync(enabled)  # type: ignore[operator]
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def finish_gradients(self, module: nn.Module) -> None:
        """Nothing to do: every rank joins every micro-batch, so the last one always reduce-scatters."""

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to the norm over all shards, the norm one process would compute on the whole model.

        ``get_total_norm`` over DTensor gradients reduces the shards' norms across ranks (a collective)
        and returns a replicated DTensor; ``full_tensor`` makes it a plain tensor for the caller.
        """
        params = [p for p in module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total
