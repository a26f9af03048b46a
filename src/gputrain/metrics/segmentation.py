"""Exact distributed semantic-segmentation metrics from an all-reduced confusion matrix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gputrain.dist import comm
from gputrain.metrics.base import Evaluator, MeanLoss


def miou_from_confusion(cm: torch.Tensor) -> tuple[float, list[float]]:
    """Mean IoU and per-class IoU of a confusion matrix ``cm[true, predicted]``.

    IoU of class c is ``cm[c, c] / (row_c + col_c - cm[c, c])``. The mean is over the
    classes whose union is non-zero, i.e. present in the ground truth or predicted at
    least once: a class that never occurs and is never predicted has no defined IoU, and
    counting it as 0 (or 1) would move the mean by something the model did not do. Such
    classes get ``nan`` in the per-class list. With no class present the mean is ``nan``.
    """
    if cm.dim() != 2 or cm.shape[0] != cm.shape[1]:
        raise ValueError(f"confusion matrix must be square (C, C), got shape {tuple(cm.shape)}")
    cm = cm.to(torch.float64)
    tp = cm.diagonal()
    union = cm.sum(0) + cm.sum(1) - tp
    present = union > 0
    iou = torch.where(present, tp / union.clamp(min=1), torch.full_like(tp, float("nan")))
    miou = float(iou[present].mean()) if bool(present.any()) else float("nan")
    return miou, iou.tolist()


class SegmentationEvaluator(Evaluator):
    """``mIoU``, ``pixel_acc``, ``loss``, ``pixels`` and ``samples`` (images) over the whole set.

    Each rank accumulates an int64 confusion matrix with ``torch.bincount``; :meth:`compute`
    all-reduces it, so results equal a single process's exactly, whatever the sharding.
    Pixels labelled ``ignore_index`` are skipped.
    """

    def __init__(self, num_classes: int, ignore_index: int = 255) -> None:
        if num_classes < 1:
            raise ValueError(f"SegmentationEvaluator(num_classes={num_classes}): need at least 1 class")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.loss = MeanLoss()
        self.confusion: torch.Tensor | None = None  # lives on the outputs' device until compute
        self.images = 0
        self.global_confusion: torch.Tensor | None = None
        """The all-reduced matrix ``[true, predicted]`` after :meth:`compute` (for per-class reports)."""

    def update(self, outputs: Any, targets: Any, loss: torch.Tensor | None, batch_size: int) -> None:
        """Add logits ``(N, C, H, W)`` (or a dict with ``"out"``, as torchvision models return) or
        predicted labels ``(N, H, W)``, against integer targets ``(N, H, W)``."""
        if isinstance(outputs, dict):
            outputs = outputs["out"]
        if outputs.dim() == 4:
            if outputs.shape[1] != self.num_classes:
                raise ValueError(
                    f"outputs have {outputs.shape[1]} channels but num_classes={self.num_classes}; "
                    "set num_classes to the model's number of output classes"
                )
            preds = outputs.argmax(dim=1)
        else:
            preds = outputs
        targets = targets.to(preds.device)
        if preds.shape != targets.shape:
            raise ValueError(
                f"predictions {tuple(preds.shape)} and targets {tuple(targets.shape)} differ in shape; "
                "upsample the logits to the label size before evaluating"
            )
        keep = targets != self.ignore_index
        t = targets[keep].to(torch.int64)
        p = preds[keep].to(torch.int64)
        n = self.num_classes
        if t.numel() and int(t.min()) < 0:
            raise ValueError(
                f"target label {int(t.min())} is negative; use ignore_index={self.ignore_index} for void"
            )
        counts = torch.bincount(t * n + p, minlength=n * n)
        if counts.numel() != n * n:
            raise ValueError(
                f"a target label is >= num_classes={n} (max {int(t.max())}) and is not ignore_index="
                f"{self.ignore_index}; fix num_classes or the label map"
            )
        cm = counts.reshape(n, n)
        self.confusion = cm if self.confusion is None else self.confusion + cm
        self.images += len(targets)
        # The batch loss is a mean over its non-ignored pixels; weighting it by that count makes the
        # set's loss independent of how images fall into batches and ranks.
        self.loss.update(outputs, targets, loss, int(keep.sum()))

    def compute(self, device: torch.device, out_dir: Path | None = None) -> dict[str, float]:
        """All-reduce the confusion matrix and derive the metrics (collective: call on every rank)."""
        n = self.num_classes
        cm = self.confusion.cpu() if self.confusion is not None else torch.zeros(n, n, dtype=torch.int64)
        # One collective for the matrix and the image count; a rank with an empty shard sends zeros.
        packed = torch.cat([cm.flatten(), torch.tensor([self.images], dtype=torch.int64)])
        packed = comm.all_reduce(packed.to(device)).cpu()
        cm, images = packed[:-1].reshape(n, n), int(packed[-1])
        self.global_confusion = cm
        miou, _ = miou_from_confusion(cm)
        total = int(cm.sum())
        metrics = self.loss.compute(device, out_dir)
        metrics.update(
            {
                "mIoU": miou,
                "pixel_acc": float(cm.diagonal().sum()) / total if total else float("nan"),
                "pixels": float(total),
                "samples": float(images),
            }
        )
        return metrics
