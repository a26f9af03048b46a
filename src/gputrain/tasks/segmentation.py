"""Semantic segmentation: per-pixel cross-entropy with an ignore index, mIoU from an all-reduced confusion matrix."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torchcodec.encoders import PngEncoder
from torchvision import tv_tensors

from gputrain.config import RunConfig
from gputrain.data.ade20k import ADE20K, IGNORE_INDEX, segmentation_transform
from gputrain.data.device_normalize import PixelCollate, normalize_on_device
from gputrain.data.images import IMAGENET_MEAN, IMAGENET_STD
from gputrain.metrics.base import Evaluator
from gputrain.metrics.segmentation import SegmentationEvaluator
from gputrain.models import build_configured_model
from gputrain.tasks.base import Task
from gputrain.tasks.draw import denormalize, overlay_labels, side_by_side, write_pictures
from gputrain.tasks.spec import TaskSpec

AUX_WEIGHT = 0.5
"""The auxiliary head's share of the loss, as torchvision's segmentation reference trains it."""


class SegmentationTask(Task):
    def __init__(self, num_classes: int, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The mean over images of each image's mean over its counted (not ignored) pixels, not one mean over the
        # batch's counted pixels. Why: the strategies give the same gradient at every world size and accumulation
        # only for a mean over samples of a per-sample loss; one pixel mean weighs a rank's images by how many of
        # their pixels count, so 2 ranks would not match 1 process. And an image with no counted pixel adds zero
        # instead of 0/0 = NaN, which ended runs whose small per-GPU batches held only such crops.
        # torchvision's models with an auxiliary head ({"out", "aux"}) add its loss at weight 0.5, as its reference.
        loss = self._per_image(_logits(outputs), targets)
        if isinstance(outputs, dict) and "aux" in outputs:
            loss = loss + AUX_WEIGHT * self._per_image(outputs["aux"], targets)
        return loss

    def _per_image(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_pixel = F.cross_entropy(logits.float(), targets, ignore_index=self.ignore_index, reduction="none")
        counted = (targets != self.ignore_index).flatten(1).sum(1)
        return (per_pixel.flatten(1).sum(1) / counted.clamp(min=1)).mean()

    def evaluate_batch(self, model: torch.nn.Module, inputs: Any, targets: Any) -> tuple[Any, torch.Tensor | None]:
        """Eval-mode outputs and the mean loss over the batch's counted pixels (0 where none counts).

        The evaluator weighs it by that count, so the set's loss is a mean over all its counted pixels,
        whatever the batches and ranks.
        """
        outputs = model(inputs)
        total = F.cross_entropy(_logits(outputs).float(), targets, ignore_index=self.ignore_index, reduction="sum")
        return outputs, total / (targets != self.ignore_index).sum().clamp(min=1)

    def evaluator(self) -> Evaluator:
        return SegmentationEvaluator(self.num_classes, ignore_index=self.ignore_index)

    def display(self, inputs: torch.Tensor) -> torch.Tensor:
        return denormalize(inputs, IMAGENET_MEAN, IMAGENET_STD)

    def prediction(self, output: Any, size: tuple[int, int]) -> torch.Tensor:
        """Classes per pixel ``(H, W)`` at the image's size: logits are resized bilinearly first where they differ."""
        logits = _logits(output).detach().float()
        if tuple(logits.shape[-2:]) != tuple(size):
            logits = F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)[0]
        return logits.argmax(0).to(torch.uint8).cpu()

    def draw(self, image: torch.Tensor, output: Any, target: Any = None) -> tuple[torch.Tensor, str]:
        """The predicted classes over the image; with a target, the true classes to its left."""
        labels = output if isinstance(output, torch.Tensor) and output.dim() == 2 else self.prediction(output, (int(image.shape[-2]), int(image.shape[-1])))
        predicted = overlay_labels(image, labels.long(), self.num_classes)
        if target is None:
            return predicted, "prediction"
        return side_by_side(overlay_labels(image, target.cpu(), self.num_classes), predicted), "truth | prediction"

    def write_predictions(self, inputs: Sequence[Any], results: Sequence[Any], out: Path) -> str:
        """``masks/<stem>.png`` in ADE20K's encoding (class ``k`` stored as ``k + 1``, 0 unlabeled) at the image's
        size, and ``overlays/<stem>.jpg``."""
        (out / "masks").mkdir(exist_ok=True)
        for item, labels in zip(inputs, results, strict=True):
            # ADE20K's encoding: stored value k + 1 for class k (0 is "other", never predicted).
            PngEncoder((labels.to(torch.int16) + 1).to(torch.uint8)[None]).to_file(out / "masks" / f"{item.stem}.png")
        write_pictures(self, inputs, results, out, "overlays", ".jpg")
        return f"{out / 'masks'} and {out / 'overlays'}"


def _logits(outputs: Any) -> torch.Tensor:
    """The logits of a model's output: torchvision's segmentation models return ``{"out": ...}``."""
    return outputs["out"] if isinstance(outputs, dict) else outputs


def eval_preprocess(cfg: RunConfig, *, whole_image: bool = False) -> Callable[..., Any]:
    """Evaluation preprocessing, applied jointly to ``(Image, Mask)`` or to an ``Image`` alone.

    ``whole_image`` (``gputrain predict``) keeps the image's shape: no centre crop, which would cut
    the picture to be labelled; with ``data.image_size=0`` (exact full-resolution evaluation) the two agree.
    """
    return segmentation_transform(None if whole_image else (cfg.data.image_size or None), train=False)


def for_prediction(cfg: RunConfig, *, annotations: str = "") -> tuple[Task, Callable[[torch.Tensor], Any]]:
    """The task and input preprocessing ``gputrain predict`` uses: those of evaluation, without the data set."""
    transform = eval_preprocess(cfg, whole_image=True)
    task = SegmentationTask(int(cfg.model.kwargs.get("num_classes") or cfg.data.num_classes or 150))
    return task, lambda image: transform(tv_tensors.Image(image)).as_subclass(torch.Tensor)


def build(cfg: RunConfig) -> TaskSpec:
    num_classes = cfg.data.num_classes or 150
    crop = cfg.data.image_size or None
    on_device = normalize_on_device(cfg)  # the workers stop before float conversion; masks are as before
    train = ADE20K(cfg.data.root, split="training", num_classes=num_classes,
                   transform=segmentation_transform(crop, train=cfg.data.augment, normalize=not on_device))
    val = ADE20K(cfg.data.val_root or cfg.data.root, split="validation", num_classes=num_classes,
                 transform=eval_preprocess(cfg))
    model = build_configured_model(cfg.model, "deeplabv3plus", kind="segmentation", num_classes=num_classes)
    task = SegmentationTask(num_classes)
    if on_device:
        task.train_collate = PixelCollate(IMAGENET_MEAN, IMAGENET_STD)
    return TaskSpec(task=task, model=model, train_data=train, val_data=val, example_input=val[0][0].unsqueeze(0))
