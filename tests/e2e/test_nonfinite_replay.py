"""``gputrain replay`` in a fresh process prints the report a 2-process command-line run printed (issue 41)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nonfinite_runs import nan_index, write_data

TESTS = str(Path(__file__).resolve().parents[1])


def test_gputrain_replay_in_a_fresh_process_prints_the_report_of_the_run(tmp_path):
    write_data(tmp_path / "data", nan_sample=True)
    recipe = tmp_path / "planted.yaml"
    recipe.write_text(f"task: nonfinite_runs:build\nmodel:\n  name: nonfinite_runs:model\n  kwargs: {{cause: sample}}\n"
                      f"data:\n  root: {tmp_path / 'data'}\ntrainer:\n  strategy: ddp\n  accelerator: cpu\n  epochs: 1\n"
                      "  batch_size: 1\n  log_every_n_steps: 8\n  progress_bar: false\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    gputrain = [sys.executable, "-m", "gputrain"]
    train = subprocess.run([*gputrain, "train", str(recipe), "--devices", "2", "--seed", "0", "--out",
                            str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert train.returncode == 3, train.stderr[-2000:]
    error = train.stderr.strip().splitlines()[-1]
    assert f"sample {nan_index()} (" in error and "on rank 1 holds NaN/inf" in error
    assert "Traceback" not in train.stderr
    replay = subprocess.run([*gputrain, "replay", str(tmp_path / "run" / "nonfinite")], capture_output=True, text=True,
                            env=env, timeout=300)
    assert replay.returncode == 0, replay.stderr[-2000:]
    line = replay.stdout.strip().splitlines()[-1]
    assert line.startswith("replay of step ") and line in error
    assert "note: the run reported" not in replay.stdout
    # A folder that is no bundle: one line.
    wrong = subprocess.run([*gputrain, "replay", str(tmp_path / "data")], capture_output=True, text=True, env=env,
                           timeout=300)
    assert wrong.returncode == 2 and wrong.stderr.strip().startswith("gputrain: error: ")
    assert "is not a replay bundle" in wrong.stderr and "Traceback" not in wrong.stderr
