"""Image classification: cross-entropy, accuracy from reduced counts. CIFAR-10 batches or a class folder."""

from __future__ import annotations

import csv
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from gputrain.config import RunConfig
from gputrain.data.augment import Augmentation, eval_transform, resized_crop, train_transform
from gputrain.data.classfolder import classification_transform
from gputrain.data.device_normalize import PixelCollate, normalize_on_device
from gputrain.data.images import IMAGENET_MEAN, IMAGENET_STD, normalize_transform
from gputrain.metrics.base import Evaluator
from gputrain.metrics.classification import ClassificationEvaluator
from gputrain.models import build_configured_model
from gputrain.tasks.base import Task
from gputrain.tasks.draw import denormalize, name_of
from gputrain.tasks.spec import TaskSpec

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class ClassificationTask(Task):
    def __init__(self, num_classes: int, *, class_names: list[str] | None = None,
                 mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
                 label_smoothing: float = 0.0) -> None:
        # optim.label_smoothing: torch's own smoothed cross-entropy, as the reference's CrossEntropyLoss(label_smoothing)
        super().__init__(functools.partial(F.cross_entropy, label_smoothing=label_smoothing) if label_smoothing
                         else F.cross_entropy)
        self.num_classes, self.class_names, self.mean, self.std = num_classes, class_names, mean, std

    def evaluator(self) -> Evaluator:
        return ClassificationEvaluator(self.num_classes)

    def display(self, inputs: torch.Tensor) -> torch.Tensor:
        return denormalize(inputs, self.mean, self.std)

    def prediction(self, output: Any, size: tuple[int, int]) -> dict[str, torch.Tensor]:
        """The top 5 classes (fewer where there are fewer) and their probabilities."""
        top = output.detach().float().softmax(-1).topk(min(5, output.numel()))
        return {"labels": top.indices.cpu(), "scores": top.values.cpu()}

    def draw(self, image: torch.Tensor, output: Any, target: Any = None) -> tuple[torch.Tensor, str]:
        if not isinstance(output, dict):
            output = self.prediction(output, (int(image.shape[-2]), int(image.shape[-1])))
        prob, label = output["scores"][0], output["labels"][0]
        caption = f"{name_of(self.class_names, int(label))} {float(prob):.2f}"
        if target is not None:
            caption += f" (true: {name_of(self.class_names, int(target))})"
        return image, caption

    def write_predictions(self, inputs: Sequence[Any], results: Sequence[Any], out: Path) -> str:
        """``predictions.csv``: ``file,label,class,score`` and the top 5 as space-separated lists."""
        path = out / "predictions.csv"
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["file", "label", "class", "score", "top5_labels", "top5_classes", "top5_scores"])
            for item, r in zip(inputs, results, strict=True):
                labels, scores = r["labels"].tolist(), r["scores"].tolist()
                writer.writerow([str(item.path), labels[0], name_of(self.class_names, labels[0]), f"{scores[0]:.6f}",
                                 " ".join(map(str, labels)), " ".join(name_of(self.class_names, k) for k in labels),
                                 " ".join(f"{s:.6f}" for s in scores)])
        return str(path)


