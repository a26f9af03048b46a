"""16-mixed on 2 real gloo ranks: every rank skips the same steps, so a float16 overflow in one rank's batch neither
splits the ranks nor ends the run.

The overflowing sample lands in one rank's share of a step only. DDP averages the gradients before the scaler looks
at them, and under FSDP the scaler's check of DTensor gradients gives one verdict for all ranks: both ranks skip
that step and keep the same loss scale (docs/precision.md). Which steps overflow can differ from one process's run
with the whole batch (each rank's backward runs on its half), so the ranks are compared with each other.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Hook, Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.dist import DistInfo
from multiproc import run_ranks

N, OVERFLOWING = 24, 9  # sample 9 overflows float16 in the first layer (1e5 > 65,504)


class Logs(Hook):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def after_step(self, ctx: Any, logs: dict[str, float] | None) -> None:
        self.rows.append(dict(logs or {}))


def _data() -> TensorDataset:
    x = torch.randn(N, 4, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    x[OVERFLOWING] = 1e5
    return TensorDataset(x, y)


def _fit(out: str, strategy: str, devices: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    logs = Logs()
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.05, momentum=0.9)), strategy=strategy,
                      devices=devices, accelerator="cpu", progress_bar=False, loggers=[], batch_size=8 // devices,
                      epochs=2, out=out, precision="16-mixed", log_every_n_steps=1, hooks=[logs])
    trainer.fit(model, _data(), TensorDataset(torch.ones(4, 4), torch.ones(4, 1)), loss=F.mse_loss)
    # Every rank's whole model: FSDP's DTensors gathered (a collective, in the same order on each rank).
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in trainer.module.state_dict().items()}
    return {"scales": [r["train/loss_scale"] for r in logs.rows],
            "skipped": [r.get("train/skipped_steps", 0.0) for r in logs.rows],
            "losses": [r.get("train/loss") for r in logs.rows], "state": state}


def _worker(info: DistInfo, out: str, strategy: str) -> dict[str, Any]:
    return _fit(out, strategy, 2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_both_ranks_skip_the_step_one_rank_overflowed_and_stay_one_model(tmp_path, strategy):
    """What the design rests on: the scaler's verdict is one for all ranks (torch's, for DDP and FSDP2's DTensors);
    were it not, the ranks' scales, logged losses and weights would part here."""
    ranks = run_ranks(_worker, str(tmp_path / strategy), strategy)
    assert ranks[0]["scales"] == ranks[1]["scales"] and ranks[0]["skipped"] == ranks[1]["skipped"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert sum(ranks[0]["skipped"]) >= 2  # the scale's calibration, and the step holding the overflowing sample
    assert any(loss is not None for loss in ranks[0]["losses"][-3:])  # it went on training
    for name, value in ranks[0]["state"].items():
        assert torch.isfinite(value).all() and torch.equal(value, ranks[1]["state"][name]), name
