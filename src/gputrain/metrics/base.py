"""Exact distributed metrics: each rank accumulates sufficient statistics, then they are reduced.

Never average per-rank metric values: shards differ in size, so the mean of means is wrong.
Counts, sums and confusion matrices are summed with :func:`gputrain.dist.comm.all_reduce`; results
that need the whole set (COCO mAP) are gathered to rank 0 with :func:`gputrain.dist.comm.gather_objects`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from gputrain.dist import comm


class Evaluator(ABC):
    """Accumulates over one evaluation pass on one rank; :meth:`compute` reduces over ranks."""

    @abstractmethod
    def update(self, outputs: Any, targets: Any, loss: torch.Tensor | None, batch_size: int) -> None:
        """Add one batch. ``loss`` is the batch's mean loss, or None where the task has none in eval."""

    @abstractmethod
    def compute(self, device: torch.device, out_dir: Path | None = None) -> dict[str, float]:
        """Metrics over the whole evaluation set, identical on every rank (collective: call on all ranks)."""


class MeanLoss(Evaluator):
    """``loss``: the sample-weighted mean of batch losses over the whole set."""

    def __init__(self) -> None:
        self.loss_sum: torch.Tensor | None = None  # on the loss's device: no host sync per batch
        self.count = 0

    def update(self, outputs: Any, targets: Any, loss: torch.Tensor | None, batch_size: int) -> None:
        if loss is None:
            return
        weighted = loss.detach().double() * batch_size
        self.loss_sum = weighted if self.loss_sum is None else self.loss_sum + weighted
        self.count += batch_size

    def reduced(self, device: torch.device) -> torch.Tensor:
        """``[sum of loss * n, n]`` over all ranks (a rank with an empty shard sends zeros)."""
        total = self.loss_sum.to(device) if self.loss_sum is not None else \
            torch.zeros((), dtype=torch.float64, device=device)
        stats = torch.stack([total, torch.tensor(float(self.count), dtype=torch.float64, device=total.device)])
        return comm.all_reduce(stats).cpu()

    def compute(self, device: torch.device, out_dir: Path | None = None) -> dict[str, float]:
        total, n = self.reduced(device).tolist()
        return {"loss": total / n if n else float("nan"), "samples": n}
