"""Semantic segmentation: per-pixel cross-entropy with an ignore index, mIoU from an all-reduced confusion matrix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gputrain.config import RunConfig
from gputrain.data.ade20k import ADE20K, IGNORE_INDEX, segmentation_transform
from gputrain.metrics.base import Evaluator
from gputrain.metrics.segmentation import SegmentationEvaluator
from gputrain.models import build_configured_model
from gputrain.tasks.base import Task
from gputrain.tasks.spec import TaskSpec


class SegmentationTask(Task):
    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, dict):  # torchvision's segmentation models return {"out": ...}
            outputs = outputs["out"]
        return F.cross_entropy(outputs.float(), targets, ignore_index=self.ignore_index)

    def evaluator(self) -> Evaluator:
        return SegmentationEvaluator(self.num_classes, ignore_index=self.ignore_index)


def build(cfg: RunConfig) -> TaskSpec:
    num_classes = cfg.data.num_classes or 150
    crop = cfg.data.image_size or None
    train = ADE20K(cfg.data.root, split="training", num_classes=num_classes,
                   transform=segmentation_transform(crop, train=cfg.data.augment))
    val = ADE20K(cfg.data.val_root or cfg.data.root, split="validation", num_classes=num_classes,
                 transform=segmentation_transform(crop, train=False))
    model = build_configured_model(cfg.model, "deeplabv3plus", num_classes=num_classes)
    return TaskSpec(task=SegmentationTask(num_classes), model=model, train_data=train, val_data=val,
                    example_input=val[0][0].unsqueeze(0))
