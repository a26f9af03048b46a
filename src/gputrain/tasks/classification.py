"""Image classification: cross-entropy, accuracy from reduced counts. CIFAR-10 batches or a class folder."""

from __future__ import annotations

import torch.nn.functional as F
from torchvision.transforms import v2

from gputrain.config import RunConfig
from gputrain.data.images import normalize_transform
from gputrain.metrics.base import Evaluator
from gputrain.metrics.classification import ClassificationEvaluator
from gputrain.models import build_configured_model
from gputrain.tasks.base import Task
from gputrain.tasks.spec import TaskSpec

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class ClassificationTask(Task):
    def __init__(self, num_classes: int) -> None:
        super().__init__(F.cross_entropy)
        self.num_classes = num_classes

    def evaluator(self) -> Evaluator:
        return ClassificationEvaluator(self.num_classes)


def _cifar10(cfg: RunConfig) -> tuple:
    from gputrain.data.cifar10 import CIFAR10

    normalize = normalize_transform(CIFAR_MEAN, CIFAR_STD)
    train_tf = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), normalize]) if cfg.data.augment \
        else normalize
    return CIFAR10(cfg.data.root, train=True, transform=train_tf), CIFAR10(cfg.data.root, train=False, transform=normalize), 10


def _classfolder(cfg: RunConfig) -> tuple:
    from gputrain.data.classfolder import ClassFolder, classification_transform, split_classfolder

    size = cfg.data.image_size or 224
    train_tf = classification_transform(size, train=cfg.data.augment)
    val_tf = classification_transform(size, train=False)
    if cfg.data.val_root:
        train, val = ClassFolder(cfg.data.root, transform=train_tf), ClassFolder(cfg.data.val_root, transform=val_tf)
        classes = train.classes
        if val.classes != classes:
            raise ValueError(f"data.val_root={cfg.data.val_root} has classes {val.classes} but data.root has {classes}")
    else:
        # Subsets of one ClassFolder here (the caller needs only Datasets); typed as in the branch above.
        train, val = split_classfolder(cfg.data.root, val_fraction=cfg.data.val_fraction,  # type: ignore[assignment]
                                       seed=cfg.data.split_seed, train_transform=train_tf, val_transform=val_tf)
        classes = train.dataset.classes
    return train, val, len(classes)


def build(cfg: RunConfig) -> TaskSpec:
    if cfg.data.format not in ("cifar10", "classfolder"):
        raise ValueError(f"data.format={cfg.data.format!r}: classification reads cifar10 or classfolder")
    train, val, found = (_cifar10 if cfg.data.format == "cifar10" else _classfolder)(cfg)
    num_classes = cfg.data.num_classes or found
    if num_classes != found:
        raise ValueError(f"data.num_classes={num_classes} but {cfg.data.root} has {found} classes; set it to {found}")
    model = build_configured_model(cfg.model, "resnet18", num_classes=num_classes)
    return TaskSpec(task=ClassificationTask(num_classes), model=model, train_data=train, val_data=val,
                    example_input=val[0][0].unsqueeze(0))
