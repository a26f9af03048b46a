"""Classification's training augmentation and evaluation resize, composed as torchvision's classification reference
composes them (``references/classification/presets.py``), from ``torchvision.transforms.v2`` only.

Training: a crop (RandomResizedCrop with ``crop_scale`` for class folders, CIFAR's padded RandomCrop), a horizontal
flip with probability ``hflip``, an automatic policy (``ta_wide`` TrivialAugmentWide, ``ra`` RandAugment, ``augmix``
AugMix, ``imagenet`` AutoAugment's ImageNet policy), then the float conversion and normalisation, then RandomErasing
with probability ``random_erase``. Evaluation: resize the shorter side to ``resize``, centre-crop ``crop``.

Every random draw comes from torch's generator, which the loader seeds per sample (``data.samplers.SeededSamples``):
the same sample is augmented the same way on any world size or worker count, and after a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torchvision.transforms import InterpolationMode, v2

from gputrain.config.augment_checks import POLICIES
from gputrain.data.images import normalize_transform, to_uint8

INTERPOLATIONS = {"nearest": InterpolationMode.NEAREST, "bilinear": InterpolationMode.BILINEAR,
                  "bicubic": InterpolationMode.BICUBIC}


@dataclass(frozen=True)
class Augmentation:
    """The training augmentation options (``data.*``); the defaults are what gputrain always did."""

    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: float = 0.5
    auto_augment: str = ""
    random_erase: float = 0.0
    interpolation: str = "bilinear"


def _policy(name: str, interpolation: InterpolationMode) -> v2.Transform:
    if name == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if name == "ra":
        return v2.RandAugment(interpolation=interpolation)
    if name == "augmix":
        return v2.AugMix(interpolation=interpolation)
    if name == "imagenet":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=interpolation)
    raise ValueError(f"data.auto_augment={name!r} is unknown; choose {', '.join(POLICIES)} (or leave it empty)")


def resized_crop(size: int, aug: Augmentation) -> v2.Transform:
    return v2.RandomResizedCrop(size, scale=aug.crop_scale, interpolation=INTERPOLATIONS[aug.interpolation],
                                antialias=True)


def train_transform(crop: v2.Transform, aug: Augmentation, *, normalize: bool, mean: Sequence[float],
                    std: Sequence[float]) -> Callable[[Tensor], Tensor]:
    """``crop``, flip, policy, then float and normalised (or ``uint8`` for the device to normalise), then erasing."""
    steps: list[Any] = [crop]
    if aug.hflip > 0:
        steps.append(v2.RandomHorizontalFlip(aug.hflip))
    if aug.auto_augment:
        # The policies take uint8, and on tensors nearest or bilinear only: bicubic crops, a bilinear policy.
        policy = InterpolationMode.NEAREST if aug.interpolation == "nearest" else InterpolationMode.BILINEAR
        steps += [to_uint8, _policy(aug.auto_augment, policy)]
    steps.append(normalize_transform(tuple(mean), tuple(std)) if normalize else to_uint8)
    if aug.random_erase > 0:
        # The reference erases the normalised image with 0; on uint8 that is the mean pixel.
        fill: Any = 0 if normalize else [round(m * 255) for m in mean]
        steps.append(v2.RandomErasing(aug.random_erase, value=fill))
    return v2.Compose(steps)


def eval_transform(crop: int, resize: int, interpolation: str, *, mean: Sequence[float],
                   std: Sequence[float]) -> Callable[[Tensor], Tensor]:
    """Resize the shorter side to ``resize`` (``crop`` when 0), centre-crop ``crop``, float and normalised."""
    return v2.Compose([v2.Resize(resize or crop, interpolation=INTERPOLATIONS[interpolation], antialias=True),
                       v2.CenterCrop(crop), normalize_transform(tuple(mean), tuple(std))])
