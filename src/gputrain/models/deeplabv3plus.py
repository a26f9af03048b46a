"""DeepLabv3+ (Chen et al., 2018) on a torchvision ResNet, reusing torchvision's ASPP.

Encoder: ResNet with dilated last stages (output stride 16 or 8) and ASPP. Decoder: the
low-level layer1 features reduced to 48 channels by a 1x1 conv, concatenated with the
ASPP output upsampled to their size, two 3x3 convs, a 1x1 classifier, and bilinear
upsampling to the input size. The forward pass returns logits ``(N, num_classes, H, W)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torchvision.models._utils import IntermediateLayerGetter
from torchvision.models.segmentation.deeplabv3 import ASPP

from gputrain.models.vision import load_weights
from gputrain.nn.chain import Block, First, StartWithSize, Upsample

BOTTLENECK_BACKBONES = ("resnet50", "resnet101")
"""Bottleneck blocks support dilation, so these reach output stride 16 or 8."""
BASIC_BACKBONES = ("resnet18", "resnet34")
"""BasicBlock refuses dilation in torchvision, so these run at output stride 32."""

# ASPP rates from the paper for OS 16 and 8 (doubled at 8, since features are twice as
# large); at OS 32 they are halved for the same reason.
DEFAULT_RATES = {8: (12, 24, 36), 16: (6, 12, 18), 32: (3, 6, 9)}



def _conv_bn_relu(cin: int, cout: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


def _backbone(name: str, output_stride: int) -> tuple[nn.Module, int, int]:
    """The ResNet trunk returning ``{"low": layer1, "out": layer4}``, and their channel counts."""
    if name in BOTTLENECK_BACKBONES:
        if output_stride not in (8, 16):
            raise ValueError(f"DeepLabV3Plus(backbone={name!r}, output_stride={output_stride}): use 8 or 16")
        dilate = [False, output_stride == 8, True]
        expansion = 4
    elif name in BASIC_BACKBONES:
        if output_stride != 32:
            raise ValueError(
                f"DeepLabV3Plus(backbone={name!r}, output_stride={output_stride}): torchvision's BasicBlock "
                "does not support dilation, so resnet18/34 run at output_stride=32; pass output_stride=32 "
                "(or None) or use resnet50/resnet101 for 16 or 8"
            )
        dilate = [False, False, False]
        expansion = 1
    else:
        raise ValueError(
            f"DeepLabV3Plus(backbone={name!r}) is unknown; choose one of {BASIC_BACKBONES + BOTTLENECK_BACKBONES}"
        )
    resnet = getattr(torchvision.models, name)(weights=None, replace_stride_with_dilation=dilate)
    trunk = IntermediateLayerGetter(resnet, return_layers={"layer1": "low", "layer4": "out"})
    return trunk, 64 * expansion, 512 * expansion


class DeepLabV3Plus(nn.Module):
    """DeepLabv3+ semantic segmentation; ``forward(x) -> logits`` at the input's size.

    ``output_stride`` defaults to 16 for resnet50/101 and 32 for resnet18/34.
    ``aspp_channels``/``decoder_channels`` (256 in the paper) can be shrunk for tests.
    In training mode the ASPP image-pooling branch has a BatchNorm over a 1x1 map, so the
    batch must hold at least 2 images.
    """

    def __init__(
        self,
        num_classes: int,
        backbone: str = "resnet50",
        output_stride: int | None = None,
        *,
        atrous_rates: Sequence[int] | None = None,
        aspp_channels: int = 256,
        decoder_channels: int = 256,
        low_level_channels: int = 48,
        weights_path: str | Path | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"DeepLabV3Plus(num_classes={num_classes}): need at least 1 class")
        if output_stride is None:
            output_stride = 32 if backbone in BASIC_BACKBONES else 16
        self.backbone, low_in, high_in = _backbone(backbone, output_stride)
        rates = list(atrous_rates if atrous_rates is not None else DEFAULT_RATES[output_stride])
        self.aspp = ASPP(high_in, rates, out_channels=aspp_channels)
        self.reduce = _conv_bn_relu(low_in, low_level_channels, 1)
        self.fuse = nn.Sequential(
            _conv_bn_relu(aspp_channels + low_level_channels, decoder_channels, 3),
            _conv_bn_relu(decoder_channels, decoder_channels, 3),
        )
        self.classifier = nn.Conv2d(decoder_channels, num_classes, 1)
        self.num_classes = num_classes
        self.output_stride = output_stride
        load_weights(self, weights_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"DeepLabV3Plus expects (N, C, H, W) images, got shape {tuple(x.shape)}")
        features = self.backbone(x)
        low = self.reduce(features["low"])
        high = self.aspp(features["out"])
        high = F.interpolate(high, size=low.shape[-2:], mode="bilinear", align_corners=False)
        logits = self.classifier(self.fuse(torch.cat([high, low], dim=1)))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)

    def chain_blocks(self) -> list[Block]:
        """Its forward as a chain (:mod:`gputrain.nn.chain`): conv1 ... layer1, reduce, layer2 ... layer4, aspp, fuse,
        classifier, upsample; a tuple state carries the low-level features and the input size."""
        trunk = self.backbone  # IntermediateLayerGetter: its children run in order
        children = list(trunk.named_children())
        blocks: list[Block] = [(children[0][0], StartWithSize(children[0][1]))]
        for name, module in children[1:]:
            blocks.append((name, First(module)))
            if name == "layer1":
                blocks.append(("reduce", _KeepLow(self.reduce)))
        blocks += [
            ("aspp", First(self.aspp)),
            ("fuse", _Fuse(self.fuse)),
            ("classifier", First(self.classifier)),
            ("upsample", Upsample()),
        ]
        return blocks


class _KeepLow(nn.Module):
    """DeepLabv3+: reduce layer1's features to the decoder's low-level branch, carried beside the trunk.

    Reducing right away (rather than after layer4, as the model's forward does) computes the same
    numbers and carries 48 channels between stages instead of 256.
    """

    def __init__(self, reduce: nn.Module) -> None:
        super().__init__()
        self.reduce = reduce

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        trunk, size = state
        return trunk, self.reduce(trunk), size


class _Fuse(nn.Module):
    """DeepLabv3+: upsample ASPP's output to the low-level size, concatenate, and fuse."""

    def __init__(self, fuse: nn.Module) -> None:
        super().__init__()
        self.fuse = fuse

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        high, low, size = state
        high = F.interpolate(high, size=low.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([high, low], dim=1)), size

