"""The runs of the recipe tests (tests/distributed/test_recipe_distributed.py): one small model with BatchNorm, its
data, and a short ``Trainer.fit`` with an EMA of the weights (and, with ``mix``, MixUp, CutMix and repeated
augmentation) that the 2-rank worker and the 1-process test share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddp_promise_runs import Crash, CrashAfterStep
from gputrain import Trainer
from gputrain.config import DataConfig, OptimConfig, ParallelConfig, RunConfig
from gputrain.tasks.base import Task
from gputrain.tasks.classification import ClassificationTask

N_TRAIN, N_VAL = 37, 9  # 37 = 6 x 6 + 1: 7 steps an epoch, the last of one sample (rank 1 joins it empty)
GLOBAL_BATCH = 6
MIX_BATCH = 8  # mixing pairs samples in each device's batch: an even one on 1 and 2 ranks
CRASH_AFTER = 9  # epoch 2, after its second step: a mid-epoch checkpoint (every 2 steps) is the newest


def ema_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Sequential(nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU()),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 3, 8, 8, generator=g) * 2, torch.randint(0, 5, (n,), generator=g))


def fit(out: Path, *, strategy: str, devices: int, resume: str = "", crash: bool = False, sharded: bool = False,
        mix: bool = False, alphas: tuple[float, float] = (0.4, 1.0), stages: bool = False, **trainer: Any) -> Trainer:
    """2 epochs with an EMA updated every step, checkpoints every 2 steps (``sharded``: DCP folders); with
    ``crash``, stopped after step 9; with ``mix``, a global batch of 8 mixed by MixUp or CutMix, each sample
    twice an epoch; with ``stages``, 2 micro-batches and a split before the second block (pipeline's stages)."""
    options: dict[str, Any] = dict(
        accelerator="cpu", batch_size=(MIX_BATCH if mix else GLOBAL_BATCH) // devices, epochs=2, progress_bar=False, loggers=[],
        log_every_n_steps=1, sync_batchnorm=True, ema_decay=0.7, ema_every_n_steps=1, ema_adjust=False,
        checkpoint_every_n_steps=2, keep_last=20, monitor="val_ema/loss", eval_batch_size=4)
    cfg = RunConfig(task="classification" if mix else "autoencoder", optim=OptimConfig(name="sgd", lr=0.2, momentum=0.9),
                    parallel=ParallelConfig(sharded_checkpoint=sharded, micro_batches=2 if stages else 1,
                                            split_points=["3"] if stages else []),
                    data=DataConfig(mixup_alpha=alphas[0], cutmix_alpha=alphas[1], repeated_augment=2) if mix
                    else DataConfig())
    t = Trainer(cfg, strategy=strategy, devices=devices,
                out=str(out), resume=resume, hooks=[CrashAfterStep(CRASH_AFTER)] if crash else [], **_without_monitor_of_no_ema(options | trainer))
    try:
        t.fit(ema_model(), data(N_TRAIN, 1), data(N_VAL, 2),
              task=ClassificationTask(5) if mix else Task(nn.functional.cross_entropy))
    except Crash:
        if not crash:
            raise
    return t


def weights_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}


def ema_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The run's EMA as a full state dict (a collective; ``{}`` off rank 0 under FSDP)."""
    assert trainer.loop is not None and trainer.loop.ema is not None
    return trainer.loop.ema.full_state()


def local_ema_numel(trainer: Trainer) -> tuple[int, int]:
    """Elements this rank holds of the EMA, and of the model's parameters and buffers in full."""
    assert trainer.loop is not None and trainer.loop.ema is not None
    from torch.distributed.tensor import DTensor

    held = sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in trainer.loop.ema.tensors.values())
    return held, sum(t.numel() for t in ema_model().state_dict().values())


def _without_monitor_of_no_ema(options: dict[str, Any]) -> dict[str, Any]:
    """A run with trainer.ema_decay=0 monitors nothing (val_ema/loss would be refused)."""
    return options | {"monitor": ""} if not options["ema_decay"] else options
