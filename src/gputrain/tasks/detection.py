"""Instance segmentation with torchvision's Mask R-CNN on COCO-style data; COCO box and mask mAP."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gputrain.config import RunConfig
from gputrain.data.coco import COCODetection, detection_collate, load_coco, split_coco
from gputrain.data.device_normalize import PixelCollate, normalize_on_device
from gputrain.data.images import to_unit_float
from gputrain.metrics.base import Evaluator
from gputrain.metrics.detection import CocoEvaluator
from gputrain.models import build_configured_model
from gputrain.models.zoo import detects_masks
from gputrain.tasks.base import Task
from gputrain.tasks.draw import SCORE_THRESHOLD, draw_detections, write_pictures
from gputrain.tasks.spec import TaskSpec


class DetectionTask(Task):
    """The model takes targets in training and returns its losses; in eval it returns detections."""

    targets_to_model = True
    fixed_shapes = False

    def __init__(self, val_annotations: Path, label_to_category: dict[int, int], *,
                 class_names: list[str] | None = None, image_ids: dict[str, int] | None = None,
                 masks: bool = True) -> None:
        super().__init__()
        self.val_annotations, self.label_to_category = val_annotations, label_to_category
        self.masks = masks
        """Whether the model predicts masks (Mask R-CNN) or boxes alone: box mAP, and mask mAP with masks."""
        self.class_names = class_names
        """By model label: ``background`` then the categories in increasing id order."""
        self.image_ids = image_ids or {}
        """``file_name`` -> image id of the annotation file (``gputrain predict`` writes these ids)."""

    def prediction(self, output: Any, size: tuple[int, int]) -> dict[str, torch.Tensor]:
        """The detections on the CPU, masks as booleans (what COCO results and overlays threshold at 0.5)."""
        kept = {k: v.detach().cpu() for k, v in output.items() if k != "masks"}
        if "masks" in output:
            kept["masks"] = output["masks"].detach().cpu() > 0.5
        return kept

    def draw(self, image: torch.Tensor, output: Any, target: Any = None) -> tuple[torch.Tensor, str]:
        found = int((output["scores"] >= SCORE_THRESHOLD).sum())
        caption = f"{found} found" + (f" of {len(target['labels'])}" if target is not None else "")
        return draw_detections(image, output, self.class_names), caption

    def write_predictions(self, inputs: Sequence[Any], results: Sequence[Any], out: Path) -> str:
        """``predictions.json`` in COCO results format (the annotation file's image ids where the image is in it)
        and ``overlays/<stem>.jpg``."""
        from gputrain.metrics.detection import detections_to_coco

        by_name: dict[str, list[int]] = {}
        for file_name, image_id in self.image_ids.items():
            by_name.setdefault(Path(file_name).name, []).append(image_id)
        next_id = max(self.image_ids.values(), default=0) + 1
        entries: list[tuple[int, list[dict[str, Any]]]] = []
        for item, r in zip(inputs, results, strict=True):
            ids = by_name.get(item.path.name, [])
            if len(ids) == 1:
                image_id = ids[0]
            else:  # not in the annotation file (or ambiguous): a new id past the file's
                image_id, next_id = next_id, next_id + 1
            output = {**r, "masks": r["masks"].float()} if "masks" in r else r
            entries.append((image_id, detections_to_coco(output, image_id, self.label_to_category,
                                                         with_masks="masks" in r)))
        # Sorted by image id, each image's detections in model order: the list gputrain eval scores.
        detections = [d for _, ds in sorted(entries, key=lambda e: e[0]) for d in ds]
        (out / "predictions.json").write_text(json.dumps(detections))
        write_pictures(self, inputs, results, out, "overlays", ".jpg")
        return f"{out / 'predictions.json'} and {out / 'overlays'}"

    def collate_fn(self):  # noqa: ANN201
        return self.train_collate or detection_collate

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
        return CocoEvaluator(self.val_annotations, iou_types=("bbox", "segm") if self.masks else ("bbox",),
                             label_to_category=self.label_to_category)


def _annotation_files(cfg: RunConfig) -> tuple[Path, Path, Path, Path]:
    """(train images, train json, val images, val json); one annotated folder is split 8:2 by image."""
    root = Path(cfg.data.root)
    annotations = Path(cfg.data.annotations) if cfg.data.annotations else root / "annotations" / "instances.json"
    if cfg.data.val_root:
        val_root = Path(cfg.data.val_root)
        return root / "images", annotations, val_root / "images", val_root / "annotations" / "instances.json"
    shared = bool(cfg.trainer.out) and dist.is_initialized()
    if cfg.trainer.out:
        split_dir = Path(cfg.trainer.out) / "splits"  # kept with the run, so its split can be read later
    else:
        # No run folder yet (the Python API, before a Trainer picks one): never the working directory. Each
        # process writes its own copy (the split is a function of the file, fraction and seed), removed at exit.
        split_dir = Path(tempfile.mkdtemp(prefix="gputrain-coco-splits-"))
        atexit.register(shutil.rmtree, split_dir, True)
    if not shared or dist.get_rank() == 0:  # one writer; the others wait at the barrier and read the same files
        split_coco(annotations, val_fraction=cfg.data.val_fraction, seed=cfg.data.split_seed, out_dir=split_dir)
    if shared:
        dist.barrier()
    return root / "images", split_dir / f"{annotations.stem}_train.json", root / "images", \
        split_dir / f"{annotations.stem}_val.json"


def annotation_file(cfg: RunConfig, given: str = "") -> Path:
    """The COCO file whose ids and categories predictions use: ``given``, ``data.annotations`` or the default."""
    return Path(given or cfg.data.annotations or Path(cfg.data.root) / "annotations" / "instances.json")


def for_prediction(cfg: RunConfig, *, annotations: str = "") -> tuple[Task, Callable[[torch.Tensor], Any]]:
    """The task ``gputrain predict`` uses, with the annotation file's categories and image ids when it exists.

    Without one (the data set is not on this machine), labels are written as category ids and images
    are numbered from 1; an ``--annotations`` file that is missing is an error.
    """
    path = annotation_file(cfg, annotations)
    if annotations and not path.is_file():
        raise FileNotFoundError(f"--annotations {path} does not exist; give the COCO json of the images' data set")
    num_labels = int(cfg.model.kwargs.get("num_classes") or cfg.data.num_classes or 2) - 1
    label_to_category, names, ids = {k: k for k in range(1, num_labels + 1)}, None, {}
    if path.is_file():
        coco = load_coco(path)
        categories = sorted(coco.getCatIds())
        label_to_category = {i + 1: c for i, c in enumerate(categories)}
        names = ["background", *(str(coco.cats[c].get("name", c)) for c in categories)]
        ids = {str(im["file_name"]): int(im["id"]) for im in coco.imgs.values()}
    task = DetectionTask(path, label_to_category, class_names=names, image_ids=ids, masks=detects_masks(cfg.model.name))
    return task, eval_preprocess


def eval_preprocess(image: torch.Tensor) -> torch.Tensor:
    """A ``uint8`` image as :class:`~gputrain.data.coco.COCODetection` hands it to the model: floats in [0, 1].

    Resizing and normalization are the model's own (torchvision's ``GeneralizedRCNNTransform``).
    """
    return to_unit_float(image)


def build(cfg: RunConfig) -> TaskSpec:
    train_images, train_json, val_images, val_json = _annotation_files(cfg)
    on_device = normalize_on_device(cfg)  # uint8 images; the device divides by 255, the model normalizes
    train = COCODetection(train_images, train_json, train=True, uint8=on_device)
    val = COCODetection(val_images, val_json, train=False)
    if train.label_to_category != val.label_to_category:
        raise ValueError(f"{train_json} and {val_json} list different categories; use one category list for both")
    num_classes = len(train.label_to_category) + 1  # + background
    if cfg.data.num_classes and cfg.data.num_classes != num_classes:
        raise ValueError(f"data.num_classes={cfg.data.num_classes} but {train_json} has {num_classes - 1} categories "
                         f"(+1 background = {num_classes}); set data.num_classes={num_classes} or 0")
    model = build_configured_model(cfg.model, "maskrcnn_resnet50_fpn", kind="detection", num_classes=num_classes)
    task = DetectionTask(val_json, train.label_to_category, class_names=train.class_names,
                         masks=detects_masks(cfg.model.name))
    if on_device:
        task.train_collate = PixelCollate(collate=detection_collate)
    return TaskSpec(task=task, model=model, train_data=train, val_data=val)
