"""A model's forward as an ordered chain of named blocks, and the generic glue such a chain needs.

A model that is not an ``nn.Sequential`` describes its forward as a chain by a method ``chain_blocks()``: named
blocks that, applied in order, compute ``model(x)``, sharing the model's submodules (no copies). The state passed
between blocks is a tensor, or a tuple of tensors when a later block needs an earlier result. Nothing here is
about parallelism: a chain is a fact about the model's computation, which the partitioner
(:mod:`gputrain.parallel`) reads.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

Block = tuple[str, nn.Module]


class First(nn.Module):
    """Apply ``module`` to the first tensor of a carried tuple; pass the rest through."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (self.module(state[0]), *state[1:])


class StartWithSize(nn.Module):
    """Run the first block and carry the input's spatial size for the final upsample.

    The size rides in a zero-element uint8 tensor of shape (N, 0, H, W): its shape is the
    information, it costs no bytes, it splits into micro-batches along dim 0, and, not being
    floating point, it never asks for a gradient (gloo sends zero-element tensors fine).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, _, h, w = x.shape
        return self.module(x), torch.empty((n, 0, h, w), dtype=torch.uint8, device=x.device)


class Upsample(nn.Module):
    """Bilinear upsampling of the logits to the input size carried since :class:`StartWithSize` (a segmentation
    model's last step)."""

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits, size = state
        return F.interpolate(logits, size=size.shape[-2:], mode="bilinear", align_corners=False)
