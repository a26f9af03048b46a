"""Instance detection/segmentation from an image folder and a COCO ``instances`` JSON.

Parsing is ``pycocotools.coco.COCO`` and mask decoding ``pycocotools.mask`` (via ``COCO.annToMask``).
Degenerate annotations are handled as torchvision's detection references do: boxes are clipped to the
image, boxes left with no area are dropped, crowd regions are not training targets, and training images
with no box left are skipped; validation keeps every image, so its order and ids match the JSON that
pycocotools evaluates against. Every drop is counted in ``drop_summary`` and logged once.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors

from gputrain.data.images import DataError, PathLike, read_image_rgb, seeded_split, to_uint8, to_unit_float

logger = logging.getLogger(__name__)

DROP_REASONS = ("clipped", "zero_area", "crowd", "mask_from_box", "no_valid_box_images")
Target = dict[str, Any]
JointTransform = Callable[[Any, Any], tuple[Any, Any]]


def _rank() -> int:
    """This process's rank: the process group's if there is one, else the launcher's RANK (0 alone)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _pycocotools() -> tuple[Any, Any]:
    try:
        from pycocotools import mask as mask_utils
        from pycocotools.coco import COCO
    except ImportError as e:  # an optional extra: say how to get it
        raise ImportError("COCO data needs pycocotools; install it with: pip install 'gputrain[coco]'") from e
    return COCO, mask_utils


def load_coco(annotation_json: PathLike) -> Any:
    """``pycocotools.coco.COCO`` over ``annotation_json``, without its progress prints."""
    coco_cls, _ = _pycocotools()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return coco_cls(str(annotation_json))
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
        raise DataError(
            f"cannot load COCO annotations {annotation_json} ({type(e).__name__}: {e}); "
            "check the path and that it is a COCO instances JSON"
        ) from e


@dataclass(frozen=True)
class _Ann:
    id: int
    box: tuple[float, float, float, float]  # xyxy, already clipped
    label: int
    area: float
    ann: dict[str, Any] | None  # annotation with usable segmentation, or None: mask from the box


def check_target(
    target: Target, image: Tensor, image_file: PathLike, ann_ids: list[int], num_labels: int
) -> None:
    """Refuse a target a detection model must never see; the error names the image and annotation id."""
    boxes, labels, masks = target["boxes"], target["labels"], target["masks"]
    n = len(boxes)

    def who(i: int) -> str:  # a transform may have dropped boxes; then ids no longer line up
        return f"annotation id {ann_ids[i]}" if len(ann_ids) == n else f"box #{i}"

    if boxes.ndim != 2 or boxes.shape[1] != 4 or len(labels) != n or masks.shape[0] != n:
        raise DataError(
            f"image {image_file}: target has {n} boxes, {len(labels)} labels and {masks.shape[0]} masks; "
            "a transform must keep them aligned"
        )
    bad = ~torch.isfinite(boxes).all(dim=1) | (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])
    if bad.any():
        i = int(bad.nonzero()[0])
        raise DataError(
            f"image {image_file}: {who(i)} has box {boxes[i].tolist()} with no area (x2<=x1 or y2<=y1); "
            "fix the annotation, or drop such boxes in the transform (v2.SanitizeBoundingBoxes)"
        )
    out = (labels < 1) | (labels > num_labels)
    if out.any():
        i = int(out.nonzero()[0])
        raise DataError(f"image {image_file}: {who(i)} has label {int(labels[i])}, outside 1..{num_labels}")
    if n and masks.shape[1:] != image.shape[-2:]:
        raise DataError(
            f"image {image_file}: masks are {list(masks.shape[1:])}, the image {list(image.shape[-2:])}"
        )


