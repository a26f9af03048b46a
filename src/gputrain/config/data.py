"""The run configuration's ``data:`` section: where the data is, how it is split, read and augmented (a dataclass of
:mod:`gputrain.config.schema`'s :class:`~gputrain.config.schema.RunConfig`, in a file of its own for its length)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class DataConfig:
    """Where the data is and how it is split and read."""

    format: str = ""
    """On-disk format where a task reads several: cifar10 or classfolder (classification)."""
    root: str = "data/frames"
    """Folder (or file) the task's dataset reads; relative paths are taken from the working directory."""
    val_root: str = ""
    """Separate validation folder; empty means split ``root`` with ``val_fraction``."""
    annotations: str = ""
    """Annotation file for formats that have one (COCO instances JSON)."""
    val_fraction: float = 0.5
    """Share of ``root`` held out for validation when ``val_root`` is empty."""
    synthetic: bool = False
    """Train on the first few real samples kept on the device, repeated: the recipe's shapes without input cost
    (for measuring model speed, ``gputrain bench throughput``; not for learning)."""
    download: bool = False
    """Download the data set into ``root`` when it is not there (CIFAR-10, torchvision's URL and md5), once per node."""
    download_url: str = ""
    """A mirror of the archive for ``download``; empty means torchvision's URL."""
    download_md5: str = ""
    """The md5 of the archive at ``download_url``; empty means torchvision's."""
    split_seed: int = 0
    """Seed of the train/val split; independent of the training seed so splits stay put."""
    image_size: int = 0
    """Side images are resized or cropped to; 0 keeps the files' size."""
    num_classes: int = 0
    """Class count for classification and segmentation; checked against the labels."""
    num_workers: int | str = 0
    """DataLoader worker processes per rank, or ``auto``: the node's cores divided by its processes (capped); under
    ``--strategy auto``, the fewest of those that keep up with the chosen plan's step."""
    augment: bool = True
    """Random training augmentation where the task has one."""
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    """Classification, class folders: RandomResizedCrop's scale range (the reference's ``--random-resized-crop``)."""
    hflip: float = 0.5
    """Classification: probability of a horizontal flip (0 for digits and letters, whose mirror is another class)."""
    auto_augment: str = ""
    """Classification: ta_wide, ra, augmix or imagenet (torchvision.transforms.v2's policies); empty: none."""
    random_erase: float = 0.0
    """Classification: probability of RandomErasing after normalisation."""
    train_crop_size: int = 0
    """Classification, class folders: training crop side; 0: data.image_size (224 when 0)."""
    val_resize_size: int = 0
    """Classification, class folders: validation images' shorter side before the centre crop; 0: the crop side."""
    val_crop_size: int = 0
    """Classification, class folders: validation centre-crop side; 0: data.image_size (224 when 0)."""
    interpolation: str = "bilinear"
    """Classification: the resize and crop interpolation: nearest, bilinear or bicubic."""
    mixup_alpha: float = 0.0
    """Classification: MixUp's Beta(alpha, alpha) (the reference's ``--mixup-alpha``); 0: off."""
    cutmix_alpha: float = 0.0
    """Classification: CutMix's Beta(alpha, alpha) (``--cutmix-alpha``); 0: off. With both, each step picks one."""
    repeated_augment: int = 1
    """Classification: each sample trains this many times an epoch, each augmented anew (``--ra-reps``); 1: off."""
    normalize_on_device: bool | str = "auto"
    """Loader workers hand over ``uint8`` training images and the training device makes them float (scaled and
    normalized, or divided by 255 for the autoencoder and detection): a quarter of the bytes through shared memory,
    pinning and the host-to-device copy. ``auto``: on when training on a GPU. The workers' own ops on the same pixels
    (docs/data.md). Every built-in task; ``true`` with a task of your own is refused."""
    decode_on_device: bool = False
    """Loader workers only read the training images' bytes; the training device decodes (nvJPEG on CUDA) and
    augments them, with each sample's own seed: for machines with few CPU cores per GPU. Class folders only
    (docs/data.md)."""
