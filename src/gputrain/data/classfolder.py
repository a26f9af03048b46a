"""Classification from an image folder, ``root/<class>/<image>`` (torchvision's ImageFolder layout).

Scanning, class discovery and indexing are torchvision's own :class:`~torchvision.datasets.ImageFolder`;
this module only swaps the loader for :func:`~gputrain.data.images.read_image_rgb`, so a truncated or
corrupt file names its path, and refuses image suffixes TorchCodec is not asked to decode instead of letting
ImageFolder skip (or PIL half-read) them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Subset
from torchcodec.encoders import JpegEncoder, PngEncoder
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS
from torchvision.transforms import v2

from gputrain.data.device_decode import read_encoded
from gputrain.data.images import (
    DECODABLE_SUFFIXES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    SHAPES,
    DataError,
    PathLike,
    draw_class_image,
    normalize_transform,
    read_image_rgb,
    seeded_split,
    to_uint8,
)

Transform = Callable[[Tensor], Any]


def classification_transform(size: int, *, train: bool, normalize: bool = True) -> Callable[[Tensor], Tensor]:
    """The usual pipeline on ``uint8`` tensors: random-resized-crop + flip for training, resize + centre-crop
    for evaluation; both end as float normalized by the ImageNet mean/std, or stay ``uint8`` with
    ``normalize=False`` (data.normalize_on_device: the training device normalizes)."""
    geometry: list[Any] = (
        [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
        if train
        else [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
    )
    return v2.Compose([*geometry, normalize_transform(IMAGENET_MEAN, IMAGENET_STD) if normalize else to_uint8])


class ClassFolder(ImageFolder):
    """``root/<class>/<image>`` as ``(transform(uint8 CHW tensor), class_index)``.

    ``transform="default"`` converts to float normalized by the ImageNet mean/std (sizes are kept, so
    batch only same-size images or pass :func:`classification_transform`); ``None`` returns ``uint8``.
    ``classes`` and ``class_to_idx`` come from ImageFolder: sorted folder names.
    """

    def __init__(
        self, root: PathLike, *, transform: Transform | Literal["default"] | None = "default", encoded: bool = False
    ) -> None:
        skipped: list[str] = []

        def is_valid_file(path: str) -> bool:
            suffix = os.path.splitext(path)[1].lower()
            if suffix in IMG_EXTENSIONS and suffix not in DECODABLE_SUFFIXES:
                skipped.append(path)  # an image we would silently lose; reported below
            return suffix in DECODABLE_SUFFIXES

        if transform == "default":
            transform = normalize_transform(IMAGENET_MEAN, IMAGENET_STD)
        try:
            # encoded: samples are the files' bytes (data.decode_on_device), decoded and transformed on the device.
            super().__init__(
                str(root), transform=None if encoded else transform,
                loader=read_encoded if encoded else read_image_rgb, is_valid_file=is_valid_file
            )
        except FileNotFoundError as e:
            raise DataError(
                f"image folder {root}: {str(e).strip()} The layout must be root/<class>/<image> with images ending in "
                f"{', '.join(DECODABLE_SUFFIXES)}; add images to that class folder or remove it"
            ) from e
        if skipped:
            raise DataError(
                f"{len(skipped)} image(s) in {root} have a format gputrain does not decode, e.g. {skipped[0]}; "
                f"convert them to one of {', '.join(DECODABLE_SUFFIXES)} (PNG keeps them lossless) or remove them"
            )


def split_classfolder(
    root: PathLike,
    *,
    val_fraction: float = 0.2,
    seed: int = 0,
    train_transform: Transform | Literal["default"] | None = "default",
    val_transform: Transform | Literal["default"] | None = "default",
    encoded_train: bool = False,
) -> tuple[Subset[Any], Subset[Any]]:
    """A single folder split by :func:`~gputrain.data.images.seeded_split` into ``(train, val)`` subsets,
    each seeing the folder through its own transform (random augmentation for training only)."""
    train_view = ClassFolder(root, transform=train_transform, encoded=encoded_train)
    val_view = ClassFolder(root, transform=val_transform)
    train_idx, val_idx = seeded_split(len(train_view), val_fraction, seed)
    return Subset(train_view, train_idx), Subset(val_view, val_idx)


def class_names(classes: int) -> list[str]:
    """Folder names of a generated set: the shape each class draws, numbered past the ten shapes."""
    return [
        SHAPES[i] if classes <= len(SHAPES) else f"{i:03d}_{SHAPES[i % len(SHAPES)]}" for i in range(classes)
    ]


def make_classfolder(
    out: PathLike, *, classes: int = 4, per_class: int = 32, size: int = 64, seed: int = 0
) -> Path:
    """Write ``out/<class>/<n>.jpg`` (every fourth one a ``.png``) of learnable classes; returns ``out``.

    Class ``i`` is one shape in one colour on a noisy background, at a random place and size.
    """
    if classes < 2 or per_class < 1 or size < 8:
        raise ValueError(
            f"need classes >= 2, per_class >= 1 and size >= 8 (got {classes}, {per_class}, {size})"
        )
    out = Path(out)
    rng = np.random.default_rng(seed)
    for cls, name in enumerate(class_names(classes)):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = torch.from_numpy(draw_class_image(rng, cls, size)).permute(2, 0, 1).contiguous()
            if i % 4 == 3:
                PngEncoder(image).to_file(folder / f"{i:05d}.png")
            else:
                JpegEncoder(image).to_file(folder / f"{i:05d}.jpg", quality=90)
    return out
