"""DistributedDataParallel: one process per device, gradients all-reduced in backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gputrain.dist import DistInfo
from gputrain.strategies.base import Strategy

if TYPE_CHECKING:
    from gputrain.config import RunConfig


class DDP(Strategy):
    """Replicates the model on every rank; each rank reads its own share of every step (see samplers)."""

    name = "ddp"

    def __init__(self, dist_info: DistInfo, *, find_unused_parameters: bool = False, static_graph: bool = False) -> None:
        super().__init__(dist_info)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph

    @classmethod
    def from_config(cls, dist_info: DistInfo, cfg: RunConfig) -> DDP:
        return cls(dist_info, find_unused_parameters=cfg.trainer.find_unused_parameters)

    def describe(self) -> str:
        return f"strategy=ddp world_size={self.dist.world_size}"

    def setup_module(self, model: nn.Module) -> nn.Module:
        model = model.to(self.dist.device)
        if not dist.is_initialized():
            # No process group (a plain `--devices 1` run): DDP cannot be built, and the
            # unwrapped model with the same sampler is what it would compute anyway.
            return model
        device_ids = [self.dist.device] if self.dist.device.type == "cuda" else None
        # forward_sync_buffers=False: DDP's default broadcasts rank 0's buffers at every forward, a
        # collective that a rank without samples in the epoch's last step would not join. Training
        # forward normalises with batch statistics, so only evaluation and checkpoints read the
        # running buffers, and prepare_eval gives every rank rank 0's (the ones a checkpoint saves).
        # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets instead of a second
        # copy beside them, one model's worth of gradient memory less per rank (set_to_none re-points them).
        return DistributedDataParallel(
            model, device_ids=device_ids, find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph, forward_sync_buffers=False, gradient_as_bucket_view=True,
        )

    def eval_module(self, module: nn.Module) -> nn.Module:
        # Ranks run different numbers of eval batches, so evaluate the replica itself: no collectives.
        return self.unwrap(module)

    def prepare_eval(self, module: nn.Module) -> None:
        if not self._collective:
            return
        for buffer in self.unwrap(module).buffers():
            dist.broadcast(buffer, src=0)

    @contextlib.contextmanager
    def backward_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        # Toggling require_backward_grad_sync (what no_sync() does inside) rather than entering
        # no_sync() keeps one code path for both cases; the flag is read in forward, so it must
        # be set before the forward of the micro-batch it applies to.
        if not isinstance(module, DistributedDataParallel):
            yield
            return
        previous = module.require_backward_grad_sync
        module.require_backward_grad_sync = enabled
        try:
            yield
        finally:
            module.require_backward_grad_sync = previous
