"""Promises of recent code that planted one-line faults passed every test (issue 43 item 8): one test each.

Each test runs the real thing (a ``Trainer.fit`` on the CPU, the plan's counts on fake tensors, the direct launcher's
ranks, the ONNX exporter and onnxruntime) and names in its docstring the promise and the planted fault it catches
(tests/faults.py, the ``[43r]`` entries).
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Hook, Trainer
from gputrain.config import OptimConfig, RunConfig
from tiny_fit import _fit


class Steps(Hook):
    """The model's weights before the run and after every step, and each step's logs."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []
        self.logs: list[dict[str, float]] = []

    def _keep(self, model: nn.Module) -> None:
        self.weights.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))

    def before_fit(self, ctx: Any) -> None:
        self._keep(ctx.model)

    def after_step(self, ctx: Any, logs: dict[str, float] | None) -> None:
        self._keep(ctx.model)
        self.logs.append(dict(logs or {}))


# -- 16-mixed with gradient clipping: unscale, then clip (docs/precision.md, "16-mixed and the GradScaler") ------
@pytest.mark.parametrize("precision", ["16-mixed", "32"])
def test_clipping_at_16_mixed_clips_the_true_gradients_not_the_scaled_ones(tmp_path, precision):
    """Promise: with trainer.grad_clip_norm at 16-mixed the GradScaler unscales the gradients before they are
    clipped, so a clipped SGD step moves the weights by lr x grad_clip_norm, as at 32. Planted fault: clipped while
    still scaled (by thousands), a step moves the weights by lr x grad_clip_norm / scale: the model hardly trains
    (here not at all: the move is below float32's resolution of the weights)."""
    lr, clip = 0.1, 1e-3  # the gradients' norm is about 10: every step is clipped
    steps = Steps()
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=lr, momentum=0.0)), strategy="single",
                      accelerator="cpu", progress_bar=False, loggers=[], batch_size=4, epochs=1, out=str(tmp_path),
                      precision=precision, grad_clip_norm=clip, log_every_n_steps=1, hooks=[steps])
    trainer.fit(nn.Linear(4, 1), TensorDataset(x, x.sum(1, keepdim=True)), loss=F.mse_loss)
    trained = [i for i, logs in enumerate(steps.logs) if not logs.get("train/skipped_steps")]
    assert len(trained) >= 4, steps.logs  # 16-mixed: the first steps calibrate the scale (skipped), then it trains
    for i in trained:
        moved = float((steps.weights[i + 1] - steps.weights[i]).norm())
        assert moved == pytest.approx(lr * clip, rel=1e-3), (i, moved)


# -- a resumed 16-mixed epoch remembers the samples the loss scaler skipped before the stop (engine/state.py) -----
class StopAt(Hook):
    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, ctx: Any, logs: dict[str, float] | None) -> None:
        if ctx.state.global_step == self.step:
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # the run's handler, as if SIGTERM came now


