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
from gputrain.tools.plan.input import InputPlan, input_plan, time_reads

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


class SlowInWorkers(Slow):
    """Reads that take ``SLEEP_S`` in a loader worker and nothing in the training process."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            time.sleep(SLEEP_S)
        return self.x[i], self.x[i].sum(0, keepdim=True)


def build_slow_in_workers(cfg):
    """``task: test_input_plan:build_slow_in_workers``."""
    from gputrain.tasks.base import Task
    from gputrain.tasks.spec import TaskSpec

    return TaskSpec(task=Task(nn.functional.mse_loss), model=nn.Linear(8, 1), train_data=SlowInWorkers(sleep_s=0),
                    val_data=None)


class SlowStep(nn.Linear):
    """A layer whose forward takes 100 ms: a step that consumes few images a second."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.1)
        return super().forward(x)


def build_slow_step(cfg):
    """``task: test_input_plan:build_slow_step``: reads of 2 ms (500 a second a worker) for a 100 ms step of 8."""
    from gputrain.tasks.base import Task
    from gputrain.tasks.spec import TaskSpec

    return TaskSpec(task=Task(nn.functional.mse_loss), model=SlowStep(8, 1), train_data=Slow(sleep_s=0.002),
                    val_data=None)


def _plan(**data: float) -> tuple[str, int, float]:
    """A ddp plan on 2 devices of ``batch`` each per ``step_s``: (strategy, devices, images/s)."""
    return "ddp", 2, 2 * data["batch"] / data["step_s"]


def test_reads_are_timed_as_a_worker_reads_them():
    assert time_reads(Slow()) == pytest.approx(SLEEP_S, rel=0.25, abs=0.005)


def test_a_worker_is_timed_even_where_the_set_holds_fewer_than_three_of_the_runs_batches():
    """A recipe's batch of 256 over a sample of 64: the worker reads smaller batches, three of them at least (its
    first is left out), rather than giving no figure."""
    from torch.utils.data import default_collate

    from gputrain.tools.plan.input import time_worker_reads

    seconds = time_worker_reads(Slow(sleep_s=0.005), default_collate, batch_size=256)
    assert seconds is not None and 0.005 * 0.8 <= seconds <= 0.005 * 4  # a loaded machine only slows the reads


def test_a_workers_collate_of_each_batch_is_counted_in_its_share():
    def collate(batch):
        time.sleep(0.04)  # 10 ms a sample in batches of 4
        return batch

    # At least the sleeps (a collate left out gives 20 ms); a loaded machine only adds to them.
    assert 0.9 * (SLEEP_S + 0.01) <= time_reads(Slow(), collate, batch_size=4) <= 4 * (SLEEP_S + 0.01)


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


