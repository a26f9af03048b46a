"""``gputrain data make KIND --out DIR``: small learnable sample sets in the formats users have."""

from __future__ import annotations

from pathlib import Path


def make_dataset(kind: str, out: str | Path, *, size: int = 0, count: int = 0, seed: int = 0) -> Path:
    """Write a sample set of ``kind``; 0 for ``size``/``count`` takes the kind's default."""
    for name, value in (("count", count), ("size", size)):
        if value < 0:
            raise ValueError(f"{name}={value} must be positive (or 0 for the {kind} default)")
    if kind == "imagefolder":
        from gputrain.data.imagefolder import make_frames

        return make_frames(out, count=count or 512, size=size or 80, seed=seed)
    if kind == "classfolder":
        from gputrain.data.classfolder import make_classfolder

        return make_classfolder(out, classes=4, per_class=max((count or 400) // 4, 1), size=size or 64, seed=seed)
    if kind == "cifar10":
        from gputrain.data.cifar10 import make_cifar10

        total = count or 1200  # split 5:1 train:test over 10 classes, as in CIFAR-10
        return make_cifar10(out, train_per_class=max(total * 5 // 60, 1), test_per_class=max(total // 60, 1),
                            seed=seed)
    if kind == "ade20k":
        from gputrain.data.ade20k import make_ade20k

        n = count or 120
        return make_ade20k(out, num_classes=8, train=n - n // 5, val=n // 5, size=size or 64, seed=seed)
    if kind == "coco":
        from gputrain.data.coco_sample import make_coco

        return make_coco(out, num_images=count or 60, size=size or 96, seed=seed)
    raise ValueError(f"unknown data kind {kind!r}; choose imagefolder, classfolder, cifar10, ade20k or coco")