def _records(out: Path) -> tuple[dict[int, dict[str, Any]], dict[int, float]]:
    """metrics.jsonl as (epoch -> its epoch record, step -> its logged train/loss)."""
    epochs, steps = {}, {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "time/epoch_s" in record:
            epochs[record["epoch"]] = record
        elif "train/loss" in record:
            steps[record["step"]] = record["train/loss"]
    return epochs, steps


@pytest.mark.parametrize("log_every", [1, 3], ids=["skips-in-flushed-windows", "skips-in-the-open-window"])
def test_a_resumed_16_mixed_epoch_logs_the_loss_of_the_uninterrupted_run(tmp_path, log_every):
    """Promise: the checkpoint carries the epoch's samples the loss scaler skipped (LossWindow.carry: the flushed
    windows' and the open one's), so the resumed epoch's loss is the mean over its trained samples, as the
    uninterrupted run logs it. Here the scale's calibration skips steps 1-3 of 4 and the run stops after step 2.
    Planted faults: the skipped samples of the flushed windows (or of the open one) forgotten at the resume: the
    epoch's loss is then divided by 3 (or the window's)."""
    from gputrain.errors import Interrupted

    common = dict(n=16, batch_size=4, epochs=2, precision="16-mixed", log_every_n_steps=log_every)
    _fit(tmp_path / "whole", **common)
    with pytest.raises(Interrupted):
        _fit(tmp_path / "stopped", hooks=[StopAt(2)], **common)
    _fit(tmp_path / "stopped", resume="auto", **common)
    whole, resumed = _records(tmp_path / "whole"), _records(tmp_path / "stopped")
    assert whole[0][1]["train/skipped_samples"] == 12  # the steps the test is about: skipped before and after the stop
    for epoch in (1, 2):
        for key in ("train/loss", "train/samples", "train/skipped_samples", "val/loss"):
            assert resumed[0][epoch].get(key) == whole[0][epoch].get(key), (epoch, key)
    assert resumed[1] == whole[1]  # every logged loss too


# -- gputrain plan: each plan's largest batch (docs/plan.md) ----------------------------------------------------------
@pytest.fixture(scope="module")
def autoencoder(tmp_path_factory) -> Any:
    from gputrain.config import load_config
    from gputrain.data.imagefolder import make_frames
    from gputrain.tools.plan.workload import Workload

    frames = make_frames(tmp_path_factory.mktemp("data") / "frames", count=8, size=40, videos=2)
    cfg = load_config("autoencoder", [f"data.root={frames}"])
    return Workload.from_config(cfg, torch.device("cpu"), "32")


def _planner(work: Any, budget: int, **options: Any) -> Any:
    from gputrain.strategies.fsdp import shard_units
    from gputrain.tools.plan.plans import Planner
    from gputrain.tools.plan.timing import Probe

    return Planner(work, devices=2, global_batch=4, budget=budget, probe=Probe(4, 0.1, None), shares=None,
                   micro_batches=1, fsdp_units=shard_units(work.model), **options)


def _budget(room: int) -> int:
    """The budget whose room (what a plan may use: the budget less the margin) is ``room`` bytes."""
    from gputrain.tools.plan.plans import MARGIN

    return math.ceil(room / (1 - MARGIN))


def test_fsdp_and_ddps_largest_global_batch_is_every_ranks_largest_share(autoencoder):
    """Promise: a data-parallel plan's "largest global batch" is what its 2 ranks train together when each holds the
    largest share that fits the budget with the margin: 2 x 5 = 10 where a rank's count at 5 fills the room, and a
    rank's count at its share fits while one more sample does not. Planted fault: one rank's largest share reported
    as the global batch (5: half what fits)."""
    from gputrain.tools.plan import memory, split_memory

    units = _planner(autoencoder, 1).fsdp_units
    fsdp_at = lambda k: split_memory.fsdp_memory(autoencoder, k, 2, units).peak  # noqa: E731
    ddp_at = lambda k: memory.step_memory(autoencoder, k, held_gradients=True).peak  # noqa: E731
    for label, at in (("fsdp", fsdp_at), ("ddp", ddp_at)):
        room = at(5)
        plan = getattr(_planner(autoencoder, _budget(room)), label)()
        assert plan.max_global_batch == 10, (label, plan.max_global_batch)
        share = plan.max_global_batch // plan.devices
        assert at(share) <= room < at(share + 1), label


def test_the_largest_batch_keeps_room_for_the_cuda_allocators_overhead(autoencoder):
    """Promise: on CUDA the allocator's overhead over the counted tensors (cuda_overhead, measured by the probe step)
    is held whatever the batch, so it counts in every plan's peak and in its largest batch: the batch whose count plus
    the overhead fits the room, one more does not. Planted fault: StepMemory.plus adds the overhead to the peak but
    not to the step's moments, which the largest batch is computed from: a largest batch that does not fit."""
    from gputrain.tools.plan import memory

    at = lambda k: memory.step_memory(autoencoder, k).peak  # noqa: E731
    overhead = at(4)  # as large as a step: the largest batch without it would be about twice what fits
    room = at(12) + overhead
    plan = _planner(autoencoder, _budget(room), cuda_overhead=overhead).single()
    assert plan.peak == at(4) + overhead
    largest = plan.max_global_batch
    assert at(largest) + overhead <= room < at(largest + 1) + overhead, largest
    assert largest == 12


# -- the direct launcher's ranks share the node's cores (src/gputrain/launcher/direct.py) --------------------------
def test_the_ranks_a_launcher_starts_each_get_their_share_of_the_cores(monkeypatch):
    """Promise: without OMP_NUM_THREADS set, each of the N ranks the launcher starts on a node gets the node's cores
    divided by N (torchrun would give 1 and warn); a user's own OMP_NUM_THREADS is kept. Real ranks started by
    run_function, on a node taken to have 8 cores. Planted fault: every rank gets all the cores (N-fold
    oversubscription)."""
    from gputrain.launcher.direct import run_function

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    results, failures = run_function(2, os.getenv, ("OMP_NUM_THREADS",))
    assert not failures and results == ["4", "4"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    results, failures = run_function(2, os.getenv, ("OMP_NUM_THREADS",))
    assert not failures and results == ["3", "3"]


# -- --overwrite clears a run folder of trainer.measure_memory=true (src/gputrain/runs/folder.py) ----------------
def test_overwrite_clears_a_run_that_measured_its_memory(tmp_path):
    """Promise: --overwrite replaces a folder holding only what gputrain wrote, memory.json (trainer.measure_memory)
    included. Planted fault: memory.json not among gputrain's files: the folder is refused as holding another's
    file."""
    out = tmp_path / "run"
    _fit(out, epochs=1, measure_memory=True)
    assert (out / "memory.json").is_file()
    _fit(out, epochs=1, overwrite=True)
    assert not (out / "memory.json").exists() and (out / "checkpoints" / "last.pt").is_file()


# -- gputrain export onnx: the model in eval mode, with a dynamic batch axis (docs/export.md) ---------------------
def test_export_model_exports_the_model_in_eval_mode(tmp_path):
    """Promise: export_model loads the weights and exports the model in eval mode: BatchNorm normalizes with its
    running statistics and Dropout passes everything, so onnxruntime gives what model.eval() gives, for any batch
    size. Planted fault: the model exported as it came (train mode): the file normalizes each batch by itself."""
    import numpy as np
    import onnxruntime as ort

    from gputrain.tools.export import export_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5),
                          nn.Conv2d(4, 2, 1))
    with torch.no_grad():  # running statistics far from any one batch's
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(4.0)
    model.train()
    diff = export_model(model, None, tmp_path / "m.onnx", input_shape=[2, 3, 8, 8])
    assert diff < 1e-4
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x.numpy()})[0]
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    assert np.abs(got - expected).max() < 1e-4