def test_gpu_decoding_is_suggested_only_where_every_core_of_the_node_would_still_hold_the_steps_up():
    """On an H200 with 16 cores, decoding in the workers reached 0.99 of synthetic data and decoding on the GPU 0.30
    (docs/benchmarks.md, 2026-11-30): where enough workers keep up, the plan names the workers, never
    ``data.decode_on_device``; only where all of the node's cores per process fall short is it worth trying."""
    def loader(needed: float, cores: int) -> InputPlan:  # 1 worker configured, 100 images/s a worker
        return InputPlan(images_per_s_per_worker=100.0, images_per_s_in_process=90.0, workers=1,
                         suggested_workers=int(-(-needed * 1.25 // 100)), images_per_s=100.0, needed_per_s=needed,
                         keeps_up=False, cores_per_process=cores)

    workers_do = loader(1200.0, cores=16).line()  # 15 workers keep up
    assert workers_do.endswith("input-bound; set data.num_workers=15") and "decode_on_device" not in workers_do
    too_few = loader(1200.0, cores=8).line()
    assert "even 8 worker(s) (this node's cores per process) give 800" in too_few
    assert too_few.endswith("data.decode_on_device=true on a GPU")


def test_plan_says_a_slow_loader_is_input_bound_in_its_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "plan.json"
    code = main(["plan", str(_recipe(tmp_path)), "--devices", "1", "--accelerator", "cpu", "--json", str(out)])
    assert code == 0
    loader = json.loads(out.read_text())["input"]
    # Bounds a loaded machine keeps (it only slows the reads); reads already made would give thousands a second.
    assert 0.25 / SLEEP_S <= loader["images_per_s_per_worker"] <= 1.25 / SLEEP_S
    assert 0.25 / SLEEP_S <= loader["images_per_s_in_process"] <= 1.25 / SLEEP_S
    assert loader["workers"] == 0 and not loader["keeps_up"] and loader["suggested_workers"] >= 1
    assert "input: " in capsys.readouterr().out


def test_the_plan_times_a_loader_worker_in_a_worker_and_the_training_process_in_itself(tmp_path, monkeypatch):
    """A worker's reads are not the training process's (on the 2-core test machine a worker read CIFAR-10 3x
    slower): the plan times each where it runs, and the line for data.num_workers=0 gives the in-process rate."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "plan.json"
    assert main(["plan", str(_recipe(tmp_path, "build_slow_in_workers")), "--devices", "1", "--accelerator", "cpu",
                 "--json", str(out)]) == 0
    loader = json.loads(out.read_text())["input"]
    assert 0.25 / SLEEP_S <= loader["images_per_s_per_worker"] <= 1.25 / SLEEP_S  # a loaded machine only slows it
    assert loader["images_per_s_in_process"] > 10 / SLEEP_S  # the same reads without the worker's sleep


def test_a_one_process_run_that_strategy_auto_planned_trains_with_every_setting_of_the_plan(tmp_path, monkeypatch):
    """With one process there is no worker command line to carry the plan's settings: the run's own config takes
    them too (its predictions and its loader workers, not only the strategy and the batch)."""
    import yaml

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out = tmp_path / "run"
    assert main(["train", str(_recipe(tmp_path, "build_slow_step", "auto")), "--devices", "1", "--strategy", "auto",
                 "--epochs", "1", "--out", str(out), "trainer.max_steps_per_epoch=2", "trainer.pictures=0",
                 "trainer.progress_bar=false"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["num_workers"] == 1 and saved["trainer"]["strategy"] == "single"
    assert saved["trainer"]["predicted_step_s"] > 0 and len(saved["trainer"]["predicted_peak_bytes"]) == 1


def _recipe(tmp_path: Path, build: str = "build", workers: int | str = 0) -> Path:
    path = tmp_path / f"{build}.yaml"
    path.write_text(f"task: test_input_plan:{build}\ndata:\n  num_workers: {workers}\ntrainer:\n  batch_size: 8\n"
                    "  accelerator: cpu\n")
    return path


def test_strategy_auto_gives_num_workers_auto_the_workers_its_step_needs_up_to_the_cores(tmp_path, monkeypatch):
    """``--strategy auto`` with ``data.num_workers=auto``: the run gets the fewest workers that keep up with the
    chosen plan's step (one for a 100 ms step of 8, where auto alone takes every core), and every core of the process
    for a loader slower than any count of them; a count the user gave is left alone."""
    from gputrain.config.resolve import resolve_num_workers, usable_cores
    from gputrain.tools.plan.command import auto_overrides

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    every_core = resolve_num_workers("auto", cores=usable_cores(), local_processes=1)

    def planned(build: str, workers: int | str) -> tuple[list[str], str]:
        return auto_overrides(load_config(str(_recipe(tmp_path, build, workers))), devices=1, nnodes=1,
                              budget_text="")

    overrides, line = planned("build_slow_step", "auto")
    assert "data.num_workers=1" in overrides and overrides.count("data.num_workers=1") == 1
    assert "; data.num_workers=auto: 1 loader worker(s) per process (" in line
    slow, _ = planned("build", "auto")  # 50 images/s a worker against a step of a few ms: input-bound at any count
    assert f"data.num_workers={every_core}" in slow
    given, line = planned("build", 1)
    assert not any(o.startswith("data.num_workers=") for o in given) and "loader worker" not in line


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
    assert relaxed.status == "OK" and "not compared: the two differ by 80.0 ms a batch, under 5% of the 9840 ms step" in relaxed.what
