"""The runs of the distributed promise tests (tests/distributed/test_promises_distributed.py): models and data
identical in every process, a short ``Trainer.fit``, the hooks that count gradient all-reduces and crash a run,
and the resume runs the 2-rank worker and the 1-process test share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig, SchedulerConfig
from gputrain.engine.hooks import Hook, RunContext


# -- models and data, identical in every process ------------------------------------------------
def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def images(n: int, seed: int) -> TensorDataset:
    """Images whose scale grows with the index, so each rank's BatchNorm statistics differ."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 3.0, n).view(n, 1, 1, 1)
    return TensorDataset(torch.randn(n, 3, 6, 6, generator=g) * scale + scale, torch.randn(n, 2, generator=g))


def vectors(n: int, seed: int, target_scale: float = 1.0, input_scale: float = 4.0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) * input_scale
    return TensorDataset(x, x[:, :4] * target_scale + 5)


def train(out: Path, model: nn.Module, train_data: Any, val_data: Any = None, *, hooks: list[Hook] | None = None,
          optim: OptimConfig | None = None, scheduler: SchedulerConfig | None = None, **trainer: Any) -> Trainer:
    cfg = RunConfig(optim=optim or OptimConfig(name="sgd", lr=0.1, momentum=0.9),
                    scheduler=scheduler or SchedulerConfig())
    options: dict[str, Any] = dict(accelerator="cpu", progress_bar=False, loggers=[], log_every_n_steps=1,
                                   epochs=1, batch_size=4)
    t = Trainer(cfg, hooks=hooks, out=str(out), **(options | trainer))
    for hook in hooks or []:
        if isinstance(hook, CountGradAllReduce):
            hook.trainer = t
    t.fit(model, train_data, val_data, loss=F.mse_loss)
    return t


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


class CountGradAllReduce(Hook):
    """A DDP communication hook that counts the gradient all-reduces, then does the usual one."""

    def __init__(self) -> None:
        self.calls = 0
        self.buckets: set[int] = set()
        self.trainer: Trainer | None = None
        """The trainer whose DDP wrapper gets the communication hook (a hook's context holds no wrapper)."""

    def before_fit(self, ctx: RunContext) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):  # unannotated: DDP refuses a bucket annotation other than dist.GradBucket
            self.calls += 1
            self.buckets.add(bucket.index())
            return allreduce_hook(None, bucket)  # None: the default process group

        assert self.trainer is not None
        self.trainer.module.register_comm_hook(None, hook)  # trainer.module is the DDP wrapper


class CrashAfterStep(Hook):
    """Stops the run with an exception after optimizer step ``step``: a crash after a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        if ctx.state.global_step == self.step:
            raise Crash(f"planned crash after step {self.step}")


class Crash(Exception):
    pass


# -- resume: the runs the 2-rank worker and the 1-process test share ------------------------------
RESUME_STEPS_PER_EPOCH = 4


def resume_runs(root: Path, **trainer: Any) -> dict[str, Any]:
    """An uninterrupted 2-epoch run, and one that crashes after epoch 1 and resumes; both states.

    Dropout (RNG state), a cosine schedule (scheduler state), Adam (optimizer state) and 16-mixed
    precision whose first steps overflow, so the GradScaler lowers its scale from 65536 (scaler state).
    """
    n = RESUME_STEPS_PER_EPOCH * trainer["batch_size"] * trainer.get("devices", 1)
    common = dict(optim=OptimConfig(name="adam", lr=1e-2), scheduler=SchedulerConfig(name="cosine"),
                  precision="16-mixed", epochs=2, **trainer)
    full = train(root / "full", dropout_model(), vectors(n, 3, input_scale=0.25), **common)
    try:
        train(root / "crashed", dropout_model(), vectors(n, 3, input_scale=0.25),
              hooks=[CrashAfterStep(RESUME_STEPS_PER_EPOCH + 1)], **common)
    except Crash:
        pass
    resumed = train(root / "crashed", dropout_model(), vectors(n, 3, input_scale=0.25), resume="auto", **common)
    assert resumed.resumed
    return {"full": state_of(full), "resumed": state_of(resumed),
            "scale": full.precision.state_dict()["scaler"]["scale"]}
