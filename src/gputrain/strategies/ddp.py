"""DistributedDataParallel: one process per device, gradients all-reduced in backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gputrain.strategies.base import Strategy


class DDP(Strategy):
    """Replicates the model on every rank; each rank reads its own shard (see samplers)."""

    name = "ddp"

    def __init__(self, dist_info, *, find_unused_parameters: bool = False, static_graph: bool = False) -> None:
        super().__init__(dist_info)
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph

    def setup_module(self, model: nn.Module) -> nn.Module:
        model = model.to(self.dist.device)
        if not dist.is_initialized():
            # No process group (a plain `--devices 1` run): DDP cannot be built, and the
            # unwrapped model with the same sampler is what it would compute anyway.
            return model
        device_ids = [self.dist.device] if self.dist.device.type == "cuda" else None
        return DistributedDataParallel(
            model,
            device_ids=device_ids,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
        )

    def eval_module(self, module: nn.Module) -> nn.Module:
        # DDP's forward may broadcast buffers; ranks run different numbers of eval batches, so
        # evaluate the replica itself and keep collectives out of the loop.
        return self.unwrap(module)

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
