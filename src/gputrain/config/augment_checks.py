"""Checks of classification's augmentation options (``data.auto_augment``, crops, MixUp, ...), before any run starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputrain.config.schema import RunConfig


CLASSIFICATION_ONLY = (("optim.label_smoothing", 0.0), ("data.auto_augment", ""), ("data.random_erase", 0.0),
                       ("data.crop_scale", [0.08, 1.0]), ("data.hflip", 0.5), ("data.train_crop_size", 0),
                       ("data.val_resize_size", 0), ("data.val_crop_size", 0), ("data.interpolation", "bilinear"),
                       ("data.mixup_alpha", 0.0), ("data.cutmix_alpha", 0.0), ("data.repeated_augment", 1))
"""Options the classification task alone reads, with their defaults."""


POLICIES = ("ta_wide", "ra", "augmix", "imagenet")
"""``data.auto_augment``'s names, as torchvision's reference spells them (``--auto-augment``)."""
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")


def check_augmentation(cfg: RunConfig) -> None:
    """Classification's augmentation options: names, the crop range, and a task that reads them."""
    d = cfg.data
    if d.auto_augment and d.auto_augment not in POLICIES:
        raise ValueError(f"data.auto_augment={d.auto_augment!r} is unknown; choose {', '.join(POLICIES)} (or leave it "
                         "empty)")
    if d.interpolation not in INTERPOLATIONS:
        raise ValueError(f"data.interpolation={d.interpolation!r} is unknown; choose {', '.join(INTERPOLATIONS)}")
    if len(d.crop_scale) != 2 or d.crop_scale[0] > d.crop_scale[1]:
        raise ValueError(f"data.crop_scale={list(d.crop_scale)} must be two numbers [low, high] with low <= high, "
                         "e.g. [0.08, 1.0]")
    crop = d.val_crop_size or d.image_size or 224
    if d.val_resize_size and d.val_resize_size < crop:
        raise ValueError(f"data.val_resize_size={d.val_resize_size} is smaller than the validation crop {crop} "
                         "(data.val_crop_size, else data.image_size); resize to at least the crop, e.g. "
                         f"data.val_resize_size={round(crop * 232 / 224)} as torchvision's 232/224")
    t = cfg.trainer
    if (d.mixup_alpha or d.cutmix_alpha) and t.batch_size % 2:
        raise ValueError(f"data.mixup_alpha/cutmix_alpha mix the samples of each device's batch two by two, and "
                         f"trainer.batch_size={t.batch_size} is odd; use an even batch size, e.g. {t.batch_size + 1}")
    if cfg.task in ("autoencoder", "segmentation", "detection"):
        for name, default in CLASSIFICATION_ONLY:
            section, field = name.split(".")
            value = getattr(getattr(cfg, section), field)
            if value != default:
                raise ValueError(f"{name}={value!r} applies to classification, and task {cfg.task} does not read it; "
                                 "drop it")
