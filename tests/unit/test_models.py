"""Model shapes, the autoencoder's size rule, local weight loading; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

from gputrain.models.deeplabv3plus import DeepLabV3Plus
from gputrain.models.vision import (
    ConvAutoencoder,
    conv_autoencoder,
    load_weights,
    maskrcnn,
    resnet18_classifier,
    resnet50_classifier,
)


def test_autoencoder_architecture_and_reconstruction_size():
    model = conv_autoencoder()
    assert [type(m).__name__ for m in model.encoder] == [
        "Conv2d",
        "ReLU",
        "MaxPool2d",
        "Conv2d",
        "ReLU",
        "MaxPool2d",
    ]
    assert [type(m).__name__ for m in model.decoder] == ["ConvTranspose2d", "ReLU", "ConvTranspose2d", "ReLU"]
    x = torch.rand(2, 3, 80, 60)
    assert model.encoder(x).shape == (2, 16, 4, 3)
    assert model(x).shape == x.shape


def test_autoencoder_rejects_sizes_not_divisible_by_20():
    with pytest.raises(ValueError, match=r"32x32 is not a multiple of 20.*e\.g\. 20x20"):
        ConvAutoencoder()(torch.rand(1, 3, 32, 32))


def test_resnet_classifiers_shapes():
    cifar = resnet18_classifier(num_classes=10)
    assert cifar.conv1.kernel_size == (3, 3) and cifar.conv1.stride == (1, 1)
    assert isinstance(cifar.maxpool, torch.nn.Identity)
    assert cifar.eval()(torch.rand(2, 3, 32, 32)).shape == (2, 10)
    imagenet = resnet18_classifier(num_classes=7, cifar_stem=False)
    assert imagenet.conv1.kernel_size == (7, 7)
    assert resnet50_classifier(num_classes=3).fc.out_features == 3


def test_deeplabv3plus_output_matches_input_size():
    model = DeepLabV3Plus(5, backbone="resnet18", aspp_channels=16, decoder_channels=16)
    assert model.output_stride == 32
    x = torch.rand(2, 3, 65, 97)  # odd sizes: the final upsample must land on the input size
    assert model(x).shape == (2, 5, 65, 97)
    with torch.no_grad():
        assert model.eval()(x[:1]).shape == (1, 5, 65, 97)


def test_deeplabv3plus_dilated_bottleneck_and_clear_errors():
    model = DeepLabV3Plus(3, backbone="resnet50", output_stride=8, aspp_channels=8, decoder_channels=8).eval()
    with torch.no_grad():
        features = model.backbone(torch.rand(1, 3, 64, 64))
    assert features["out"].shape[-2:] == (8, 8) and features["low"].shape[1] == 256
    with pytest.raises(ValueError, match="BasicBlock does not support dilation"):
        DeepLabV3Plus(3, backbone="resnet18", output_stride=16)
    with pytest.raises(ValueError, match="unknown"):
        DeepLabV3Plus(3, backbone="vgg16")


def test_maskrcnn_train_mode_returns_losses():
    torch.manual_seed(0)
    model = maskrcnn(num_classes=3, min_size=96, max_size=128, trainable_backbone_layers=2).train()
    frozen = {n for n, p in model.backbone.body.named_parameters() if not p.requires_grad}
    assert "conv1.weight" in frozen and "layer2.0.conv1.weight" in frozen
    assert "layer3.0.conv1.weight" not in frozen
    masks = torch.zeros(1, 96, 96, dtype=torch.uint8)
    masks[0, 20:60, 30:70] = 1
    target = {"boxes": torch.tensor([[30.0, 20.0, 70.0, 60.0]]), "labels": torch.tensor([1]), "masks": masks}
    losses = model([torch.rand(3, 96, 96)], [target])
    assert {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"} <= set(
        losses
    )
    assert all(torch.isfinite(v) for v in losses.values())


def test_local_weights_load_and_mismatch_errors(tmp_path):
    source = resnet18_classifier(num_classes=4)
    path = tmp_path / "r18.pt"
    # A DDP-style prefix inside a checkpoint dict is accepted.
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)
    loaded = resnet18_classifier(num_classes=4, weights_path=str(path))
    for k, v in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(RuntimeError, match=r"(?s)r18.pt.*size mismatch.*check num_classes"):
        resnet18_classifier(num_classes=5, weights_path=str(path))
    with pytest.raises(RuntimeError, match="does not fit ConvAutoencoder.*check num_classes"):
        load_weights(ConvAutoencoder(), path)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        conv_autoencoder(weights_path=str(tmp_path / "missing.pt"))
    seg = DeepLabV3Plus(2, backbone="resnet18", aspp_channels=8, decoder_channels=8)
    torch.save(seg.state_dict(), tmp_path / "seg.pt")
    again = DeepLabV3Plus(
        2, backbone="resnet18", aspp_channels=8, decoder_channels=8, weights_path=tmp_path / "seg.pt"
    )
    assert torch.equal(again.classifier.weight, seg.classifier.weight)
