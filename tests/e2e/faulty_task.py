"""A user-code task for fault tests: a tiny CNN on in-memory data that can fail on purpose.

Named in a recipe as ``task: faulty_task:build`` (tests put tests/e2e on PYTHONPATH). The
environment picks the fault, so the same command trains normally without it:
GPUTRAIN_TEST_FAULT=kill|raise, GPUTRAIN_TEST_FAULT_RANK (default 1), GPUTRAIN_TEST_FAULT_STEP
(the optimizer step whose forward fails, default 5). ``kill`` happens on the first attempt
only (a crash an elastic restart recovers from); ``raise`` on every attempt.
GPUTRAIN_TEST_STEPS_DIR: each rank writes the optimizer step of every training forward to
``rank<N>`` there (how far each rank got); GPUTRAIN_TEST_SLOW_RANK: that rank sleeps 20 ms per
forward, so it runs behind the others.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain.config import RunConfig
from gputrain.tasks.base import Task
from gputrain.tasks.spec import TaskSpec


class FaultyTask(Task):
    def __init__(self, micro_per_step: int) -> None:
        super().__init__(F.cross_entropy)
        self.calls, self.micro_per_step = 0, micro_per_step
        self.fault = os.environ.get("GPUTRAIN_TEST_FAULT", "")
        self.rank = int(os.environ.get("RANK", "0"))
        self.fault_rank = int(os.environ.get("GPUTRAIN_TEST_FAULT_RANK", "1"))
        self.fault_step = int(os.environ.get("GPUTRAIN_TEST_FAULT_STEP", "5"))
        steps_dir = os.environ.get("GPUTRAIN_TEST_STEPS_DIR", "")
        self.steps_file = Path(steps_dir) / f"rank{self.rank}" if steps_dir else None
        self.slow = os.environ.get("GPUTRAIN_TEST_SLOW_RANK", "") == str(self.rank)

    def forward(self, model: nn.Module, inputs: Any, targets: Any) -> Any:
        if model.training:
            self.calls += 1
            step = (self.calls - 1) // self.micro_per_step + 1
            if self.steps_file is not None:
                partial = self.steps_file.with_suffix(".tmp")
                partial.write_text(str(step))
                partial.replace(self.steps_file)  # whole numbers only, for a reader polling it
            if self.slow:
                time.sleep(0.02)
            if self.fault and self.rank == self.fault_rank and step == self.fault_step:
                if self.fault == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fault == "raise":
                    raise RuntimeError(f"planted failure at step {step}")
        return model(inputs)


def build(cfg: RunConfig) -> TaskSpec:
    g = torch.Generator().manual_seed(7)
    train = TensorDataset(torch.randn(101, 3, 8, 8, generator=g), torch.randint(0, 4, (101,), generator=g))
    val = TensorDataset(torch.randn(13, 3, 8, 8, generator=g), torch.randint(0, 4, (13,), generator=g))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(288, 4))
    return TaskSpec(task=FaultyTask(cfg.trainer.accumulate_grad_batches), model=model, train_data=train,
                    val_data=val)
