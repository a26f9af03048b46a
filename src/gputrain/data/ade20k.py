"""Semantic segmentation in the ADE20K (ADEChallengeData2016) layout.

``images/{training,validation}/<stem>.jpg`` pairs with ``annotations/{training,validation}/<stem>.png``.
Stored mask values are ``0`` ("other") and ``1..num_classes``; as in mmseg's ``reduce_zero_label``,
value ``v`` becomes class ``v - 1`` and ``0`` becomes the ignore index 255, so the model has exactly
``num_classes`` outputs and "other" costs no loss.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchcodec.encoders import JpegEncoder, PngEncoder
from torchvision import tv_tensors
from torchvision.transforms import v2

from gputrain.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SHAPES,
    DataError,
    PathLike,
    class_colour,
    image_size,
    noisy_background,
    paint,
    read_image_rgb,
    read_mask,
    shape_mask,
    to_uint8,
)

SPLITS = ("training", "validation")
IGNORE_INDEX = 255
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")

JointTransform = Callable[[tv_tensors.Image, tv_tensors.Mask], tuple[Any, Any]]


def segmentation_transform(
    crop_size: int | None, *, train: bool, scale: tuple[float, float] = (0.5, 2.0), normalize: bool = True
) -> v2.Compose:
    """One torchvision v2 pipeline applied jointly to ``(Image, Mask)``.

    Training: resize the shorter side to a random length in ``crop_size * scale``, random-crop
    ``crop_size`` (padding the image with 0 and the mask with the ignore index), random horizontal flip.
    Evaluation: resize the shorter side to ``crop_size`` and centre-crop, for fixed-size batches (for
    exact full-resolution metrics pass ``crop_size=None`` and use batch size 1). Both end with float
    conversion and ImageNet normalization, or keep the image ``uint8`` with ``normalize=False``
    (data.normalize_on_device: the training device runs those two steps); v2 resizes masks with
    nearest-neighbour, never blending labels.
    """
    steps: list[Any] = []
    if crop_size is not None and train:
        lo, hi = max(1, int(crop_size * scale[0])), max(2, int(crop_size * scale[1]) + 1)
        steps = [
            v2.RandomResize(lo, hi, antialias=True),
            v2.RandomCrop(
                crop_size, pad_if_needed=True, fill={tv_tensors.Image: 0, tv_tensors.Mask: IGNORE_INDEX}
            ),
            v2.RandomHorizontalFlip(),
        ]
    elif crop_size is not None:
        steps = [v2.Resize(crop_size, antialias=True), v2.CenterCrop(crop_size)]
    if normalize:
        steps += [
            v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
            v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD)),
        ]
    else:
        steps.append(v2.Lambda(to_uint8, tv_tensors.Image))  # a 16-bit PNG's image to uint8; masks keep their ids
    return v2.Compose(steps)


def reduce_zero_label(raw: Tensor) -> Tensor:
    """Stored labels → training labels: ``v`` → ``v - 1``, ``0`` ("other") → 255; as ``uint8``."""
    return torch.where(raw == 0, IGNORE_INDEX, raw - 1).to(torch.uint8)


class ADE20K(Dataset[tuple[Tensor, Tensor]]):
    """``(image float (3, H, W) normalized, mask int64 (H, W))`` pairs of one split of an ADE20K-layout root
    (the image ``uint8`` where ``transform`` does not normalize).

    ``num_classes`` is the number of real classes (150 for ADE20K). Missing annotations are found here;
    size mismatches and out-of-range labels when a sample is read, or all at once by :meth:`validate`.
    """

    def __init__(
        self,
        root: PathLike,
        *,
        split: str = "training",
        num_classes: int = 150,
        transform: JointTransform | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; use one of {SPLITS}")
        if not 1 <= num_classes < IGNORE_INDEX:
            raise ValueError(
                f"num_classes={num_classes} must be in 1..{IGNORE_INDEX - 1} (255 is the ignore index)"
            )
        root = Path(root)
        self.image_dir, self.mask_dir = root / "images" / split, root / "annotations" / split
        if not self.image_dir.is_dir():
            raise DataError(
                f"{self.image_dir} does not exist; an ADE20K root holds images/{split}/ and annotations/{split}/"
            )
        images = sorted(p for p in self.image_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise DataError(f"{self.image_dir} has no {'/'.join(IMAGE_SUFFIXES)} images; check data.root")
        missing = [p for p in images if not (self.mask_dir / f"{p.stem}.png").is_file()]
        if missing:
            raise DataError(
                f"{len(missing)} image(s) have no annotation, e.g. {missing[0]} needs {self.mask_dir / (missing[0].stem + '.png')}; "
                "add the mask or remove the image"
            )
        self.samples: list[tuple[Path, Path]] = [(p, self.mask_dir / f"{p.stem}.png") for p in images]
        self.num_classes = num_classes
        self.transform: JointTransform = (
            transform if transform is not None else segmentation_transform(None, train=False)
        )

    def __len__(self) -> int:
        return len(self.samples)

    def _check(self, index: int, image_hw: tuple[int, int], raw: Tensor) -> None:
        image_path, mask_path = self.samples[index]
        mask_hw = (int(raw.shape[0]), int(raw.shape[1]))
        if mask_hw != image_hw:
            raise DataError(
                f"mask {mask_path} is {mask_hw[1]}x{mask_hw[0]} (WxH) but its image {image_path} is "
                f"{image_hw[1]}x{image_hw[0]}; re-export the mask at the image's size"
            )
        top = int(raw.max()) if raw.numel() else 0
        if top > self.num_classes:
            raise DataError(
                f"mask {mask_path} has label value {top} but num_classes={self.num_classes} (stored values must be 0 "
                f"for 'other' or 1..{self.num_classes}); set data.num_classes to at least {top} or fix the mask"
            )

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image_path, mask_path = self.samples[index]
        image = read_image_rgb(image_path)
        raw = read_mask(mask_path)
        self._check(index, (int(image.shape[1]), int(image.shape[2])), raw)
        out_image, out_mask = self.transform(tv_tensors.Image(image), tv_tensors.Mask(reduce_zero_label(raw)))
        return out_image.as_subclass(Tensor), out_mask.as_subclass(Tensor).long()

    def validate(self) -> None:
        """Check every pair (sizes from image headers, labels from the masks) before a long run starts."""
        for index, (image_path, mask_path) in enumerate(self.samples):
            self._check(index, image_size(image_path), read_mask(mask_path))


def make_ade20k(
    out: PathLike, *, num_classes: int = 8, train: int = 32, val: int = 8, size: int = 64, seed: int = 0
) -> Path:
    """Write a learnable ADE20K-layout set under ``out``: JPEG images and greyscale PNG masks; returns ``out``.

    Each image is a noisy background (stored label 0, "other") with 2-4 objects; an object of class
    ``c`` (stored ``c + 1``) is shape ``SHAPES[c % 10]`` filled with colour ``class_colour(c)``.
    """
    if not 1 <= num_classes < IGNORE_INDEX or size < 16:
        raise ValueError(f"need 1 <= num_classes < 255 and size >= 16 (got {num_classes}, {size})")
    out = Path(out)
    rng = np.random.default_rng(seed)
    for split, count, prefix in (("training", train, "ADE_train"), ("validation", val, "ADE_val")):
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
        (out / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            canvas = noisy_background(rng, size, size)
            mask = np.zeros((size, size), np.uint8)
            for _ in range(int(rng.integers(2, 5))):
                cls = int(rng.integers(0, num_classes))
                r = float(rng.uniform(0.15, 0.3) * size)
                cy, cx = rng.uniform(0, size, size=2)
                region = shape_mask(SHAPES[cls % len(SHAPES)], size, size, float(cy), float(cx), r)
                paint(canvas, region, class_colour(cls), rng)
                mask[region] = cls + 1
            stem = f"{prefix}_{i + 1:08d}"
            pixels = torch.from_numpy(canvas).permute(2, 0, 1).contiguous()
            JpegEncoder(pixels).to_file(out / "images" / split / f"{stem}.jpg", quality=95)
            PngEncoder(torch.from_numpy(mask)[None]).to_file(out / "annotations" / split / f"{stem}.png")
    return out
