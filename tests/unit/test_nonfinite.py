"""When a run goes non-finite, the replay of the failing step names the cause (issue 41): one process.

Each planted cause (tests/nonfinite_runs.py) ends a real run; its error line must name what the replay found, and
the fix it suggests must work where it is a setting.
"""

from __future__ import annotations

import json

import pytest

from gputrain.data.samplers import EpochPlan
from gputrain.nn.watch import Watch
from nonfinite_runs import NAN_POSITION, SEED, N, fail, nan_index


def test_a_module_that_overflows_float16_is_named_and_its_fp32_modules_fix_trains(tmp_path):
    line = fail(tmp_path / "a", "overflow")
    assert "the gradients of 25 steps in a row" in line
    assert "replay of step 1 (epoch 1) at precision 16-mixed: the first non-finite value is in 2 (Amplify): its " \
           "output became inf, on rank 0" in line
    assert "float32 makes the step finite; fix: trainer.fp32_modules=[2] (or --precision bf16-mixed)" in line
    report = json.loads((tmp_path / "a/run/nonfinite/report.json").read_text())
    assert report["report"]["module"] == "2" and report["report"]["cause"] == "forward"
    stats = json.loads((tmp_path / "a/run/nonfinite/stats.json").read_text())["0"]
    assert stats["outputs"]["2"] is None and stats["outputs_float32"]["2"] < 100  # inf in float16; small in float32
    # The fix the report names: the run trains to its end, no step skipped.
    assert fail(tmp_path / "b", "overflow", fp32_modules=["2"]) == ""
    logged = [json.loads(line) for line in (tmp_path / "b/run/metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("train/skipped_steps", 0) for r in logged) == 0


def test_a_module_kept_in_float32_whose_output_overflows_the_next_float16_op_gets_both_in_the_fix(tmp_path):
    """A helper trying the docs as a new user found the fix circular: with the named module kept in float32, the
    report named it again. The report names the float16 op that overflows, and the list keeps the first module."""
    first = fail(tmp_path / "a", "loud")
    assert "the first non-finite value is in 2 (Scale): its output became inf" in first
    assert "fix: trainer.fp32_modules=[2] (or --precision bf16-mixed)" in first
    second = fail(tmp_path / "b", "loud", fp32_modules=["2"])
    assert "the first non-finite value is in 4 (Linear): its output became " in second
    assert "from values up to " in second and " out of 2 (Scale), beyond float16's 65504" in second
    assert "fix: trainer.fp32_modules=[2,4] (or --precision bf16-mixed)" in second
    assert fail(tmp_path / "c", "loud", fp32_modules=["2", "4"]) == ""


def test_a_run_shorter_than_the_skip_limit_whose_every_step_overflows_fails_too(tmp_path):
    """8 steps, each skipped by the loss scaler: the run trained nothing, and once ended with exit 0."""
    line = fail(tmp_path, "overflow", global_batch=8)
    assert line.startswith("the gradients of 8 steps in a row (trainer.precision=16-mixed) became NaN/inf at epoch 1 "
                           "step 8; replay of step 1 (epoch 1)")


def test_a_nan_in_one_samples_file_names_that_sample_and_file(tmp_path):
    line = fail(tmp_path, "sample")
    step = NAN_POSITION // 2 + 1
    assert f"replay of step {step} (epoch 1): sample {nan_index()} (" in line
    assert f"sample_{nan_index():03d}_{nan_index() % 3}.pt) on rank 0 holds NaN/inf in its input" in line
    saved = json.loads((tmp_path / "run/nonfinite/report.json").read_text())
    assert saved["report"]["samples"] == [[0, nan_index()]] and saved["report"]["cause"] == "data"
    assert saved["replayed_from"] == "the run's starting weights" and saved["epoch"] == 1


def test_the_replay_starts_from_the_newest_checkpoint_before_the_failure(tmp_path):
    fail(tmp_path, "sample")  # a first run leaves nonfinite/ in the folder, which --overwrite clears as gputrain's own
    line = fail(tmp_path, "sample", checkpoint_every=2)
    assert f"replay of step {NAN_POSITION // 2 + 1} (epoch 1): sample {nan_index()}" in line
    assert "the last good checkpoint" in line and "step_000002.pt" in line
    saved = json.loads((tmp_path / "run/nonfinite/report.json").read_text())
    assert saved["replayed_from"] == f"checkpoint {tmp_path / 'run/checkpoints/step_000002.pt'}"


def test_a_nan_made_in_the_backward_names_the_module_and_float32_does_not_remove_it(tmp_path):
    line = fail(tmp_path, "backward")
    assert "the first non-finite value is in 2 (SqrtAtZero): its input gradient became NaN, on rank 0" in line
    assert "float32 does not make it finite, so precision is not the cause; fix: make the backward of 2 finite" in line


def test_a_forward_that_overflows_float32_names_its_modules_weights(tmp_path):
    """Weights grown huge by earlier steps (an H200 run's were, 2026-11-29: fused SGD under the loss scaler) make a
    forward overflow in float32 too: the line gives the module's largest weight, which says where to look."""
    line = fail(tmp_path, "grown")
    assert "the first non-finite value is in 1 (Linear): its output became " in line
    assert "(its weights up to 3e+37 in size), on rank 0" in line
    assert "float32 does not make it finite, so precision is not the cause" in line


def test_weights_made_non_finite_by_the_optimizer_step_name_the_step_not_a_module(tmp_path):
    line = fail(tmp_path, "lr")
    assert "replay of step 1 (epoch 1): the forward and backward are finite" in line
    assert "the optimizer step made the weights NaN/inf at lr 3e+38; no module is the cause" in line


def test_the_watch_names_the_innermost_module_first_in_the_forward_and_backward():
    import torch
    from torch import nn

    from nonfinite_runs import Amplify, SqrtAtZero

    # The block "1" and its first layer "1.0" receive the same input tensor, so the same bad gradient.
    net = nn.Sequential(nn.Linear(12, 16), nn.Sequential(SqrtAtZero(), nn.ReLU()), nn.Linear(16, 3))
    with Watch(net, float16=False) as watch:
        net(torch.randn(2, 12)).sum().backward()
    assert watch.forward is None and watch.backward is not None
    assert (watch.backward.module, watch.backward.kind) == ("1.0", "SqrtAtZero")
    assert set(watch.outputs) == {"0", "1", "1.0", "1.1", "2"}
    assert not net[0]._forward_hooks  # removed on leaving the block
    # The forward: the first float32 output beyond float16's range is kept apart; the first NaN/inf one is the
    # event, the innermost module first (Amplify fires before the blocks around it).
    net = nn.Sequential(nn.Linear(12, 16), nn.Sequential(nn.Sequential(Amplify(1e36), nn.ReLU())), nn.Linear(16, 3))
    with torch.no_grad():
        net[0].bias.fill_(1e5)
    with Watch(net, float16=True) as watch:
        net(torch.randn(2, 12))
    assert watch.beyond is not None and watch.beyond.module == "0" and watch.beyond.value > 65504
    assert watch.forward is not None and (watch.forward.module, watch.forward.kind) == ("1.0.0", "Amplify")


@pytest.mark.parametrize("dp", [1, 2])
def test_the_nan_sample_sits_where_the_tests_expect_it(dp):
    plan = EpochPlan(N, seed=SEED, epoch=0, dp_size=dp, batch_size=2 // dp)
    step = NAN_POSITION // 2
    assert plan.micro_batches(step)[0][dp - 1][-1] == nan_index()  # the last rank's


def test_a_replay_that_fails_leaves_the_runs_own_error_with_a_warning(tmp_path, monkeypatch, capsys):
    """Whatever goes wrong in the replay (a model it cannot run twice, say), the user gets the run's one line."""
    from gputrain.engine import forensics

    def broken(*args, **kwargs):
        raise RuntimeError("a model the replay cannot run")

    monkeypatch.setattr(forensics, "investigate", broken)
    line = fail(tmp_path, "sample")
    assert line.startswith("the training loss became NaN/inf at epoch 1") and "replay of" not in line
    assert "gputrain: warning: the replay of the failing step failed (RuntimeError: a model the replay cannot run)" \
        in capsys.readouterr().err
