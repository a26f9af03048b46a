"""Segmentation's loss keeps the same gradient at every scale, and a crop of ignored pixels adds zero, not NaN.

Images whose counted (not ignored) pixels differ in number are where a per-batch pixel mean breaks parity:
it weighs a rank's images by their counted pixels, so 2 ranks averaging their means differ from 1 process.
"""

from __future__ import annotations

import torch
from torch import nn

from autoencoder_runs import _max_diff
from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.data.ade20k import IGNORE_INDEX
from gputrain.tasks.segmentation import SegmentationTask
from multiproc import run_ranks


class _Masks(torch.utils.data.Dataset):
    """16 images of 8x8 pixels; image i has i*4 ignored pixels, and image 15 is all ignored."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        image = torch.rand(3, 8, 8, generator=g)
        target = torch.randint(0, 3, (8, 8), generator=g)
        target.view(-1)[: 4 * i if i < 15 else 64] = IGNORE_INDEX
        return image, target


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))


def _train(out: str, strategy: str, devices: int, batch_size: int, accumulate: int = 1) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.5)), strategy=strategy, devices=devices,
                      accelerator="cpu", batch_size=batch_size, accumulate_grad_batches=accumulate, epochs=2,
                      out=out, progress_bar=False, loggers=[], log_every_n_steps=1, enable_checkpointing=False,
                      pictures=0)
    trainer.fit(_net(), _Masks(), task=SegmentationTask(num_classes=3))
    return {k: v.clone() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}


def _ddp_worker(info, out: str):
    return _train(out, "ddp", 2, 4)


def test_a_batch_of_ignored_pixels_adds_zero_loss_and_zero_gradient():
    task, net = SegmentationTask(num_classes=3), _net()
    image = torch.rand(2, 3, 8, 8)
    loss = task.loss(net(image), torch.full((2, 8, 8), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in net.parameters())


def test_an_evaluation_batch_of_ignored_pixels_has_loss_zero_not_nan():
    # The evaluator weighs the batch loss by its counted pixels (here 0), so 0 adds nothing; NaN would poison val/loss.
    _, loss = SegmentationTask(num_classes=3).evaluate_batch(_net(), torch.rand(2, 3, 8, 8),
                                                             torch.full((2, 8, 8), IGNORE_INDEX))
    assert loss is not None and loss.item() == 0.0


def test_the_loss_of_a_batch_is_the_mean_of_its_images_losses():
    # What the strategies rely on: a micro-batch's loss weighted by its share of samples sums to the batch's.
    task, net, data = SegmentationTask(num_classes=3), _net(), _Masks()
    images, targets = (torch.stack(x) for x in zip(*(data[i] for i in range(12, 16)), strict=True))
    with torch.no_grad():
        whole = task.loss(net(images), targets)
        one_and_three = task.loss(net(images[:1]), targets[:1]) / 4 + task.loss(net(images[1:]), targets[1:]) * 3 / 4
    assert torch.isfinite(whole)
    assert abs(whole.item() - one_and_three.item()) <= 1e-6 * abs(whole.item())


def test_two_ranks_and_accumulation_match_one_process_where_images_count_different_pixels(tmp_path):
    single = _train(str(tmp_path / "single"), "single", 1, 8)
    assert _max_diff(single, _net().state_dict()) > 1e-3, "training must move the weights for the test to mean anything"
    accumulated = _train(str(tmp_path / "acc"), "single", 1, 4, accumulate=2)
    assert _max_diff(accumulated, single) <= 1e-5
    ddp = run_ranks(_ddp_worker, str(tmp_path / "ddp"))
    assert _max_diff(ddp[0], single) <= 1e-5