def _stats(cfg: RunConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return (CIFAR_MEAN, CIFAR_STD) if cfg.data.format == "cifar10" else (IMAGENET_MEAN, IMAGENET_STD)


def eval_preprocess(cfg: RunConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The evaluation preprocessing of a ``uint8 (3, H, W)`` image: validation data and ``gputrain predict`` alike."""
    if cfg.data.format == "cifar10":
        return normalize_transform(CIFAR_MEAN, CIFAR_STD)  # type: ignore[return-value]
    d = cfg.data
    return eval_transform(d.val_crop_size or d.image_size or 224, d.val_resize_size, d.interpolation,
                          mean=IMAGENET_MEAN, std=IMAGENET_STD)


def augmentation(cfg: RunConfig) -> Augmentation:
    d = cfg.data
    return Augmentation(crop_scale=(d.crop_scale[0], d.crop_scale[1]), hflip=d.hflip, auto_augment=d.auto_augment,
                        random_erase=d.random_erase, interpolation=d.interpolation)


def _train_size(cfg: RunConfig) -> int:
    return cfg.data.train_crop_size or cfg.data.image_size or 224


def _class_names(cfg: RunConfig) -> list[str] | None:
    """Class names without reading the data set: CIFAR-10's, or a class folder's sub-folder names."""
    if cfg.data.format == "cifar10":
        from gputrain.data.cifar10 import LABEL_NAMES

        return list(LABEL_NAMES)
    from torchvision.datasets.folder import find_classes

    try:
        return find_classes(cfg.data.root)[0] if Path(cfg.data.root).is_dir() else None
    except FileNotFoundError:  # a folder without class sub-folders
        return None


def for_prediction(cfg: RunConfig, *, annotations: str = "") -> tuple[Task, Callable[[torch.Tensor], Any]]:
    """The task and input preprocessing ``gputrain predict`` uses: those of evaluation, without the data set."""
    num_classes = int(cfg.model.kwargs.get("num_classes") or cfg.data.num_classes or 1000)
    mean, std = _stats(cfg)
    return ClassificationTask(num_classes, class_names=_class_names(cfg), mean=mean, std=std), eval_preprocess(cfg)


def _cifar10(cfg: RunConfig) -> tuple:
    from gputrain.data.cifar10 import CIFAR10

    normalize = eval_preprocess(cfg)
    train_normalize = [] if normalize_on_device(cfg) else [normalize]
    train_tf = train_transform(v2.RandomCrop(32, padding=4), augmentation(cfg), normalize=not normalize_on_device(cfg),
                               mean=CIFAR_MEAN, std=CIFAR_STD) if cfg.data.augment else v2.Compose(train_normalize)
    return CIFAR10(cfg.data.root, train=True, transform=train_tf), CIFAR10(cfg.data.root, train=False, transform=normalize), 10


def _classfolder(cfg: RunConfig) -> tuple:
    from gputrain.data.classfolder import ClassFolder, split_classfolder

    train_tf = _classfolder_train(cfg, normalize=not normalize_on_device(cfg))
    val_tf = eval_preprocess(cfg)
    encoded = on_device_decoding(cfg)
    if cfg.data.val_root:
        train = ClassFolder(cfg.data.root, transform=train_tf, encoded=encoded)
        val = ClassFolder(cfg.data.val_root, transform=val_tf)
        classes = train.classes
        if val.classes != classes:
            raise ValueError(f"data.val_root={cfg.data.val_root} has classes {val.classes} but data.root has {classes}")
    else:
        # Subsets of one ClassFolder here (the caller needs only Datasets); typed as in the branch above.
        train, val = split_classfolder(cfg.data.root, val_fraction=cfg.data.val_fraction,  # type: ignore[assignment]
                                       seed=cfg.data.split_seed, train_transform=train_tf, val_transform=val_tf,
                                       encoded_train=encoded)
        classes = train.dataset.classes
    return train, val, len(classes)


def _classfolder_train(cfg: RunConfig, *, normalize: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    size = _train_size(cfg)
    if not cfg.data.augment:
        return classification_transform(size, train=False, normalize=normalize)
    aug = augmentation(cfg)
    return train_transform(resized_crop(size, aug), aug, normalize=normalize, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def on_device_decoding(cfg: RunConfig) -> bool:
    """data.decode_on_device, except for synthetic runs (whose samples are decoded once, up front)."""
    return cfg.data.decode_on_device and not cfg.data.synthetic


def build(cfg: RunConfig) -> TaskSpec:
    if cfg.data.format not in ("cifar10", "classfolder"):
        raise ValueError(f"data.format={cfg.data.format!r}: classification reads cifar10 or classfolder")
    train, val, found = (_cifar10 if cfg.data.format == "cifar10" else _classfolder)(cfg)
    num_classes = cfg.data.num_classes or found
    if num_classes != found:
        raise ValueError(f"data.num_classes={num_classes} but {cfg.data.root} has {found} classes; set it to {found}")
    example = val[0][0].unsqueeze(0)
    model = build_configured_model(cfg.model, "resnet18", kind="classification", num_classes=num_classes,
                                   input_size=(int(example.shape[-2]), int(example.shape[-1])))
    mean, std = _stats(cfg)
    task = ClassificationTask(num_classes, class_names=_class_names(cfg), mean=mean, std=std,
                              label_smoothing=cfg.optim.label_smoothing)
    if cfg.data.format == "classfolder" and on_device_decoding(cfg):
        from gputrain.data.device_decode import EncodedCollate

        task.train_collate = EncodedCollate(_classfolder_train(cfg, normalize=True))
    elif normalize_on_device(cfg):
        task.train_collate = PixelCollate(mean, std)
    return TaskSpec(task=task, model=model, train_data=train, val_data=val, example_input=example)
