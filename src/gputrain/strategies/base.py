"""The one small protocol every parallel strategy implements.

A strategy owns everything that differs between ways of running: how a module is wrapped
and unwrapped, which samples each rank reads, whether a backward pass syncs gradients, the
collectives used to reduce metrics, and how weights are gathered for saving. The training
loop only calls these methods, so it never branches on the strategy.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from gputrain.data.samplers import EvalSampler, TrainSampler
from gputrain.dist import DistInfo


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a nested batch (tensors, lists, tuples, dicts) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(v, device, non_blocking) for v in batch]
        return type(batch)(moved) if isinstance(batch, tuple) and not hasattr(batch, "_fields") else moved
    return batch


def strip_module_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop a leading ``module.`` (DataParallel/DDP) from every key, so saved weights load anywhere."""
    return {k.removeprefix("module."): v for k, v in state_dict.items()}


class Strategy(ABC):
    """How a model, its data and its gradients are spread over processes and devices."""

    name: ClassVar[str]

    def __init__(self, dist_info: DistInfo) -> None:
        self.dist = dist_info

    # -- model -------------------------------------------------------------------------
    @abstractmethod
    def setup_module(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to its device(s) and wrap it for this strategy."""

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's model inside whatever wrapper :meth:`setup_module` added."""
        return module.module if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else module

    def eval_module(self, module: nn.Module) -> nn.Module:
        """The module to run evaluation with; it must not issue collectives, since shards differ in length."""
        return module

    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Weights with plain keys (never ``module.``), as saved in checkpoints."""
        return strip_module_prefix(self.unwrap(module).state_dict())

    def load_model_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(module).load_state_dict(strip_module_prefix(state))

    @contextlib.contextmanager
    def backward_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        """Context for one forward+backward; ``enabled=False`` skips gradient sync (accumulation)."""
        yield

    # -- data --------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """Where inputs go before the forward pass."""
        return self.dist.device

    @property
    def output_device(self) -> torch.device:
        """Where the model's outputs land, so where targets must be for the loss."""
        return self.dist.device

    def train_sampler(self, length: int, *, seed: int, shuffle: bool = True, drop_last: bool = False) -> Sampler[int]:
        return TrainSampler(
            length, rank=self.dist.rank, world_size=self.dist.world_size, seed=seed, shuffle=shuffle,
            drop_last=drop_last,
        )

    def eval_sampler(self, length: int) -> Sampler[int]:
        return EvalSampler(length, rank=self.dist.rank, world_size=self.dist.world_size)

    def check_batch(self, batch_size: int) -> None:
        """Refuse a batch this strategy cannot run; the default accepts any."""

    def check_loss_inputs(self, outputs: Any, targets: Any) -> None:
        """Refuse outputs/targets the loss cannot combine; the default accepts any."""

    # -- collectives (no-ops in one process) ----------------------------------------------
    @property
    def _collective(self) -> bool:
        return self.dist.world_size > 1 and dist.is_initialized()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over all ranks (``sum`` or ``max``) and return it."""
        if self._collective:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self._collective:
            return [obj]
        out: list[Any] | None = [None] * self.dist.world_size if self.dist.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self._collective:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self._collective:
            dist.barrier()
