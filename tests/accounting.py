"""Shared by the exact-accounting tests: a model, a dataset that augments, and a task that records sample ids.

The task sees each batch's sample indices (carried in the targets), so a test can check from what
the model actually consumed that every sample was trained once, whatever the loop claims.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gputrain import Trainer
from gputrain.config import OptimConfig, ParallelConfig, RunConfig
from gputrain.engine.hooks import Hook, RunContext
from gputrain.tasks.base import Task


class NoisyPoints(torch.utils.data.Dataset):
    """Fixed points with random augmentation noise drawn in ``__getitem__`` (from torch's generator)."""

    def __init__(self, n: int, seed: int = 1, noise: float = 0.05) -> None:
        g = torch.Generator().manual_seed(seed)
        self.noise = noise
        self.x = torch.randn(n, 3, 6, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i] + self.noise * torch.randn(3, 6, 6), self.y[i], i


class RecordingTask(Task):
    """Cross-entropy on ``(image, label, index)`` batches; remembers every index it trained on."""

    def __init__(self) -> None:
        super().__init__(F.cross_entropy)
        self.seen: list[int] = []

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        x, y, idx = batch
        return x, (y, idx)

    def forward(self, model: nn.Module, inputs: Any, targets: Any) -> Any:
        if model.training:
            self.seen.extend(int(i) for i in targets[1])
        return model(inputs)

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return F.cross_entropy(outputs, targets[0])


def small_cnn(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 4, 3)]
    layers += [nn.BatchNorm2d(4)] if batchnorm else []
    return nn.Sequential(*layers, nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


class StopAtStep(Hook):
    """Simulates a crash right after optimizer step ``step`` (before that step's checkpoint is written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        if ctx.state.global_step == self.step:
            raise RuntimeError(f"planned crash at step {self.step}")


def train(out: Path | str, *, strategy: str = "single", devices: int = 1, batch_size: int = 16, n: int = 37,
          accumulate: int = 1, epochs: int = 2, workers: int = 0, resume: str = "", hooks: list[Hook] | None = None,
          parallel: ParallelConfig | None = None, **trainer: Any) -> tuple[dict[str, torch.Tensor], list[int], Trainer]:
    """Train ``small_cnn`` on ``NoisyPoints(n)``; returns final weights, trained ids and the trainer."""
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=0.2, momentum=0.9), parallel=parallel or ParallelConfig())
    cfg.data.num_workers = workers
    task = RecordingTask()
    run = Trainer(cfg, hooks=hooks, strategy=strategy, devices=devices, accelerator="cpu", batch_size=batch_size,
                  accumulate_grad_batches=accumulate, epochs=epochs, out=str(out), progress_bar=False, loggers=[],
                  log_every_n_steps=1, resume=resume, **trainer)
    run.fit(small_cnn(trainer.get("sync_batchnorm", False)), NoisyPoints(n), NoisyPoints(11, seed=2, noise=0.0), task=task)
    weights = {k: v.detach().clone() for k, v in run.strategy.model_state_dict(run.module).items()}
    return weights, task.seen, run


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
