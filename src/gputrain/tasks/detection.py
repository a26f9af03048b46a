"""Instance segmentation with torchvision's Mask R-CNN on COCO-style data; COCO box and mask mAP."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gputrain.config import RunConfig
from gputrain.data.coco import COCODetection, detection_collate, split_coco
from gputrain.metrics.base import Evaluator
from gputrain.metrics.detection import CocoEvaluator
from gputrain.models import build_configured_model
from gputrain.tasks.base import Task
from gputrain.tasks.spec import TaskSpec


class DetectionTask(Task):
    """The model takes targets in training and returns its losses; in eval it returns detections."""

    targets_to_model = True

    def __init__(self, val_annotations: Path, label_to_category: dict[int, int]) -> None:
        super().__init__()
        self.val_annotations, self.label_to_category = val_annotations, label_to_category

    def collate_fn(self):  # noqa: ANN201
        return detection_collate

    def split_batch(self, batch: Any) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        return batch

    def forward(self, model: nn.Module, inputs: Any, targets: Any) -> dict[str, torch.Tensor]:
        return model(inputs, targets)

    def loss(self, outputs: dict[str, torch.Tensor], targets: Any) -> torch.Tensor:
        # sum() starts from the int 0; Mask R-CNN always returns losses, so the result is a tensor.
        return cast(torch.Tensor, sum(outputs.values()))

    def evaluate_batch(self, model: nn.Module, inputs: Any, targets: Any) -> tuple[Any, None]:
        return model(inputs), None

    def evaluator(self) -> Evaluator:
        return CocoEvaluator(self.val_annotations, iou_types=("bbox", "segm"), label_to_category=self.label_to_category)


def _annotation_files(cfg: RunConfig) -> tuple[Path, Path, Path, Path]:
    """(train images, train json, val images, val json); one annotated folder is split 8:2 by image."""
    root = Path(cfg.data.root)
    annotations = Path(cfg.data.annotations) if cfg.data.annotations else root / "annotations" / "instances.json"
    if cfg.data.val_root:
        val_root = Path(cfg.data.val_root)
        return root / "images", annotations, val_root / "images", val_root / "annotations" / "instances.json"
    split_dir = Path(cfg.trainer.out) / "splits"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:  # one writer; the others wait at the barrier and read the same files
        split_coco(annotations, val_fraction=cfg.data.val_fraction, seed=cfg.data.split_seed, out_dir=split_dir)
    if dist.is_initialized():
        dist.barrier()
    return root / "images", split_dir / f"{annotations.stem}_train.json", root / "images", \
        split_dir / f"{annotations.stem}_val.json"


def build(cfg: RunConfig) -> TaskSpec:
    train_images, train_json, val_images, val_json = _annotation_files(cfg)
    train = COCODetection(train_images, train_json, train=True)
    val = COCODetection(val_images, val_json, train=False)
    if train.label_to_category != val.label_to_category:
        raise ValueError(f"{train_json} and {val_json} list different categories; use one category list for both")
    num_classes = len(train.label_to_category) + 1  # + background
    if cfg.data.num_classes and cfg.data.num_classes != num_classes:
        raise ValueError(f"data.num_classes={cfg.data.num_classes} but {train_json} has {num_classes - 1} categories "
                         f"(+1 background = {num_classes}); set data.num_classes={num_classes} or 0")
    model = build_configured_model(cfg.model, "maskrcnn_resnet50_fpn", num_classes=num_classes)
    return TaskSpec(task=DetectionTask(val_json, train.label_to_category), model=model, train_data=train,
                    val_data=val)
