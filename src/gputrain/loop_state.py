"""State the loop carries: where the run is, the running training loss, and seeding."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch


@dataclasses.dataclass
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


def seed_everything(seed: int) -> None:
    """Seed torch and Python; data order does not depend on these (the samplers own it)."""
    torch.manual_seed(seed)
    random.seed(seed)


class LossWindow:
    """Sample-weighted training loss: a device-side sum since the last flush, and host totals for the epoch."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=strategy.root_device)
        self.samples = 0
        self.epoch_loss_sum = 0.0
        self.epoch_samples = 0.0

    def add(self, loss: torch.Tensor | None, n: int) -> None:
        """Add a micro-batch's mean loss over ``n`` samples; None (no loss on this rank) adds nothing."""
        if loss is None:
            return
        self.loss_sum.add_(loss.detach().float().to(self.loss_sum.device), alpha=n)
        self.samples += n

    def flush(self) -> float:
        """All-reduce the window (a collective: every rank calls it at the same step); returns its mean loss."""
        both = torch.stack([self.loss_sum.double(), torch.tensor(float(self.samples), dtype=torch.float64,
                                                                 device=self.loss_sum.device)])
        total, n = self.strategy.all_reduce(both).tolist()
        self.epoch_loss_sum += total
        self.epoch_samples += n
        self.loss_sum.zero_()
        self.samples = 0
        return total / n if n else float("nan")