# -- launch-time checks: data.val_root (src/gputrain/cli/preflight.py, docs/cli.md "Checked before any worker") --
def test_a_missing_val_root_is_one_line_before_any_worker(tmp_path):
    """Promise: data.root, data.val_root and data.annotations are checked to exist before any worker starts, each
    missing one in one line naming the field. Planted fault: data.val_root left to the workers."""
    from gputrain.cli import preflight
    from gputrain.config import load_config
    from gputrain.data.imagefolder import make_frames

    frames = make_frames(tmp_path / "frames", count=2, size=16, videos=1)
    preflight.check_data_paths(load_config("autoencoder", [f"data.root={frames}"]))
    missing = tmp_path / "no-val"
    with pytest.raises(FileNotFoundError) as err:
        preflight.check_data_paths(load_config("autoencoder", [f"data.root={frames}", f"data.val_root={missing}"]))
    assert str(err.value) == f"data.val_root={missing} does not exist; set data.val_root to an existing path"


# -- 16-mixed: a skipped step is told by the scale going down, not by its changing (docs/precision.md) -------------
def test_a_step_after_which_the_scaler_doubles_its_scale_trained():
    """Promise: gputrain detects a skipped step by the GradScaler's scale going down; after growth_interval trained
    steps in a row (2000 by default, 2 here) the scaler doubles its scale, and that step trained: it counts as
    stepped and keeps the statistics its forward gave BatchNorm. Planted fault: any change of the scale taken for a
    skip: every 2000th step's loss is left out and its BatchNorm update undone."""
    from gputrain.precision import build_precision

    precision = build_precision("16-mixed", torch.device("cpu"))
    precision.load_state_dict({"scaler": {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                          "growth_interval": 2, "_growth_tracker": 0}})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    scales, stepped = [], []
    for _ in range(4):
        precision.begin_step(model)
        before = model[1].running_mean.clone()
        with precision.forward_context():
            loss = F.mse_loss(model(x).float(), x.sum(1, keepdim=True))
        precision.backward(loss)
        stepped.append(precision.optimizer_step(optimizer))
        optimizer.zero_grad()
        scales.append(precision.scaler.get_scale())
        assert not torch.equal(model[1].running_mean, before)  # the step's BatchNorm update is kept
    assert scales == [1.0, 2.0, 2.0, 4.0] and stepped == [True] * 4
