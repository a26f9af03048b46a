"""The replay of a non-finite step on 2 real gloo ranks names the rank too, and ``replay_bundle`` on one process
reads the same report back from the files the run wrote (issue 41).

One start of 2 ranks runs the four planted causes of tests/nonfinite_runs.py one after the other under ddp, and the
backward one under fsdp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from gputrain.tasks.base import Task
from gputrain.tools.diagnose.replay import replay_bundle
from multiproc import run_ranks
from nonfinite_runs import NAN_POSITION, fail, model, nan_index

CAUSES = ("overflow", "sample", "backward", "lr")


def _worker(info: Any, root: str) -> dict[str, str]:
    lines = {cause: fail(Path(root) / cause, cause, devices=2) for cause in CAUSES}
    # fsdp: each rank restores its own shards; the checkpoint every 2 steps is never written (NaN weights from step
    # 1), so the replay starts from the starting weights the run kept.
    lines["fsdp"] = fail(Path(root) / "fsdp", "backward", devices=2, strategy="fsdp", checkpoint_every=2)
    return lines


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("nonfinite")
    lines = run_ranks(_worker, str(root))
    assert lines[0] == lines[1]  # every rank raises the same line
    return root, lines[0]


def test_each_cause_is_named_with_its_rank_on_two_ranks(two_ranks):
    _, lines = two_ranks
    assert "the first non-finite value is in 2 (Amplify): its output became inf, on rank 0" in lines["overflow"]
    assert "fix: trainer.fp32_modules=[2]" in lines["overflow"]
    # The NaN sample is the last of its step's global batch of 2: rank 1's.
    assert f"replay of step {NAN_POSITION // 2 + 1} (epoch 1): sample {nan_index()} (" in lines["sample"]
    assert "on rank 1 holds NaN/inf in its input" in lines["sample"]
    assert "2 (SqrtAtZero): its input gradient became NaN, on rank 0" in lines["backward"]
    assert "the optimizer step made the weights NaN/inf" in lines["lr"]
    assert "replay of step 1 (epoch 1) at precision 32: the first non-finite value is in 2 (SqrtAtZero)" in lines["fsdp"]


@pytest.mark.parametrize("cause", CAUSES)
def test_one_process_replaying_each_ranks_share_prints_the_runs_report(two_ranks, cause):
    root, lines = two_ranks
    bundle = root / cause / "run" / "nonfinite"
    report = replay_bundle(bundle, model=model(cause), task=Task(nn.functional.cross_entropy))
    assert report.line == (bundle / "report.txt").read_text().strip()
    assert report.line in lines[cause]
