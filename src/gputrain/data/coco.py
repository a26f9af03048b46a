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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.io import write_jpeg

from gputrain.data.images import (
    DataError,
    PathLike,
    class_colour,
    noisy_background,
    paint,
    read_image_rgb,
    seeded_split,
)

logger = logging.getLogger(__name__)

DROP_REASONS = ("clipped", "zero_area", "crowd", "mask_from_box", "no_valid_box_images")
Target = dict[str, Any]
JointTransform = Callable[[Any, Any], tuple[Any, Any]]


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
    if n and tuple(masks.shape[1:]) != tuple(image.shape[-2:]):
        raise DataError(
            f"image {image_file}: masks are {tuple(masks.shape[1:])} but the image is {tuple(image.shape[-2:])}"
        )


class COCODetection(Dataset[tuple[Tensor, Target]]):
    """``(image float (3, H, W) in [0, 1], target)`` with target keys ``boxes`` (float N×4 xyxy), ``labels``
    (int64, 1..K), ``masks`` (uint8 N×H×W), ``image_id`` (int), ``area`` and ``iscrowd``.

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
    ) -> None:
        self.image_dir, self.annotation_json, self.train, self.transforms = (
            Path(image_dir),
            Path(annotation_json),
            train,
            transforms,
        )
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
            kept = [
                a for a in (self._clean(ann, info) for ann in self.coco.imgToAnns[image_id]) if a is not None
            ]
            if train and not kept:
                self.drop_summary["no_valid_box_images"] += (
                    1  # nothing to learn from; torchvision/mmdet skip it too
                )
                continue
            self.items.append((image_id, kept))
        counts = ", ".join(f"{k}={v}" for k, v in self.drop_summary.items())
        log = logger.warning if any(self.drop_summary.values()) else logger.info
        log(
            "COCO %s (%s): %d images kept; adjusted/dropped: %s",
            self.annotation_json,
            "train" if train else "val",
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
        bbox = ann.get("bbox")
        if (
            not isinstance(bbox, list)
            or len(bbox) != 4
            or not all(isinstance(v, int | float) and math.isfinite(v) for v in bbox)
        ):
            raise DataError(
                f"{where} has bbox {bbox!r}; a COCO bbox is [x, y, width, height]; fix or remove it"
            )
        x, y, w, h = (float(v) for v in bbox)
        width, height = float(info["width"]), float(info["height"])
        box = (
            min(max(x, 0.0), width),
            min(max(y, 0.0), height),
            min(max(x + w, 0.0), width),
            min(max(y + h, 0.0), height),
        )
        if box[2] <= box[0] or box[3] <= box[1]:
            self.drop_summary["zero_area"] += 1
            return None
        if box != (x, y, x + w, y + h):
            self.drop_summary["clipped"] += 1
        seg = ann.get("segmentation")
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
        return _Ann(
            int(ann["id"]),
            box,
            self.category_to_label[category],
            float(ann.get("area", w * h)),
            {**ann, "segmentation": seg} if usable else None,
        )

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
                f"image {path} is {width}x{height} but {self.annotation_json} says {info['width']}x"
                f"{info['height']} for image id {image_id}; fix width/height there or re-export the image"
            )
        masks = (
            np.stack([self._mask(a, height, width) for a in anns])
            if anns
            else np.zeros((0, height, width), np.uint8)
        )
        image = raw.float().div_(255)
        target: Target = {
            "boxes": torch.tensor([a.box for a in anns], dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor([a.label for a in anns], dtype=torch.int64),
            "masks": torch.from_numpy(masks),
            "image_id": int(image_id),
            "area": torch.tensor([a.area for a in anns], dtype=torch.float32),
            "iscrowd": torch.zeros(len(anns), dtype=torch.int64),
        }
        if self.transforms is not None:
            target["boxes"] = tv_tensors.BoundingBoxes(
                target["boxes"], format="XYXY", canvas_size=(height, width)
            )
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
        part = {
            **data,
            "images": [images[i] for i in idx],
            "annotations": [a for a in data.get("annotations", []) if a["image_id"] in ids],
        }
        paths.append(out / f"{src.stem}_{name}.json")
        paths[-1].write_text(json.dumps(part))
    return paths[0], paths[1]


CATEGORY_IDS = (3, 7, 12, 18, 25, 33, 42, 52, 63, 75)  # deliberately not 1..K
_POLYGONS = (
    ("square", 4, 45.0, 1.0),
    ("triangle", 3, -90.0, 1.0),
    ("circle", 24, 0.0, 1.0),
    ("star", 10, -90.0, 0.45),
    ("hexagon", 6, 0.0, 1.0),
    ("diamond", 4, 0.0, 1.0),
    ("pentagon", 5, -90.0, 1.0),
    ("cross", 12, 0.0, 0.5),
    ("octagon", 8, 22.5, 1.0),
    ("heptagon", 7, 0.0, 1.0),
)


def _polygon(kind: int, cx: float, cy: float, r: float) -> list[float]:
    _, corners, rotation, inner = _POLYGONS[kind]
    points: list[float] = []
    for k in range(corners):  # stars alternate an outer and an inner radius
        radius = r * (inner if inner < 1.0 and k % 2 else 1.0)
        angle = math.radians(rotation + 360.0 * k / corners)
        points += [round(cx + radius * math.cos(angle), 2), round(cy + radius * math.sin(angle), 2)]
    return points


def make_coco(
    out: PathLike, *, num_images: int = 32, size: int = 96, num_categories: int = 3, seed: int = 0
) -> Path:
    """Write ``out/images/*.jpg`` and ``out/annotations/instances.json``, a learnable COCO set; returns ``out``.

    Category ``i`` (id ``CATEGORY_IDS[i]``) is one filled polygon shape in one colour. Masks are polygons,
    every third one a compressed RLE; every fifth image has a crowd region, every fourth an object
    partly outside the image, and the first a zero-width box.
    """
    if not 1 <= num_categories <= len(CATEGORY_IDS) or size < 32:
        raise ValueError(f"need 1 <= num_categories <= {len(CATEGORY_IDS)} and size >= 32")
    _, mask_utils = _pycocotools()
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    images: list[dict[str, Any]] = []
    anns: list[dict[str, Any]] = []

    def add(image_id: int, cat: int, mask: np.ndarray, bbox: list[float], seg: Any, crowd: int = 0) -> None:
        anns.append(
            {
                "id": len(anns) + 1,
                "image_id": image_id,
                "category_id": CATEGORY_IDS[cat],
                "bbox": bbox,
                "area": float(mask.sum()),
                "segmentation": seg,
                "iscrowd": crowd,
            }
        )

    def rle(mask: np.ndarray) -> dict[str, Any]:
        encoded = mask_utils.encode(np.asfortranarray(mask))
        return {"size": encoded["size"], "counts": encoded["counts"].decode("ascii")}

    for i in range(num_images):
        image_id = 1000 + 7 * i  # non-contiguous ids, as real COCO has
        canvas = noisy_background(rng, size, size)
        taken = np.zeros((size, size), bool)
        for k in range(int(rng.integers(1, 4))):
            cat = int(rng.integers(0, num_categories))
            r = float(rng.uniform(0.12, 0.22) * size)
            for _ in range(20):  # rejection-sample a place that does not overlap earlier objects
                cx, cy = rng.uniform(r, size - r, size=2)
                if k == 0 and i % 4 == 1:
                    cx = -0.4 * r if rng.random() < 0.5 else size + 0.4 * r  # straddles the left/right edge
                poly = _polygon(cat, float(cx), float(cy), r)
                mask = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects([poly], size, size)))
                if mask.any() and not (taken & mask.astype(bool)).any():
                    break
            else:
                continue
            taken |= mask.astype(bool)
            paint(canvas, mask.astype(bool), class_colour(cat), rng)
            xs, ys = poly[0::2], poly[1::2]  # the unclipped extent: boxes may leave the image on purpose
            bbox = [min(xs), min(ys), round(max(xs) - min(xs), 2), round(max(ys) - min(ys), 2)]
            add(image_id, cat, mask, bbox, rle(mask) if len(anns) % 3 == 2 else [poly])
        if i % 5 == 4:  # a crowd: a cluster of small blobs of one category, as one RLE
            cat, cy, cx = int(rng.integers(0, num_categories)), *rng.uniform(0.2 * size, 0.8 * size, size=2)
            yy, xx = np.mgrid[0:size, 0:size]
            crowd = np.zeros((size, size), bool)
            for dy, dx in rng.normal(0, 0.06 * size, size=(5, 2)):
                crowd |= (yy - cy - dy) ** 2 + (xx - cx - dx) ** 2 <= (0.03 * size) ** 2
            crowd &= ~taken
            if crowd.any():
                paint(canvas, crowd, class_colour(cat), rng)
                ys, xs = np.nonzero(crowd)
                bbox = [
                    float(xs.min()),
                    float(ys.min()),
                    float(xs.max() - xs.min() + 1),
                    float(ys.max() - ys.min() + 1),
                ]
                add(image_id, cat, crowd.astype(np.uint8), bbox, rle(crowd.astype(np.uint8)), crowd=1)
        if i == 0:  # a zero-width box, as annotation tools sometimes emit
            add(
                image_id,
                0,
                np.zeros((1, 1), np.uint8),
                [5.0, 5.0, 0.0, 10.0],
                [[5.0, 5.0, 5.0, 15.0, 5.0, 15.0]],
            )
        file_name = f"{image_id:012d}.jpg"
        write_jpeg(
            torch.from_numpy(canvas).permute(2, 0, 1).contiguous(),
            str(out / "images" / file_name),
            quality=95,
        )
        images.append({"id": image_id, "file_name": file_name, "width": size, "height": size})
    categories = [
        {"id": CATEGORY_IDS[c], "name": _POLYGONS[c][0], "supercategory": "shape"}
        for c in range(num_categories)
    ]
    doc = {
        "info": {"description": "gputrain generated sample set"},
        "licenses": [],
        "images": images,
        "annotations": anns,
        "categories": categories,
    }
    (out / "annotations" / "instances.json").write_text(json.dumps(doc))
    return out
