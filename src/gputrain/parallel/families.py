"""torchvision's classification families as chains of blocks, read off each family's own ``forward``.

Most of torchvision's classifiers compute ``head(pool(trunk(x)))`` where the trunk is an ``nn.Sequential`` (or a
``ModuleList`` run in order). Each family's chain below is its ``forward`` written as a list: attribute names of the
model, a trailing ``*`` where the attribute's children become blocks of their own (so a split can fall inside the
trunk, between stages of the network), and the stateless glue its ``forward`` calls inline (a flatten, a pool, a
mean). Only the exact classes are matched: a subclass may have its own ``forward``. The chain is checked against
the model's ``forward`` on the first batch anyway (:func:`gputrain.parallel.chain_check.check_blocks`).

ResNet, ResNeXt and Wide ResNet are :class:`torchvision.models.ResNet`, handled in :mod:`gputrain.parallel.blocks`.
DeepLabv3 and FCN built without their auxiliary head (``aux_loss=False``) are chains too: the backbone's children,
the head on the last feature, and the upsample to the input size, which a tuple state carries (their forward
returns ``{"out": logits}``; the chain returns the logits, which every task reads the same).
Not chains, and refused: ViT (a class token joins the patches), GoogLeNet and Inception v3 (an input transform and
auxiliary branches), segmentation models with an auxiliary head (it reads an earlier feature) and LR-ASPP (its head
reads a low-level feature too), and the detection models (a list of images in, a list of dicts out).
"""

from __future__ import annotations

import torch
import torchvision
from torch import nn

from gputrain.nn.chain import Block, First, StartWithSize, Upsample


class _SpatialMean(nn.Module):
    """``x.mean([2, 3])``, as ShuffleNetV2 and MNASNet pool inline."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean([2, 3])


def _flatten() -> nn.Module:
    return nn.Flatten(1)  # torch.flatten(x, 1), as the forwards call it between pool and head


def _pool() -> nn.Module:
    return nn.AdaptiveAvgPool2d((1, 1))  # F.adaptive_avg_pool2d(x, (1, 1)) inline


M = torchvision.models
CHAINS: dict[type[nn.Module], tuple[object, ...]] = {
    M.VGG: ("features*", "avgpool", _flatten, "classifier"),
    M.AlexNet: ("features*", "avgpool", _flatten, "classifier"),
    M.MobileNetV2: ("features*", _pool, _flatten, "classifier"),
    M.MobileNetV3: ("features*", "avgpool", _flatten, "classifier"),
    M.EfficientNet: ("features*", "avgpool", _flatten, "classifier"),
    M.ConvNeXt: ("features*", "avgpool", "classifier"),
    M.RegNet: ("stem", "trunk_output*", "avgpool", _flatten, "fc"),
    M.DenseNet: ("features*", nn.ReLU, _pool, _flatten, "classifier"),
    M.ShuffleNetV2: ("conv1", "maxpool", "stage2", "stage3", "stage4", "conv5", _SpatialMean, "fc"),
    M.MNASNet: ("layers*", _SpatialMean, "classifier"),
    M.SqueezeNet: ("features*", "classifier", _flatten),
    M.SwinTransformer: ("features*", "norm", "permute", "avgpool", "flatten", "head"),
    M.MaxVit: ("stem", "blocks*", "classifier"),
}
"""Each family's ``forward`` as a chain: names of its attributes (``*``: its children, one block each) and glue."""

GLUE_NAMES = {_flatten: "flatten", _pool: "pool", nn.ReLU: "relu", _SpatialMean: "mean"}

NOT_CHAINS = (M.VisionTransformer, M.GoogLeNet, M.Inception3)


SEGMENTATION_CHAINS = (torchvision.models.segmentation.DeepLabV3, torchvision.models.segmentation.FCN)


def _segmentation_blocks(model: nn.Module) -> list[Block]:
    trunk, head = model.get_submodule("backbone"), model.get_submodule("classifier")
    backbone = list(trunk.named_children())  # an IntermediateLayerGetter: its children run in order
    blocks: list[Block] = [(f"backbone_{backbone[0][0]}", StartWithSize(backbone[0][1]))]
    blocks += [(f"backbone_{name}", First(module)) for name, module in backbone[1:]]
    return [*blocks, ("classifier", First(head)), ("upsample", Upsample())]


def family_blocks(model: nn.Module) -> list[Block] | None:
    """The chain of a torchvision model of a known family, or None for any other model."""
    if type(model) in SEGMENTATION_CHAINS and model.aux_classifier is None:
        return _segmentation_blocks(model)
    steps = CHAINS.get(type(model))
    if steps is None:
        return None
    blocks: list[Block] = []
    for step in steps:
        if callable(step):
            blocks.append((GLUE_NAMES[step], step()))
        elif str(step).endswith("*"):
            name = str(step)[:-1]
            blocks += [(f"{name}_{child}", module) for child, module in getattr(model, name).named_children()]
        else:
            blocks.append((str(step), getattr(model, str(step))))
    return blocks


def is_known_non_chain(model: nn.Module) -> bool:
    """A torchvision model whose forward is no chain of blocks (refused by the splitting strategies)."""
    module = type(model).__module__
    return isinstance(model, NOT_CHAINS) or module.startswith(("torchvision.models.detection",
                                                               "torchvision.models.segmentation"))