class COCODetection(Dataset[tuple[Tensor, Target]]):
    """``(image float (3, H, W) in [0, 1], target)`` with target keys ``boxes`` (float N×4 xyxy), ``labels``
    (int64, 1..K), ``masks`` (uint8 N×H×W), ``image_id`` (int), ``area`` and ``iscrowd``. ``uint8`` hands over the
    image as ``uint8`` before the division by 255 (data.normalize_on_device: the training device divides).

    Category ids are mapped, in increasing order, to contiguous labels ``1..K`` (0 is background);
    ``label_to_category`` maps back for writing detections in COCO format. ``transforms``, if given, is
    applied jointly to the image and a target whose boxes/masks are torchvision ``tv_tensors``.
    """

    def __init__(
        self,
        image_dir: PathLike,
        annotation_json: PathLike,
        *,
        train: bool = True,
        transforms: JointTransform | None = None,
        uint8: bool = False,
    ) -> None:
        self.image_dir, self.annotation_json = Path(image_dir), Path(annotation_json)
        self.train, self.transforms, self.uint8 = train, transforms, uint8
        self.coco = load_coco(annotation_json)
        categories = sorted(self.coco.getCatIds())
        if not categories:
            raise DataError(f"{annotation_json} has no 'categories'; a COCO instances JSON lists them")
        self.category_to_label = {c: i + 1 for i, c in enumerate(categories)}
        self.label_to_category = {i: c for c, i in self.category_to_label.items()}
        self.class_names = ["background", *(str(self.coco.cats[c].get("name", c)) for c in categories)]
        self.drop_summary: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.items: list[tuple[int, list[_Ann]]] = []
        for image_id in sorted(self.coco.imgs):
            info = self.coco.imgs[image_id]
            cleaned = [self._clean(ann, info) for ann in self.coco.imgToAnns[image_id]]
            kept = [a for a in cleaned if a is not None]
            if train and not kept:  # nothing to learn from; torchvision and mmdet skip these too
                self.drop_summary["no_valid_box_images"] += 1
                continue
            self.items.append((image_id, kept))
        counts = ", ".join(f"{k}={v}" for k, v in self.drop_summary.items())
        log = logger.warning if any(self.drop_summary.values()) else logger.info
        split = "train" if train else "val"
        if _rank() == 0:  # every rank reads the same JSON; one line for the job, not one per rank
            log(
                "COCO %s (%s): kept %d images; adjusted/dropped: %s",
                annotation_json,
                split,
                len(self.items),
                counts,
            )

    def _clean(self, ann: dict[str, Any], info: dict[str, Any]) -> _Ann | None:
        where = f"annotation id {ann.get('id')} of image {self.image_dir / info['file_name']}"
        category = ann.get("category_id")
        if category not in self.category_to_label:
            raise DataError(
                f"{where} has category_id {category}, which is not in the 'categories' of "
                f"{self.annotation_json} (known: {sorted(self.category_to_label)}); add the category or "
                "remove the annotation"
            )
        if ann.get("iscrowd", 0):
            self.drop_summary["crowd"] += 1
            return None
        bbox: Any = ann.get("bbox")
        numeric = isinstance(bbox, list) and all(
            isinstance(v, int | float) and math.isfinite(v) for v in bbox
        )
        if not numeric or len(bbox) != 4:
            raise DataError(
                f"{where} has bbox {bbox!r}; a COCO bbox is [x, y, width, height]; fix or remove it"
            )
        x, y, w, h = (float(v) for v in bbox)
        width, height = float(info["width"]), float(info["height"])
        x1, x2 = min(max(x, 0.0), width), min(max(x + w, 0.0), width)
        y1, y2 = min(max(y, 0.0), height), min(max(y + h, 0.0), height)
        box = (x1, y1, x2, y2)
        if x2 <= x1 or y2 <= y1:
            self.drop_summary["zero_area"] += 1
            return None
        if box != (x, y, x + w, y + h):
            self.drop_summary["clipped"] += 1
        seg: Any = ann.get("segmentation")
        if isinstance(seg, list):  # polygons with under 3 points cannot be rasterized (mmdet drops them too)
            seg = [p for p in seg if isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0]
        elif isinstance(seg, dict) and list(seg.get("size", [])) != [info["height"], info["width"]]:
            raise DataError(
                f"{where} has an RLE of size {seg.get('size')} but the image is "
                f"{[info['height'], info['width']]} (HxW); fix the annotation's size or the image entry"
            )
        usable = bool(seg) and (isinstance(seg, list) or "counts" in seg)
        if not usable:
            self.drop_summary["mask_from_box"] += 1
        label, area = self.category_to_label[category], float(ann.get("area", w * h))
        return _Ann(int(ann["id"]), box, label, area, {**ann, "segmentation": seg} if usable else None)

    def __len__(self) -> int:
        return len(self.items)

    def _mask(self, a: _Ann, height: int, width: int) -> np.ndarray:
        if a.ann is not None:
            return self.coco.annToMask(a.ann).astype(np.uint8)  # polygons and (un)compressed RLE alike
        m = np.zeros((height, width), np.uint8)
        x1, y1, x2, y2 = a.box
        m[int(y1) : math.ceil(y2), int(x1) : math.ceil(x2)] = 1
        return m

    def __getitem__(self, index: int) -> tuple[Tensor, Target]:
        image_id, anns = self.items[index]
        info = self.coco.imgs[image_id]
        path = self.image_dir / info["file_name"]
        raw = read_image_rgb(path)
        height, width = int(raw.shape[1]), int(raw.shape[2])
        if (height, width) != (info["height"], info["width"]):
            raise DataError(
                f"image {path} is {width}x{height} but {self.annotation_json} says {info['width']}x{info['height']} "
                f"for image id {image_id}; fix width/height there or re-export the image"
            )
        masks = np.zeros((0, height, width), np.uint8)
        if anns:
            masks = np.stack([self._mask(a, height, width) for a in anns])
        image = to_uint8(raw) if self.uint8 else to_unit_float(raw)
        target: Target = {
            "boxes": torch.tensor([a.box for a in anns], dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor([a.label for a in anns], dtype=torch.int64),
            "masks": torch.from_numpy(masks),
            "image_id": int(image_id),
            "area": torch.tensor([a.area for a in anns], dtype=torch.float32),
            "iscrowd": torch.zeros(len(anns), dtype=torch.int64),
        }
        if self.transforms is not None:
            boxes = target["boxes"]  # as tv_tensors, so v2 transforms move boxes and masks with the image
            target["boxes"] = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(height, width))
            target["masks"] = tv_tensors.Mask(target["masks"])
            image, target = self.transforms(tv_tensors.Image(image), target)
            image = image.as_subclass(Tensor)
            target = {k: v.as_subclass(Tensor) if isinstance(v, Tensor) else v for k, v in target.items()}
        check_target(target, image, path, [a.id for a in anns], len(self.label_to_category))
        return image, target


