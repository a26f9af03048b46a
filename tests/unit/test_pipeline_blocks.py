"""Pipeline blocks: the chain of blocks equals the model's forward, its stages save weights the plain model loads,
models that cannot be split get a one-line fix, and per-block profiling measures bytes and leaves the model as it
was. The partitioner's arithmetic: test_partition.py."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from gputrain.models.deeplabv3plus import DeepLabV3Plus
from gputrain.models.vision import ConvAutoencoder, resnet18_classifier
from gputrain.parallel import (
    block_key_map,
    check_blocks,
    profile_blocks,
    run_blocks,
    sequential_blocks,
    split_stages,
    to_model_state_dict,
)
from resnet_blocks import RESNET_BLOCKS


def small_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)
    )


# --- blocks: the chain equals the model --------------------------------------------------------


def deeplab18() -> nn.Module:
    return DeepLabV3Plus(3, backbone="resnet18", aspp_channels=8, decoder_channels=8)


def deeplab50() -> nn.Module:
    return DeepLabV3Plus(3, backbone="resnet50", output_stride=16, aspp_channels=8, decoder_channels=8)


MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (2, 3, 64, 64)),
    "resnet18_cifar": (lambda: resnet18_classifier(num_classes=10), (2, 3, 32, 32)),
    "sequential": (small_cnn, (2, 3, 8, 8)),
    "autoencoder": (ConvAutoencoder, (2, 3, 40, 60)),
    "deeplab18": (deeplab18, (2, 3, 65, 63)),  # odd sizes: the carried size must reach the upsample
    "deeplab50": (deeplab50, (2, 3, 64, 64)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_blocks_compute_the_model_forward(name):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model, x = build().train(), torch.rand(shape)
    blocks = sequential_blocks(model)
    # Train mode: BatchNorm uses batch statistics; ASPP's dropout draws the same mask from the same seed.
    torch.manual_seed(1)
    want = model(x)
    torch.manual_seed(1)
    assert torch.equal(run_blocks(blocks, x), want)
    torch.manual_seed(1)
    state = x
    for stage in split_stages(blocks, [len(blocks) // 2]):  # as a pipeline calls stages: tuples spread
        state = stage(*state) if isinstance(state, tuple) else stage(state)
    assert torch.equal(state, want)
    assert check_blocks(model, blocks, x) == 0.0


def test_resnet_blocks_and_stage_keys_are_the_model_names():
    model = torchvision.models.resnet18(weights=None)
    blocks = sequential_blocks(model)
    assert [n for n, _ in blocks] == RESNET_BLOCKS
    stages = split_stages(blocks, [6])
    assert set(stages[0].state_dict()) | set(stages[1].state_dict()) == set(model.state_dict())
    assert all(k == v for k, v in block_key_map(model, blocks).items())


@pytest.mark.parametrize("build", [lambda: torchvision.models.resnet18(weights=None), deeplab18])
def test_split_model_saves_weights_the_plain_model_loads_strictly(build):
    torch.manual_seed(0)
    model = build()
    blocks = sequential_blocks(model)
    key_map = block_key_map(model, blocks)
    stages = split_stages(blocks, [4, 9])
    with torch.no_grad():  # tell the copies apart from a fresh model
        for p in model.parameters():
            p.add_(1.0)
    saved = to_model_state_dict([s.state_dict() for s in stages], key_map)
    torch.manual_seed(1)
    plain = build()
    plain.load_state_dict(saved, strict=True)
    assert all(torch.equal(v, saved[k]) for k, v in plain.state_dict().items())


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Reversed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(self.second(x))


def test_unknown_models_get_a_one_line_fix():
    with pytest.raises(
        ValueError, match=r"cannot split Custom .*nn\.Sequential, or give parallel\.split_points"
    ):
        sequential_blocks(Custom())
    model = Reversed()
    blocks = sequential_blocks(model, children_in_order=True)  # the user vouches for the order...
    assert [n for n, _ in blocks] == ["first", "second"]
    with pytest.raises(ValueError, match="do not run in order"):  # ...and an example input checks it
        check_blocks(model, blocks, torch.rand(3, 4))
    resnet = torchvision.models.resnet18(weights=None)
    with pytest.raises(ValueError, match=r"belong to no block \(e\.g\. 'fc\.bias'\)"):
        block_key_map(resnet, sequential_blocks(resnet)[:-1])


# --- profiling ---------------------------------------------------------------------------------


def test_profile_measures_bytes_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = small_cnn().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    blocks = sequential_blocks(model)
    costs = profile_blocks(blocks, torch.rand(4, 3, 8, 8), device="cpu", repeats=2)
    conv, bn, relu, flatten, linear = costs
    assert [c.name for c in costs] == ["0", "1", "2", "3", "4"]
    assert (
        conv.params == 8 * 3 * 9 + 8
        and conv.param_bytes == conv.grad_bytes == conv.optimizer_bytes == 4 * 224
    )
    assert conv.activation_bytes == 4 * 3 * 8 * 8 * 4  # conv saves its input (weights are not activations)
    assert conv.output_bytes == relu.activation_bytes == 4 * 8 * 6 * 6 * 4  # ReLU saves its output
    assert bn.activation_bytes >= conv.output_bytes  # BatchNorm saves its input (and batch statistics)
    assert flatten.activation_bytes == linear.activation_bytes == 0  # Linear's input is ReLU's, counted there
    assert all(c.forward_backward_s > 0 and c.peak_bytes is None for c in costs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # running stats untouched
    assert not model.training and not model[1].training and all(p.grad is None for p in model.parameters())
    adam = profile_blocks(
        blocks, torch.rand(4, 3, 8, 8), device="cpu", optimizer="adam", repeats=1, clock="cpu"
    )
    assert adam[4].optimizer_bytes == 2 * adam[4].param_bytes and adam[4].forward_backward_s > 0


def test_profile_refuses_bad_arguments():
    blocks = sequential_blocks(small_cnn())
    with pytest.raises(ValueError, match="optimizer='lamb'"):
        profile_blocks(blocks, torch.rand(2, 3, 8, 8), device="cpu", optimizer="lamb")
    with pytest.raises(
        ValueError, match=r"block '0' is on \['cpu'\] but device=meta; move the model there first"
    ):
        profile_blocks(blocks, torch.rand(2, 3, 8, 8), device="meta")
