"""model.freeze and model.frozen_batchnorm: what stays fixed, and that parity and evaluation hold with them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from forked_cli import run_gputrain
from gputrain.config import ModelConfig
from gputrain.models import build_configured_model

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def _resnet18(**model: object) -> nn.Module:
    return build_configured_model(ModelConfig(name="resnet18", kwargs={"cifar_stem": True}, **model), "resnet18",
                                  num_classes=10)


def test_a_frozen_backbone_trains_only_the_head_and_keeps_its_statistics_in_train_mode():
    model = _resnet18(freeze=["backbone"])
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(4, 3, 32, 32) * 5 + 3).sum().backward()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # train-mode forward changed no statistic


def test_named_blocks_freeze_and_the_rest_trains():
    model = _resnet18(freeze=["conv1", "bn1", "layer1"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.split(".")[0] in ("conv1", "bn1", "layer1")}
    assert isinstance(model.layer1[0].bn1, FrozenBatchNorm2d) and isinstance(model.layer2[0].bn1, nn.BatchNorm2d)


def test_an_unknown_block_is_one_line_naming_the_children():
    with pytest.raises(ValueError, match=r"^model.freeze: ResNet has no block 'layer9'; give dotted names of its "
                                         r"modules \(its children: conv1, bn1, relu, maxpool, layer1,"):
        _resnet18(freeze=["layer9"])


def test_frozen_batchnorm_replaces_every_batchnorm_of_mask_rcnn_keeping_its_tensors():
    torch.manual_seed(0)
    cfg = ModelConfig(name="maskrcnn_resnet50_fpn", kwargs={"backbone": "resnet18", "min_size": 64, "max_size": 64})
    plain = build_configured_model(cfg, "maskrcnn_resnet50_fpn", num_classes=3)
    torch.manual_seed(0)
    cfg.frozen_batchnorm = True
    frozen = build_configured_model(cfg, "maskrcnn_resnet50_fpn", num_classes=3)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in frozen.modules())
    assert any(isinstance(m, FrozenBatchNorm2d) for m in frozen.modules())
    plain_state = plain.state_dict()
    for key, value in frozen.state_dict().items():
        assert torch.equal(value, plain_state[key]), key


def _train_args(out: Path, data: Path, weights: Path, *flags: str) -> list[str]:
    return ["train", "cifar10-resnet18", "--strategy", "ddp", "--epochs", "1", "--data-root", str(data), "--out",
            str(out), f"model.weights={weights}", "model.freeze=[backbone]", "trainer.max_steps_per_epoch=2",
            "trainer.pictures=0", "trainer.progress_bar=false", "trainer.loggers=[]", "data.augment=false", *flags]


def _train(out: Path, data: Path, weights: Path, *flags: str) -> None:
    done = run_gputrain(_train_args(out, data, weights, *flags), env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr


def test_fine_tuning_a_frozen_backbone_keeps_it_and_two_processes_equal_one(tmp_path, monkeypatch):
    from gputrain.cli import main
    from gputrain.tools.make_data import make_dataset

    # The one-process commands (data make, the 1-process run, eval) run in this process: gputrain.cli.main and the
    # function of data make, the commands' code without a new interpreter's seconds of imports each. The 2-process
    # run is a real gputrain launcher with real torchrun workers.
    data = make_dataset("cifar10", tmp_path / "cifar", count=40)
    torch.manual_seed(3)
    start = torchvision.models.resnet18(weights=None).state_dict()
    start = {k: (torch.randn_like(v) * 0.05 if v.is_floating_point() else v) for k, v in start.items()}
    start.update({k: v.abs() + 0.5 for k, v in start.items() if k.endswith("running_var")})
    torch.save(start, tmp_path / "start.pth")
    assert main(_train_args(tmp_path / "one", data, tmp_path / "start.pth", "--devices", "1", "--batch-size", "8")) == 0
    _train(tmp_path / "two", data, tmp_path / "start.pth", "--devices", "2", "--batch-size", "4")
    one = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=True)["model"]
    two = torch.load(tmp_path / "two" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for key, value in start.items():  # conv1 is the CIFAR stem's: another shape, fresh and frozen
        if not key.startswith(("fc.", "conv1.")) and not key.endswith("num_batches_tracked"):
            assert torch.equal(one[key], value), key
    assert not torch.equal(one["fc.weight"], two["fc.weight"] * 0)  # the head trained
    torch.testing.assert_close(one["fc.weight"], two["fc.weight"], rtol=0, atol=1e-6)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no_home"))
    # rebuilt with FrozenBatchNorm; the start weights are not fetched again
    assert main(["eval", "--checkpoint", str(tmp_path / "two" / "checkpoints" / "last.pt"), "--out",
                 str(tmp_path / "eval")]) == 0


def test_pretrained_tensors_get_their_own_learning_rate_and_the_head_keeps_lr(tmp_path):
    from gputrain.config import OptimConfig
    from gputrain.optim import build_optimizer

    torch.save(torchvision.models.resnet18(weights=None).state_dict(), tmp_path / "start.pth")
    model = _resnet18(weights=str(tmp_path / "start.pth"), freeze=["layer1"])
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.2, pretrained_lr_scale=0.1))
    head, pretrained = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert head["lr"] == 0.2 and {names[id(p)] for p in head["params"]} == {"conv1.weight", "fc.weight", "fc.bias"}
    assert pretrained["lr"] == pytest.approx(0.02)
    assert {names[id(p)] for p in pretrained["params"]} == {
        n for n, p in model.named_parameters() if p.requires_grad and n not in ("conv1.weight", "fc.weight", "fc.bias")}
    with pytest.raises(ValueError, match=r"^optim.pretrained_lr_scale=0.1 scales the tensors model.weights loaded, "
                                         r"and this model has none; set model.weights"):
        build_optimizer(_resnet18(), OptimConfig(lr=0.2, pretrained_lr_scale=0.1))


def test_a_frozen_batchnorm_keeps_each_tensor_of_the_one_it_replaces_and_its_eval_outputs():
    from gputrain.models.finetune import freeze_batchnorm

    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3), nn.ReLU())
    bn = model[1]
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0, 1.5]))
        bn.bias.copy_(torch.tensor([0.125, -0.25, 0.375, 0.0]))
        bn.running_mean.copy_(torch.tensor([1.0, -1.0, 0.5, 0.0]))
        bn.running_var.copy_(torch.tensor([4.0, 0.25, 1.0, 9.0]))
    x = torch.randn(2, 3, 8, 8)
    expected = model.eval()(x)
    freeze_batchnorm(model)
    frozen = model[1]
    assert isinstance(frozen, FrozenBatchNorm2d) and frozen.eps == 1e-3
    assert frozen.weight.tolist() == [0.5, 2.0, -1.0, 1.5] and frozen.bias.tolist() == [0.125, -0.25, 0.375, 0.0]
    assert frozen.running_mean.tolist() == [1.0, -1.0, 0.5, 0.0]
    assert frozen.running_var.tolist() == [4.0, 0.25, 1.0, 9.0]
    torch.testing.assert_close(model.train()(x), expected)  # the same in train mode: nothing left to update