def detection_collate(batch: list[tuple[Tensor, Target]]) -> tuple[list[Tensor], list[Target]]:
    """Keep images and targets as lists: detection images differ in size and targets in box count."""
    return [image for image, _ in batch], [target for _, target in batch]


def split_coco(
    annotation_json: PathLike, val_fraction: float = 0.2, seed: int = 0, out_dir: PathLike | None = None
) -> tuple[Path, Path]:
    """Split one COCO JSON by image into ``<stem>_train.json`` and ``<stem>_val.json`` (in ``out_dir``,
    default: beside the input). Images sorted by id are split by :func:`seeded_split`, so the same
    file, fraction and seed always give the same, disjoint split; each annotation follows its image."""
    src = Path(annotation_json)
    try:
        data = json.loads(src.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read COCO annotations {src} ({e}); check the path") from e
    images = sorted(data.get("images", []), key=lambda im: im["id"])
    if len({im["id"] for im in images}) != len(images):
        raise DataError(f"{src} has duplicate image ids; each entry of 'images' needs its own id")
    train_idx, val_idx = seeded_split(len(images), val_fraction, seed)
    out = Path(out_dir) if out_dir is not None else src.parent
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, idx in (("train", train_idx), ("val", val_idx)):
        ids = {images[i]["id"] for i in idx}
        anns = [a for a in data.get("annotations", []) if a["image_id"] in ids]
        paths.append(out / f"{src.stem}_{name}.json")
        paths[-1].write_text(json.dumps({**data, "images": [images[i] for i in idx], "annotations": anns}))
    return paths[0], paths[1]
