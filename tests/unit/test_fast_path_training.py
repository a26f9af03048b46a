"""The speed options (issue 16 item 1) in training: channels-last reaches every convolution and trains the same
weights, the fused optimizer trains alike, every option off is the plain PyTorch path bit for bit, and the summary
names the options that ran. What each option resolves to: test_fast_path.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autoencoder_runs import _Images, _max_diff, _train
from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.data.samplers import StepBatchSampler
from gputrain.models.vision import ConvAutoencoder
from gputrain.tasks.autoencoder import ReconstructionTask

OFF = dict(channels_last=False, compile=False, cudnn_benchmark=False, precision="32", async_checkpoint=False,
           reuse_host_memory=False)


def _conv_inputs(model: torch.nn.Module, memory_format: torch.memory_format) -> list[tuple[bool, bool]]:
    """(input is in ``memory_format``, weight is) at every convolution call, recorded by forward hooks."""
    seen: list[tuple[bool, bool]] = []
    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
            m.register_forward_pre_hook(lambda mod, args: seen.append(
                (args[0].is_contiguous(memory_format=memory_format),
                 mod.weight.is_contiguous(memory_format=memory_format))))
    return seen


@pytest.mark.parametrize("channels_last", [True, False])
def test_channels_last_reaches_every_convolution_in_training_and_evaluation(tmp_path, channels_last):
    torch.manual_seed(0)
    model = ConvAutoencoder()
    # A 1x1 feature map is both layouts at once, so each run checks the layout it asked for.
    seen = _conv_inputs(model, torch.channels_last if channels_last else torch.contiguous_format)
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.5)), strategy="single", batch_size=16, epochs=1,
                      out=str(tmp_path / "run"), progress_bar=False, loggers=[], channels_last=channels_last,
                      enable_checkpointing=False, pictures=0)
    trainer.fit(model, _Images(), _Images(), task=ReconstructionTask())
    calls = 4 * (64 // 16) * 2  # 4 convolutions, 4 training and 4 validation batches
    assert len(seen) == calls
    # The first convolution sees the batch as the loop delivered it; later ones what the previous layer made.
    assert seen == [(True, True)] * calls
    assert trainer.config_dict["trainer"]["channels_last"] is channels_last  # config.yaml says what ran


def test_channels_last_trains_the_same_weights(tmp_path):
    plain = _train(str(tmp_path / "a"), "single", 1, 16, channels_last=False)
    last = _train(str(tmp_path / "b"), "single", 1, 16, channels_last=True)
    assert _max_diff(plain, last) < 1e-5


def test_fused_optimizer_is_used_when_asked_and_trains_alike(tmp_path):
    torch.manual_seed(0)
    cfg = RunConfig(optim=OptimConfig(name="adam", lr=1e-3, fused=True))
    trainer = Trainer(cfg, strategy="single", batch_size=16, epochs=1, out=str(tmp_path / "f"), progress_bar=False,
                      loggers=[], enable_checkpointing=False, pictures=0)
    trainer.fit(ConvAutoencoder(), _Images(), None, task=ReconstructionTask())
    assert trainer.optimizer.param_groups[0]["fused"] is True
    fused = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    torch.manual_seed(0)
    trainer = Trainer(dataclasses.replace(cfg, optim=OptimConfig(name="adam", lr=1e-3)), strategy="single",
                      batch_size=16, epochs=1, out=str(tmp_path / "g"), progress_bar=False, loggers=[],
                      enable_checkpointing=False, pictures=0)
    trainer.fit(ConvAutoencoder(), _Images(), None, task=ReconstructionTask())
    assert not trainer.optimizer.param_groups[0]["fused"]  # auto on a CPU: torch's default kernels
    assert _max_diff(fused, trainer.module.state_dict()) < 1e-5


def _hand_loop(epochs: int, batch_size: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the same model, samples, order, optimizer and loss, no gputrain in the step."""
    torch.manual_seed(0)
    model, data = ConvAutoencoder(), _Images()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sampler = StepBatchSampler(len(data), dp_rank=0, dp_size=1, batch_size=batch_size)  # the order gputrain trains
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for keys in sampler:
            x = torch.stack([data[i] for _, i in keys])
            F.mse_loss(model(x), x).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def test_every_option_off_is_the_plain_pytorch_path_bit_for_bit(tmp_path):
    trained = _train(str(tmp_path / "off"), "single", 1, 16, epochs=2, **OFF)
    hand = _hand_loop(epochs=2, batch_size=16)
    assert all(torch.equal(trained[k], hand[k]) for k in hand), _max_diff(trained, hand)
    # And auto on a CPU resolves to exactly that path.
    assert all(torch.equal(a, b) for a, b in zip(_train(str(tmp_path / "auto"), "single", 1, 16, epochs=2).values(),
                                                  trained.values(), strict=True))


def test_summary_names_the_options_that_ran_and_times_the_first_step(tmp_path):
    import json

    _train(str(tmp_path / "run"), "single", 1, 16, epochs=1, channels_last=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["fast"] == "channels_last+reuse_host_memory" and summary["first_step_s"] > 0  # 2 saves: a thread
