"""Exact distributed classification metrics: top-1/top-5 accuracy from all-reduced counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gputrain.dist import comm
from gputrain.metrics.base import Evaluator, MeanLoss


class ClassificationEvaluator(Evaluator):
    """``loss``, ``accuracy``, ``top5`` (when ``num_classes >= 5``) and ``samples`` over the whole set.

    Each rank counts correct predictions and samples as int64; :meth:`compute` sums the
    counts over ranks and divides once, so the result does not depend on how the set was
    sharded (a mean of per-rank accuracies would).
    """

    def __init__(self, num_classes: int) -> None:
        if num_classes < 2:
            raise ValueError(f"ClassificationEvaluator(num_classes={num_classes}): need at least 2 classes")
        self.num_classes = num_classes
        self.topk = (1, 5) if num_classes >= 5 else (1,)
        self.loss = MeanLoss()
        # [correct@1, correct@5 (if any), samples]; created on the outputs' device on first
        # update, so accumulating never forces a device-to-host copy per batch.
        self.counts: torch.Tensor | None = None

    def update(self, outputs: Any, targets: Any, loss: torch.Tensor | None, batch_size: int) -> None:
        """Add one batch of logits ``(N, num_classes)`` and integer labels ``(N,)``."""
        logits = outputs
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] != self.num_classes:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(
                f"ClassificationEvaluator expects outputs of shape (N, {self.num_classes}), got {shape}; "
                "check num_classes matches the model's last layer"
            )
        targets = targets.to(logits.device)
        if targets.shape != logits.shape[:1]:
            raise ValueError(
                f"targets shape {tuple(targets.shape)} does not match outputs' batch {logits.shape[0]}"
            )
        top = logits.topk(max(self.topk), dim=1).indices  # (N, k)
        hits = top.eq(targets.unsqueeze(1))
        batch = torch.stack(
            [hits[:, :k].any(dim=1).sum() for k in self.topk]
            + [torch.tensor(len(targets), device=logits.device)]
        ).to(torch.int64)
        self.counts = batch if self.counts is None else self.counts + batch
        self.loss.update(outputs, targets, loss, batch_size)

    def compute(self, device: torch.device, out_dir: Path | None = None) -> dict[str, float]:
        """All-reduce the counts and return the metrics (collective: call on every rank)."""
        local = self.counts if self.counts is not None else torch.zeros(len(self.topk) + 1, dtype=torch.int64)
        # A rank with an empty shard still joins the collective with zeros.
        counts = comm.all_reduce(local.to(device).clone()).cpu().tolist()
        *correct, total = counts
        metrics = self.loss.compute(device, out_dir)
        metrics["samples"] = float(total)
        for k, c in zip(self.topk, correct, strict=True):
            metrics["accuracy" if k == 1 else f"top{k}"] = c / total if total else float("nan")
        return metrics
