"""Runs that survive faults, with real torchrun workers: elastic restarts, a rank that always fails, hangs.

The user-code task in faulty_task.py fails on purpose when the environment asks it to; the same
command without the fault is the uninterrupted reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def _recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "faulty.yaml"
    recipe.write_text(
        "task: faulty_task:build\n"
        f"data: {{root: {tmp_path}}}\n"
        "optim: {name: sgd, lr: 0.1, momentum: 0.9}\n"
        "trainer: {strategy: ddp, accelerator: cpu, epochs: 2, batch_size: 8, progress_bar: false, loggers: [],\n"
        "          log_every_n_steps: 1, checkpoint_every_n_steps: 2, timeout_s: 30}\n"
    )
    return recipe


def _train(recipe: Path, out: Path, *args: str, fault: str = "", **env: str) -> subprocess.CompletedProcess:
    run_env = {**ENV, **env, **({"GPUTRAIN_TEST_FAULT": fault} if fault else {})}
    return subprocess.run([sys.executable, "-m", "gputrain", "train", str(recipe), "--devices", "2", "--out", str(out),
                           *args], capture_output=True, text=True, env=run_env, timeout=300)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoints" / "last.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("faults")
    recipe = _recipe(tmp)
    done = _train(recipe, tmp / "uninterrupted")
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, tmp / "uninterrupted"


@pytest.mark.slow
def test_rank_killed_mid_epoch_is_restarted_and_ends_with_the_uninterrupted_weights(reference, tmp_path):
    recipe, uninterrupted = reference
    out = tmp_path / "restarted"
    # Checkpoints at steps 2, 4, 6, ...; the kill comes in the forward of step 6, so step 5 is redone.
    done = _train(recipe, out, "--max-restarts", "1", fault="kill", GPUTRAIN_TEST_FAULT_STEP="6")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout and "step_000004.pt" in done.stdout
    a, b = _weights(out), _weights(uninterrupted)
    assert all(torch.equal(a[k], b[k]) for k in a), "the restarted run must end bitwise equal"
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    redone = sum(count - 1 for count in Counter(steps).values())
    assert redone == 1, f"steps redone after the restart: {redone} (checkpoint every 2 steps, crash in step 6)"


@pytest.mark.slow
def test_rank_that_always_fails_ends_the_job_and_is_named(reference, tmp_path):
    recipe, _ = reference
    start = time.monotonic()
    done = _train(recipe, tmp_path / "failing", "--max-restarts", "1", fault="raise")
    assert done.returncode != 0
    assert "rank 1" in done.stderr and "planted failure at step 5" in done.stderr
    assert "Traceback" not in done.stderr.splitlines()[-1]
    # timeout_s=30: every rank is gone well within timeout + 10 s of the failure, restarts included.
    assert time.monotonic() - start < 2 * 40 + 30
