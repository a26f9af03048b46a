"""Fine-tuning controls applied to a built model: frozen blocks (``model.freeze``) and frozen BatchNorm.

A frozen block's parameters stop training (``requires_grad=False``) and its BatchNorm layers become
``torchvision.ops.FrozenBatchNorm2d``: statistics and affine terms fixed, the same in train and eval mode, so
``model.train()`` cannot start updating the pretrained statistics of a block that is meant to stay as it was.
``model.frozen_batchnorm=true`` does the BatchNorm part for the whole model, as torchvision's detection
references do for Mask R-CNN's backbone (whose small per-GPU batches make batch statistics noisy).
Both change the module tree, so evaluation and export rebuild the model with them before loading a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torchvision.ops import FrozenBatchNorm2d

HEADS = ("fc", "classifier", "roi_heads")
"""Children that ``backbone`` leaves out on a model without a ``backbone`` attribute (a torchvision ResNet)."""


def _blocks(model: nn.Module, name: str) -> list[nn.Module]:
    if name == "backbone" and not hasattr(model, "backbone"):
        return [m for n, m in model.named_children() if n not in HEADS]
    try:
        return [model.get_submodule(name)]
    except AttributeError:
        children = ", ".join(n for n, _ in model.named_children())
        raise ValueError(f"model.freeze: {type(model).__name__} has no block {name!r}; give dotted names of its "
                         f"modules (its children: {children}) or backbone") from None


def freeze_batchnorm(module: nn.Module, only: set[int] | None = None) -> None:
    """Replace each ``BatchNorm2d`` under ``module`` (those in ``only``, by id, if given) with a
    ``FrozenBatchNorm2d`` holding the same tensors."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.BatchNorm2d) and (only is None or id(child) in only):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
            if child.affine:
                frozen.weight.copy_(child.weight.detach())
                frozen.bias.copy_(child.bias.detach())
            if child.running_mean is not None and child.running_var is not None:
                frozen.running_mean.copy_(child.running_mean)
                frozen.running_var.copy_(child.running_var)
            setattr(module, name, frozen)
        else:
            freeze_batchnorm(child, only)


def apply_finetuning(model: nn.Module, freeze: Sequence[str], frozen_batchnorm: bool) -> nn.Module:
    """Freeze the named blocks (parameters and BatchNorm), then, if asked, every remaining BatchNorm."""
    inside: set[int] = set()
    for name in freeze:
        for block in _blocks(model, name):
            block.requires_grad_(False)
            inside.update(id(m) for m in block.modules())
    if inside:
        freeze_batchnorm(model, only=inside)  # from the root: a frozen block may itself be a BatchNorm (bn1)
    if frozen_batchnorm:
        freeze_batchnorm(model)
    return model
