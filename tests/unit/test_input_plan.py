"""The plan covers the input pipeline (issue 42, its CPU part): one loader worker's decode-and-augment rate, timed on
the training set with the recipe's transforms, against what the chosen plan's step consumes in each process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from gputrain.cli import main
from gputrain.config import load_config
from gputrain.tools.plan.input import input_plan, time_reads

SLEEP_S = 0.02


class Slow(Dataset):
    """Vectors whose every read takes ``SLEEP_S`` (a transform that sleeps: a loader slower than the step)."""

    def __init__(self, sleep_s: float = SLEEP_S) -> None:
        self.x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sleep_s)
        return self.x[i], self.x[i].sum(0, keepdim=True)


def build(cfg):
    """``task: test_input_plan:build`` (this file is importable as a module: tests/unit is on the path)."""
    from gputrain.tasks.base import Task
    from gputrain.tasks.spec import TaskSpec

    return TaskSpec(task=Task(nn.functional.mse_loss), model=nn.Linear(8, 1),
                    train_data=Slow(), val_data=None)


def _plan(**data: float) -> tuple[str, int, float]:
    """A ddp plan on 2 devices of ``batch`` each per ``step_s``: (strategy, devices, images/s)."""
    return "ddp", 2, 2 * data["batch"] / data["step_s"]


def test_reads_are_timed_as_a_worker_reads_them():
    assert time_reads(Slow()) == pytest.approx(SLEEP_S, rel=0.25, abs=0.005)


def test_a_workers_collate_of_each_batch_is_counted_in_its_share():
    def collate(batch):
        time.sleep(0.04)  # 10 ms a sample in batches of 4
        return batch

    assert time_reads(Slow(), collate, batch_size=4) == pytest.approx(SLEEP_S + 0.01, rel=0.25, abs=0.005)


def test_workers_the_step_needs_are_suggested_and_a_loader_slower_than_the_step_is_input_bound():
    cfg = load_config(None, ["data.num_workers=1"])
    # 100 images/s a worker; each of 2 ddp processes takes 15 images a 0.1 s step: 150/s.
    loader = input_plan(cfg, *_plan(batch=15, step_s=0.1), 0.01, processes_per_node=1)
    assert (loader.needed_per_s, loader.images_per_s_per_worker) == pytest.approx((150.0, 100.0))
    assert not loader.keeps_up and loader.suggested_workers == 2  # 150 x 1.25 / 100, rounded up
    assert "input-bound" in loader.line()
    two = input_plan(load_config(None, ["data.num_workers=2"]), *_plan(batch=15, step_s=0.1), 0.01,
                     processes_per_node=1)
    assert two.keeps_up and two.images_per_s == pytest.approx(200.0) and "keeps up" in two.line()
    # No workers: the reads add to the step, fine only while they are a tenth of it.
    none = input_plan(load_config(None, ["data.num_workers=0"]), *_plan(batch=1, step_s=0.1), 0.001,
                      processes_per_node=1)
    assert none.keeps_up and none.workers == 0


def test_plan_says_a_slow_loader_is_input_bound_in_its_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "plan.json"
    code = main(["plan", str(_recipe(tmp_path)), "--devices", "1", "--accelerator", "cpu", "--json", str(out)])
    assert code == 0
    loader = json.loads(out.read_text())["input"]
    assert loader["images_per_s_per_worker"] == pytest.approx(1 / SLEEP_S, rel=0.25)
    assert loader["workers"] == 0 and not loader["keeps_up"] and loader["suggested_workers"] >= 1
    assert "input: " in capsys.readouterr().out


def _recipe(tmp_path: Path) -> Path:
    path = tmp_path / "slow.yaml"
    path.write_text("task: test_input_plan:build\ndata:\n  num_workers: 0\ntrainer:\n  batch_size: 8\n"
                    "  accelerator: cpu\n")
    return path


def test_doctor_sets_the_plans_loader_rate_against_its_dry_runs_reads():
    from gputrain.tools.diagnose.outcome import RankOutcome
    from gputrain.tools.diagnose.plan_check import check_input_plan

    cfg = load_config(None, ["data.num_workers=0"])
    loader = input_plan(cfg, *_plan(batch=8, step_s=0.5), 0.01, processes_per_node=2)  # 100 images/s a worker

    def dry_run(wait_s: float, wall_s: float = 1.0) -> list[RankOutcome]:  # batches of 8, each waited for wait_s
        # Steps 1 and 2 are the memory count's (slowed by it), 1 the epoch's first too: neither counted.
        steps = [{"kind": "step", "step": k, "first_of_epoch": k == 1, "wait_s": 5.0 if k <= 2 else wait_s,
                  "wall_s": wall_s, "batches": 1, "inputs": [8, 3, 32, 32]} for k in (1, 2, 3, 4)]
        return [RankOutcome(rank=r, ok=True, records=steps) for r in (0, 1)]

    close = check_input_plan(loader, dry_run(0.088))  # 91 images/s
    assert close.status == "OK" and "predicted 100 images/s" in close.what and "(prediction +10%)" in close.what
    far = check_input_plan(loader, dry_run(0.16))  # 50 images/s: the plan predicted twice that
    assert far.status == "WARN" and "(prediction +100%)" in far.what and "size data.num_workers by it" in far.fix
    busy = check_input_plan(loader, dry_run(0.16), busy="the machine was busy (load 5.0 on 2 cores)")
    assert busy.status == "OK" and "not compared: the machine was busy" in busy.what
    workers = input_plan(load_config(None, ["data.num_workers=2"]), *_plan(batch=8, step_s=0.5), 0.01,
                         processes_per_node=1)
    assert check_input_plan(workers, dry_run(0.16)).status == "SKIP"  # served from the prefetch: no rate to compare
    assert check_input_plan(None, dry_run(0.16)).status == "SKIP"
    # The same error beside a 10 s step: 80 ms a batch, under a twentieth of the step, turns no choice.
    relaxed = check_input_plan(loader, dry_run(0.16, wall_s=10.0))
    assert relaxed.status == "OK" and "not compared: 80.0 ms a batch, under 5% of the 9840 ms step" in relaxed.what
