"""A run measures its first steps' pace (issue 42's closed loop): the step time and the data wait go to
``metrics.jsonl`` and ``summary.json``, and a loader that holds the steps up is named in one line with the workers to
set; setting them removes the wait."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from gputrain.cli import main
from gputrain.engine.callbacks.memory import set_against_plan
from gputrain.engine.callbacks.pace import pace_line, prediction_line, suggested_workers

READ_S = 0.004  # per sample: a batch of 8 reads in 32 ms (x 1.25 = 40 ms: 1 worker keeps up with 60 ms, by 1.5x)
COMPUTE_S = 0.06  # per step: the model's forward


class SlowReads(Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(72, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(READ_S)  # a decode and augment that takes this long
        return self.x[i], self.x[i].sum(0, keepdim=True)


class SlowStep(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE_S)  # a step that computes this long
        return super().forward(x)


def build(cfg):
    """``task: test_pace:build`` (tests/unit is on the path)."""
    from gputrain.tasks.base import Task
    from gputrain.tasks.spec import TaskSpec

    return TaskSpec(task=Task(nn.functional.mse_loss), model=SlowStep(8, 1), train_data=SlowReads(), val_data=None)


def _train(tmp_path: Path, workers: int, capsys, *overrides: str) -> tuple[dict, str]:
    recipe = tmp_path / "slow.yaml"
    recipe.write_text("task: test_pace:build\ntrainer:\n  batch_size: 8\n  accelerator: cpu\n")
    out = tmp_path / f"run{workers}{len(list((tmp_path).glob('run*')))}"
    code = main(["train", str(recipe), "--out", str(out), "--epochs", "1", f"data.num_workers={workers}",
                 "trainer.progress_bar=false", "trainer.pictures=0", "trainer.enable_checkpointing=false", *overrides])
    printed = capsys.readouterr().out
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r.get("event") == "pace"] == [{"event": "pace", **summary["pace"]}]
    return summary["pace"], printed


def test_a_loader_that_holds_the_steps_up_is_named_and_the_suggested_workers_remove_the_wait(tmp_path, capsys,
                                                                                            monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    held, printed = _train(tmp_path, 0, capsys)
    assert held["steps"] == 8 and held["num_workers"] == 0  # 9 steps, the first (warming up) not counted
    assert held["data_wait_s"] == pytest.approx(8 * READ_S, rel=0.5) and held["data_wait_share"] > 0.2
    # 32 ms of reads beside 60 ms of compute, plus a quarter (at 6 ms a read, 48 ms x 1.25 against 60 ms sat on
    # the edge between 1 and 2, and a loaded machine tipped it)
    assert held["suggested_workers"] == 1
    line = next(x for x in printed.splitlines() if "held up" in x)
    assert line.endswith("set data.num_workers=1") and "data.num_workers=0" in line
    kept, printed = _train(tmp_path, held["suggested_workers"], capsys)
    assert kept["data_wait_share"] < 0.2 and kept["data_wait_s"] < held["data_wait_s"] / 3
    assert "held up" not in printed
    # Each reader's own rate, timed where it reads: the training process at 0 workers, the one worker at 1 (its
    # reads run beside the step, so the step's wait no longer shows them).
    for pace in (held, kept):
        assert pace["readers"] == 1 and 0.25 / READ_S <= pace["reader_images_per_s"] <= 1.25 / READ_S  # load slows


def test_the_suggestion_counts_the_workers_already_there_and_says_when_the_cores_fall_short():
    assert suggested_workers(step_s=0.1, wait_s=0.04, workers=0) == 1  # 0.04 x 1.25 / 0.06
    # 2 workers holding a 0.2 s step up (0.15 s of it waiting): each reads a step in 0.4 s; 0.4 x 1.25 / 0.05
    assert suggested_workers(step_s=0.2, wait_s=0.15, workers=2) == 10
    pace = {"steps": 20, "step_s": 0.2, "data_wait_s": 0.15, "data_wait_share": 0.75, "num_workers": 2,
            "suggested_workers": 10}
    assert "set data.num_workers=10" in pace_line(pace, cores=16)
    assert "even 4 worker(s)" in pace_line(pace, cores=4) and "num_workers=10" not in pace_line(pace, cores=4)
    assert pace_line({**pace, "data_wait_share": 0.1}, cores=16) == ""
    assert pace_line({**pace, "steps": 4}, cores=16) == ""  # a first epoch of 5 steps: recorded, not named


def test_a_plans_step_time_far_from_the_measured_one_is_named_and_a_close_one_is_not(tmp_path, capsys, monkeypatch):
    """What --strategy auto hands the run (trainer.predicted_step_s) set against the steps' compute time: the 60 ms
    step predicted at 6 ms is named, at what the machine measured it is not."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    far, printed = _train(tmp_path, 0, capsys, f"trainer.predicted_step_s={COMPUTE_S / 10}")
    assert far["compute_s"] == pytest.approx(far["step_s"] - far["data_wait_s"], abs=1e-5)
    # At least the forward's sleep; a loaded machine adds to it (the fast tier runs with both cores busy).
    assert COMPUTE_S * 0.95 <= far["compute_s"] <= COMPUTE_S * 3 and far["predicted_step_s"] == COMPUTE_S / 10
    assert far["step_prediction_off"] < -0.8
    line = next(x for x in printed.splitlines() if "the plan predicted" in x)
    assert line.startswith("gputrain: warning: the first 8 steps computed for ") and "(prediction -9" in line
    # Predicted as this machine just measured it (under load that is more than the sleep): not named.
    close, printed = _train(tmp_path, 0, capsys, f"trainer.predicted_step_s={far['compute_s']:.4f}")
    assert abs(close["step_prediction_off"]) <= 0.2 and "the plan predicted" not in printed
    plain, _ = _train(tmp_path, 0, capsys)
    assert "predicted_step_s" not in plain  # no plan, nothing to set against


def test_the_prediction_lines_name_the_error_its_sign_and_a_busy_node():
    pace = {"steps": 20, "compute_s": 0.1, "predicted_step_s": 0.07, "step_prediction_off": -0.3}
    assert "(prediction -30%); plan again" in prediction_line(pace)
    busy = "the machine was busy (load 5.0 on 2 cores)"
    assert "(prediction -30%); the machine was busy (load 5.0 on 2 cores); plan again" in prediction_line(pace, busy)
    assert prediction_line({**pace, "step_prediction_off": 0.19}) == ""
    assert prediction_line({**pace, "steps": 4}) == ""
    ranks = [{"rank": 0, "peak_bytes": 100 * 2**20}, {"rank": 1, "peak_bytes": 200 * 2**20}]
    line = set_against_plan(ranks, [110 * 2**20, 150 * 2**20])  # rank 0 +10 %, rank 1 -25 %
    assert [r["prediction_off"] for r in ranks] == [0.1, -0.25] and ranks[1]["predicted_bytes"] == 150 * 2**20
    assert line.startswith("gputrain: warning: rank 1 held 200.0 MiB") and "lower trainer.batch_size" in line
    assert "a larger trainer.batch_size may fit" in set_against_plan(ranks, [130 * 2**20, 200 * 2**20])
    assert set_against_plan(ranks, [100 * 2**20, 190 * 2**20]) == ""
    assert set_against_plan([{"rank": 0, "peak_bytes": 1}], []) == ""  # nothing predicted
