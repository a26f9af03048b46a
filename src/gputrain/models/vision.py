"""Vision models built from torchvision with ``weights=None``: the builders never download.

Pretrained weights are applied after building, by ``model.weights`` (:mod:`gputrain.models.pretrained`,
fetched once per node by the launcher) or from a local file (``weights_path``); both load with
``torch.load(..., weights_only=True)`` so a malicious pickle cannot run code. Model code
knows nothing about parallelism; strategies wrap these modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

AUTOENCODER_STRIDE = 20
"""The encoder pools by 4 then 5, so input sides must be multiples of 20 to reconstruct exactly."""


def load_weights(model: nn.Module, weights_path: str | Path | None) -> nn.Module:
    """Load a local state dict into ``model`` (no-op for None) and return ``model``.

    Accepts a plain state dict or a checkpoint dict holding one under ``"model"``; keys may
    carry DDP's ``module.`` prefix. Missing ``num_batches_tracked`` buffers are allowed
    (checkpoints saved with FrozenBatchNorm, e.g. torchvision's detection weights, have none).
    """
    if weights_path is None:
        return model
    path = Path(weights_path)
    if not path.is_file():
        raise FileNotFoundError(f"weights_path={str(path)!r} does not exist; pass a local state_dict file")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise TypeError(f"weights_path={str(path)!r} holds a {type(state).__name__}, not a state_dict")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    hint = "check num_classes and the architecture options match the saved model"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches raise even with strict=False
        raise RuntimeError(f"weights_path={str(path)!r}: {e}; {hint}") from e
    missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"weights_path={str(path)!r} does not fit {type(model).__name__}: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {result.unexpected_keys[:5]} ({len(result.unexpected_keys)} "
            f"in all); {hint}"
        )
    return model


class ConvAutoencoder(nn.Module):
    """A small convolutional autoencoder: 3xHxW -> 16x(H/20)x(W/20) -> 3xHxW.

    The decoder ends in ReLU, so reconstructions are non-negative (inputs in [0, 1]).
    """

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 8, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(4, 4),
            nn.Conv2d(8, 16, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(5, 5),
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(16, 8, 5, stride=5),
            nn.ReLU(),
            nn.ConvTranspose2d(8, 3, 5, stride=4, padding=1, output_padding=1),
            nn.ReLU(),
        )

    def chain_blocks(self) -> list[tuple[str, nn.Module]]:
        """Its forward as a chain (:mod:`gputrain.nn.chain`): encoder, then decoder."""
        return [("encoder", self.encoder), ("decoder", self.decoder)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"ConvAutoencoder expects (N, 3, H, W) images, got shape {tuple(x.shape)}")
        h, w = x.shape[-2:]
        if h % AUTOENCODER_STRIDE or w % AUTOENCODER_STRIDE:
            raise ValueError(
                f"ConvAutoencoder input size {h}x{w} is not a multiple of {AUTOENCODER_STRIDE} in both sides "
                f"(pooling by 4 then 5); resize or crop images to a multiple of {AUTOENCODER_STRIDE}, "
                f"e.g. {max(1, h // AUTOENCODER_STRIDE) * AUTOENCODER_STRIDE}x"
                f"{max(1, w // AUTOENCODER_STRIDE) * AUTOENCODER_STRIDE}"
            )
        return self.decoder(self.encoder(x))


def conv_autoencoder(weights_path: str | Path | None = None) -> ConvAutoencoder:
    """The :class:`ConvAutoencoder`, optionally with local weights."""
    model = ConvAutoencoder()
    load_weights(model, weights_path)
    return model


def resnet18_classifier(
    num_classes: int = 10, cifar_stem: bool = True, weights_path: str | Path | None = None
) -> nn.Module:
    """ResNet-18 with ``num_classes`` outputs.

    ``cifar_stem`` swaps the 7x7 stride-2 conv and the max-pool (meant for 224 px ImageNet
    images) for one 3x3 stride-1 conv, the usual adaptation to 32 px images: otherwise a
    CIFAR image is down to 8x8 before the first residual block.
    """
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if cifar_stem:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    load_weights(model, weights_path)
    return model


def resnet50_classifier(num_classes: int = 1000, weights_path: str | Path | None = None) -> nn.Module:
    """torchvision's ResNet-50 with ``num_classes`` outputs."""
    model = torchvision.models.resnet50(weights=None, num_classes=num_classes)
    load_weights(model, weights_path)
    return model


_BACKBONE_LAYERS = ["layer4", "layer3", "layer2", "layer1", "conv1"]
MASKRCNN_BACKBONES = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
"""ResNets Mask R-CNN can sit on; resnet50 is torchvision's ``maskrcnn_resnet50_fpn`` itself."""


def maskrcnn(
    num_classes: int,
    weights_path: str | Path | None = None,
    *,
    backbone: str = "resnet50",
    min_size: int = 800,
    max_size: int = 1333,
    trainable_backbone_layers: int | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Mask R-CNN with a ResNet-FPN backbone, randomly initialized (or from ``weights_path``).

    ``num_classes`` counts the background class. ``backbone="resnet50"`` (the default) is
    exactly torchvision's ``maskrcnn_resnet50_fpn``; another ResNet (e.g. ``resnet18`` for
    CPU tests) is built the same way: trainable BatchNorm (no pretrained statistics to
    freeze) under the same FPN and heads. ``min_size``/``max_size`` are the resize bounds of
    the model's transform (small values make CPU tests fast).
    ``trainable_backbone_layers`` (0-5, counted from layer4 down to conv1) freezes the rest
    of the backbone; torchvision itself ignores it without pretrained weights, so it is
    applied here. Frozen layers keep plain BatchNorm, whose running stats still update in
    train mode. Other keyword arguments go to torchvision's ``MaskRCNN``.
    """
    detection = torchvision.models.detection
    if backbone == "resnet50":
        model = detection.maskrcnn_resnet50_fpn(
            weights=None,
            weights_backbone=None,
            num_classes=num_classes,
            min_size=min_size,
            max_size=max_size,
            **kwargs,
        )
    elif backbone in MASKRCNN_BACKBONES:
        # What maskrcnn_resnet50_fpn does without pretrained weights: plain BatchNorm
        # (resnet_fpn_backbone defaults to FrozenBatchNorm2d) and every layer trainable.
        fpn = detection.backbone_utils.resnet_fpn_backbone(
            backbone_name=backbone, weights=None, norm_layer=nn.BatchNorm2d, trainable_layers=5
        )
        model = detection.MaskRCNN(fpn, num_classes=num_classes, min_size=min_size, max_size=max_size, **kwargs)
    else:
        raise ValueError(f"maskrcnn(backbone={backbone!r}) is unknown; choose one of {MASKRCNN_BACKBONES}")
    load_weights(model, weights_path)
    if trainable_backbone_layers is not None:
        if not 0 <= trainable_backbone_layers <= 5:
            raise ValueError(f"trainable_backbone_layers={trainable_backbone_layers} must be within 0..5")
        # The same layer choice as torchvision's _resnet_fpn_extractor (bn1 trains with conv1).
        train = tuple(_BACKBONE_LAYERS[:trainable_backbone_layers])
        if trainable_backbone_layers == 5:
            train += ("bn1",)
        for name, param in model.backbone.body.named_parameters():
            if not name.startswith(train):
                param.requires_grad_(False)
    return model
