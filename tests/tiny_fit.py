"""The tiny one-process ``Trainer.fit`` of the one-process promise tests (tests/unit/test_promises.py,
tests/unit/test_resume_auto.py, tests/unit/test_issue_15_faults.py): a linear model on seeded data, in this process
(no workers), with any optimizer, schedule (an exploding one included) and trainer options."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig, SchedulerConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _data(n: int, target_scale: float) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True) * target_scale)


def _fit(out: Path, *, optim: OptimConfig | None = None, scheduler: SchedulerConfig | None = None,
         n: int = 16, target_scale: float = 1.0, **trainer: Any) -> Trainer:
    cfg = RunConfig(optim=optim or OptimConfig(name="sgd", lr=0.05, momentum=0.9),
                    scheduler=scheduler or SchedulerConfig())
    options: dict[str, Any] = dict(strategy="single", accelerator="cpu", progress_bar=False, loggers=[],
                                   batch_size=8, epochs=2, out=str(out))
    # An exploding schedule (gamma > 1) is how divergence is provoked; the Trainer refuses it as a config, so it is
    # checked with gamma 1 and given the exploding one afterwards.
    explode = scheduler is not None and scheduler.gamma > 1
    if explode:
        cfg.scheduler = dataclasses.replace(cfg.scheduler, gamma=1.0)
    t = Trainer(cfg, **(options | trainer))
    if explode:
        t.cfg.scheduler.gamma = scheduler.gamma
    t.fit(_model(), _data(n, target_scale), _data(8, target_scale), loss=F.mse_loss)
    return t
