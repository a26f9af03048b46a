"""One process, one device: the reference every other strategy must match."""

from __future__ import annotations

from torch import nn

from gputrain.strategies.base import Strategy


class SingleDevice(Strategy):
    """The model on ``dist.device``; no wrapper, no collectives."""

    name = "single"

    def setup_module(self, model: nn.Module) -> nn.Module:
        return model.to(self.dist.device)
