"""Classification trained with MSE against one-hot labels, as in PyTorch's model-parallel tutorial.

The tutorial trains torchvision's ResNet-50 (1000 outputs) with ``MSELoss`` against one-hot
targets. This task reads a class folder (``gputrain data make classfolder``) and keeps the model's
1000 outputs whatever the number of folders (``data.num_classes`` must be at least that number);
accuracy is reported as for cross-entropy classification.
Recipe: ``task: gputrain.tasks.onehot_mse:build`` (resnet50-model-parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gputrain.config import RunConfig
from gputrain.models import build_configured_model
from gputrain.tasks import classification
from gputrain.tasks.base import Task
from gputrain.tasks.classification import ClassificationTask
from gputrain.tasks.spec import TaskSpec


class OneHotMSETask(ClassificationTask):
    """``mse_loss(outputs, one_hot(labels))`` over ``num_classes`` outputs; accuracy from the argmax.

    Predictions and pictures are those of classification (the argmax's class and softmax score).
    """

    def __init__(self, num_classes: int, *, class_names: list[str] | None = None) -> None:
        super().__init__(num_classes, class_names=class_names)
        self.criterion = None  # the loss is this class's own

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        if outputs.shape[-1] != self.num_classes:
            raise ValueError(f"the model returns {outputs.shape[-1]} outputs but data.num_classes={self.num_classes}; "
                             "set model.kwargs.num_classes and data.num_classes to the same value")
        return F.mse_loss(outputs, F.one_hot(targets, self.num_classes).to(outputs.dtype))



def for_prediction(cfg: RunConfig, *, annotations: str = "") -> tuple[Task, Callable[[torch.Tensor], Any]]:
    """Classification's prediction over this task's ``num_classes`` outputs (class names from the folders)."""
    task, preprocess = classification.for_prediction(cfg, annotations=annotations)
    return OneHotMSETask(int(cfg.model.kwargs.get("num_classes") or cfg.data.num_classes or 1000),
                         class_names=task.class_names), preprocess


def build(cfg: RunConfig) -> TaskSpec:
    from gputrain.data.classfolder import classification_transform, split_classfolder

    if cfg.data.val_root:
        raise ValueError("data.val_root is not read by gputrain.tasks.onehot_mse; it splits data.root by "
                         "data.val_fraction, so leave data.val_root empty")
    size = cfg.data.image_size or 224
    train, val = split_classfolder(cfg.data.root, val_fraction=cfg.data.val_fraction, seed=cfg.data.split_seed,
                                   train_transform=classification_transform(size, train=cfg.data.augment),
                                   val_transform=classification.eval_preprocess(cfg))
    found = len(train.dataset.classes)  # type: ignore[attr-defined]  # a torchvision ImageFolder
    num_classes = cfg.data.num_classes or 1000
    if num_classes < found:
        raise ValueError(f"data.num_classes={num_classes} but {cfg.data.root} has {found} class folders; "
                         f"use at least {found}")
    model = build_configured_model(cfg.model, "resnet50", kind="classification", num_classes=num_classes,
                                   input_size=(size, size))
    return TaskSpec(task=OneHotMSETask(num_classes, class_names=train.dataset.classes),  # type: ignore[attr-defined]
                    model=model, train_data=train, val_data=val,
                    example_input=val[0][0].unsqueeze(0))
