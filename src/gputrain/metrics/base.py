"""Exact distributed metrics: each rank accumulates sufficient statistics, then they are reduced.

Never average per-rank metric values: shards differ in size, so the mean of means is wrong.
Counts, sums and confusion matrices are summed with ``strategy.all_reduce``; results that
need the whole set (COCO mAP) are gathered to rank 0 with ``strategy.gather_objects``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gputrain.strategies.base import Strategy


class Evaluator(ABC):
    """Accumulates over one evaluation pass on one rank; :meth:`compute` reduces over ranks."""

    @abstractmethod
    def update(self, outputs: Any, targets: Any, loss: torch.Tensor | None, batch_size: int) -> None:
        """Add one batch. ``loss`` is the batch's mean loss, or None where the task has none in eval."""

    @abstractmethod
    def compute(self, strategy: Strategy, out_dir: Path | None = None) -> dict[str, float]:
        """Metrics over the whole evaluation set, identical on every rank (collective: call on all ranks)."""


class MeanLoss(Evaluator):
    """``loss``: the sample-weighted mean of batch losses over the whole set."""

    def __init__(self) -> None:
        self.stats = torch.zeros(2, dtype=torch.float64)  # [sum of loss * n, n]

    def update(self, outputs: Any, targets: Any, loss: torch.Tensor | None, batch_size: int) -> None:
        if loss is not None:
            self.stats[0] += float(loss) * batch_size
            self.stats[1] += batch_size

    def reduced(self, strategy: Strategy) -> torch.Tensor:
        stats = self.stats.to(strategy.root_device)
        return strategy.all_reduce(stats).cpu()

    def compute(self, strategy: Strategy, out_dir: Path | None = None) -> dict[str, float]:
        total, n = self.reduced(strategy).tolist()
        return {"loss": total / n if n else float("nan"), "samples": n}
