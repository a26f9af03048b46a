"""The README's distributed promises on 2 real gloo ranks, each checked so that its planted fault fails it.

One ``run_ranks`` call (the ``ddp_runs`` fixture) runs several short trainings on 2 ranks, since
starting ranks costs more than training these models; the test process runs the 1-process
references. ``scripts/mutants.py`` plants one fault at a time and runs these tests; the fault each
test exists for is named in its docstring (the models, data and runs: tests/ddp_promise_runs.py).
Checked on 2 ranks:

* evaluation during DDP training with plain BatchNorm equals evaluating the saved checkpoint in 1 process;
* every validation sample is counted once (an odd-sized set);
* gradients are all-reduced once per step, not once per micro-batch (a counting DDP comm hook);
* SyncBatchNorm, applied by the trainer, gives the weights and running stats of 1 process;
* resume equals the uninterrupted run with dropout, a cosine schedule, Adam and fp16 loss scaling;
* with a last step that leaves rank 1 without samples (gradients averaged by hand), DDP equals 1
  process with the global batch and reads each sample once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ddp_promise_runs import (
    RESUME_STEPS_PER_EPOCH,
    CountGradAllReduce,
    Crash,
    CrashAfterStep,
    bn_model,
    dropout_model,
    images,
    max_diff,
    plain_model,
    resume_runs,
    state_of,
    train,
    vectors,
)
from gputrain import Trainer
from gputrain.checkpoint import load_checkpoint
from gputrain.config import OptimConfig, SchedulerConfig
from gputrain.dist import DistInfo
from gputrain.tasks.base import Task
from multiproc import run_ranks

N_EVEN = 32
"""2 ranks x batch 4 x accumulation 2 = 16 samples a step: 2 full steps, no rank ever idle."""
N_VAL = 7
"""Odd: the shards differ in length, so padding would count a sample twice."""
N_UNEVEN = 17
"""2 ranks x batch 4 = 8 a step: steps of 8, 8 and 1, and in the last one rank 1 has nothing."""


# -- the 2-rank worker: every scenario in one start of the ranks ---------------------------------
def _scenario(results: dict[str, Any], name: str, fn: Any) -> None:
    """Run one scenario; an error is returned as text, so the other scenarios still report."""
    try:
        results[name] = fn()
    except Exception as err:  # reported by the test that reads this scenario
        results[name] = {"error": f"{type(err).__name__}: {err}"}


def ddp_worker(info: DistInfo, root: str) -> dict[str, Any]:
    base = Path(root)
    results: dict[str, Any] = {}

    def bn_eval() -> dict[str, Any]:
        counter = CountGradAllReduce()
        t = train(base / "bn_eval", bn_model(), images(N_EVEN, 1), images(N_VAL, 2), hooks=[counter],
                  strategy="ddp", devices=2, accumulate_grad_batches=2, eval_batch_size=2, epochs=2)
        return {"calls": counter.calls, "buckets": len(counter.buckets), "steps": t.state.global_step,
                "micro_batches": t.state.global_step * 2}

    def syncbn() -> dict[str, Any]:
        t = train(base / "syncbn", bn_model(), images(N_UNEVEN, 4), strategy="ddp", devices=2,
                  sync_batchnorm=True, epochs=2)
        return {"state": state_of(t)}

    def uneven() -> dict[str, Any]:
        t = train(base / "uneven", plain_model(), vectors(N_UNEVEN, 5), strategy="ddp", devices=2, epochs=2)
        return {"state": state_of(t), "samples_seen": t.state.samples_seen}

    _scenario(results, "bn_eval", bn_eval)
    _scenario(results, "syncbn", syncbn)
    _scenario(results, "resume", lambda: resume_runs(base / "resume", strategy="ddp", devices=2, batch_size=4))
    counted = results["bn_eval"]
    if "error" not in counted and counted["calls"] != counted["steps"] * counted["buckets"]:
        # A run that all-reduces gradients on a micro-batch that is not a step's last would, in the
        # uneven step, make rank 0 wait in backward for rank 1, which has nothing to run: a hang.
        results["uneven"] = {"error": "not run: gradient all-reduces are not once per step (see bn_eval)"}
    else:
        _scenario(results, "uneven", uneven)
    return results


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ddp_runs")
    return root, run_ranks(ddp_worker, str(root))


def _result(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, r in enumerate(ranks):
        assert "error" not in r[name], f"rank {rank}: {r[name]['error']}"
    return [r[name] for r in ranks]


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- the tests ---------------------------------------------------------------------------------
def test_ddp_validation_equals_evaluating_the_saved_checkpoint_in_one_process(ddp_runs, tmp_path):
    """Fault: no buffer sync before evaluation (each rank normalises with its own running stats)."""
    root, ranks = ddp_runs
    _result(ranks, "bn_eval")
    run = root / "bn_eval"
    logged = [r for r in _records(run) if "val/loss" in r][-1]
    model = bn_model()
    model.load_state_dict(load_checkpoint(run / "checkpoints" / "last.pt")["model"])
    fresh = bn_model()
    assert max_diff(dict(model.state_dict()), dict(fresh.state_dict())) > 1e-3, "training must move the weights"
    again = Trainer(strategy="single", accelerator="cpu", out=str(tmp_path / "eval"), batch_size=3,
                    progress_bar=False, loggers=[]).validate(model, images(N_VAL, 2), task=Task(F.mse_loss))
    assert again["val/samples"] == N_VAL
    assert logged["val/loss"] == pytest.approx(again["val/loss"], abs=1e-6, rel=1e-6)


def test_ddp_evaluation_counts_every_sample_once(ddp_runs):
    """Fault: the evaluation sampler pads the shards like DistributedSampler (7 samples -> 8 counted)."""
    root, ranks = ddp_runs
    _result(ranks, "bn_eval")
    evaluated = [r for r in _records(root / "bn_eval") if "val/samples" in r]
    assert [r["val/samples"] for r in evaluated] == [N_VAL, N_VAL]  # one evaluation per epoch
    summary = json.loads((root / "bn_eval" / "summary.json").read_text())
    assert summary["final"]["val/samples"] == N_VAL
    assert summary["final"]["train/samples"] == N_EVEN


def test_accumulation_all_reduces_gradients_once_per_step(ddp_runs):
    """Fault: DDP synchronises gradients on every micro-batch (the weights are the same either way)."""
    _, ranks = ddp_runs
    for r in _result(ranks, "bn_eval"):
        assert r["steps"] == 4 and r["buckets"] >= 1
        assert r["calls"] == r["steps"] * r["buckets"], (
            f"{r['calls']} gradient all-reduces for {r['steps']} steps of {r['micro_batches']} micro-batches "
            f"and {r['buckets']} bucket(s)")


def test_sync_batchnorm_gives_the_running_stats_of_global_batchnorm(ddp_runs, tmp_path):
    """Fault: the trainer drops the SyncBatchNorm conversion (config says true, layers stay local)."""
    _, ranks = ddp_runs
    states = [r["state"] for r in _result(ranks, "syncbn")]
    reference = state_of(train(tmp_path / "one", bn_model(), images(N_UNEVEN, 4), strategy="single",
                               batch_size=8, epochs=2))
    assert max_diff(reference, dict(bn_model().state_dict())) > 1e-3, "training must move weights and stats"
    assert max_diff(states[0], states[1]) == 0.0
    for key in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(states[0][key], reference[key], atol=1e-5, rtol=0, msg=key)
    assert max_diff(states[0], reference) <= 1e-5


def test_resume_on_two_ranks_equals_the_uninterrupted_run(ddp_runs):
    """Faults: RNG, scheduler, GradScaler or optimizer state not restored on resume."""
    root, ranks = ddp_runs
    results = _result(ranks, "resume")
    assert results[0]["scale"] < 65536.0, "the GradScaler must have lowered its scale for the test to mean anything"
    assert max_diff(results[0]["full"], dict(dropout_model().state_dict())) > 1e-3
    for r in results:
        assert max_diff(r["full"], r["resumed"]) == 0.0
    resumed = _records(root / "resume" / "crashed")
    assert [r["epoch"] for r in resumed if "val/loss" in r or "train/samples" in r] == [1, 2]


def test_ddp_with_an_idle_rank_in_the_last_step_equals_one_process(ddp_runs, tmp_path):
    """Faults: gradients summed instead of averaged; replicas not synchronised; training order padded."""
    _, ranks = ddp_runs
    results = _result(ranks, "uneven")
    reference = train(tmp_path / "one", plain_model(), vectors(N_UNEVEN, 5), strategy="single", batch_size=8,
                      epochs=2)
    assert max_diff(state_of(reference), dict(plain_model().state_dict())) > 1e-3
    assert max_diff(results[0]["state"], results[1]["state"]) == 0.0, "replicas must stay identical"
    assert max_diff(results[0]["state"], state_of(reference)) <= 1e-5
    assert [r["samples_seen"] for r in results] == [2 * N_UNEVEN] * 2  # 2 epochs, each sample once


def test_resume_in_one_process_equals_the_uninterrupted_run(tmp_path):
    """Faults: RNG, scheduler, GradScaler or optimizer state not restored on resume (1 process)."""
    result = resume_runs(tmp_path, strategy="single", batch_size=4)
    assert result["scale"] < 65536.0, "the GradScaler must have lowered its scale for the test to mean anything"
    assert max_diff(result["full"], dict(dropout_model().state_dict())) > 1e-3
    assert max_diff(result["full"], result["resumed"]) == 0.0


def test_resume_from_the_middle_of_an_epoch_equals_the_uninterrupted_run(tmp_path):
    common = dict(optim=OptimConfig(name="adam", lr=1e-2), scheduler=SchedulerConfig(name="cosine"),
                  precision="16-mixed", epochs=2, strategy="single", batch_size=4, checkpoint_every_n_steps=2)
    data = vectors(4 * RESUME_STEPS_PER_EPOCH, 3, input_scale=0.25)
    full = state_of(train(tmp_path / "full", dropout_model(), data, **common))
    try:
        train(tmp_path / "crashed", dropout_model(), data, hooks=[CrashAfterStep(3)], **common)
    except Crash:
        pass
    resumed = train(tmp_path / "crashed", dropout_model(), data, resume="auto", **common)
    assert resumed.state.global_step == 2 * RESUME_STEPS_PER_EPOCH
    assert max_diff(full, state_of(resumed)) == 0.0
