"""``gputrain replay RUN/nonfinite``: rerun the step a run went non-finite on, from the files it left, on any machine.

The bundle holds the state before the step (a full checkpoint, with the run's config), each rank's micro-batches as
its model received them, and the report. One process plays each rank in turn on that state: its forward and
backward watched in the run's precision, their gradients summed as the ranks' average, the optimizer step, then
each rank again in float32 (:func:`gputrain.engine.forensics.run_watched` does the same on a run's live ranks), and
prints the report the run printed. Each rank's BatchNorm sees that rank's samples, as without SyncBatchNorm.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gputrain.checkpoint import load_checkpoint
from gputrain.checkpoint.state import restore
from gputrain.config import RunConfig, load_config
from gputrain.dist import DistInfo
from gputrain.engine import setup
from gputrain.engine.forensics import BUNDLE, StateCopy, loaded_micro_batches, step_outcome
from gputrain.engine.replay import Findings, bad_samples, float32_precision, record_pass, watched_pass
from gputrain.engine.verdict import Report, decide
from gputrain.optim import build_scheduler
from gputrain.tasks.base import Task


def _bundle(path: str | Path) -> Path:
    bundle = Path(path)
    if not bundle.is_dir():
        raise ValueError(f"{bundle} does not exist; give the nonfinite/ folder a run wrote when it went non-finite, "
                         "e.g. runs/latest/nonfinite")
    if (bundle / BUNDLE / "report.json").is_file():  # the run folder was given
        bundle = bundle / BUNDLE
    missing = [name for name in ("report.json", "state.pt") if not (bundle / name).is_file()]
    if missing:
        raise ValueError(f"{bundle} is not a replay bundle (no {' or '.join(missing)}); give the nonfinite/ folder a "
                         "run wrote when it went non-finite, e.g. runs/latest/nonfinite")
    return bundle


def _config(saved: dict[str, Any], device: str) -> RunConfig:
    layer = {k: v for k, v in saved.items() if k != "launch"}
    # The learning rate comes from the optimizer's saved state (the schedule's value at the step), not the config.
    layer["optim"] = {k: v for k, v in saved.get("optim", {}).items() if k != "lr"}
    layer["trainer"] = {**saved.get("trainer", {}), "out": "", "resume": "", "overwrite": False, "devices": 1,
                        "strategy": "single", "accelerator": device, "compile": False}
    return load_config(None, [], layers=[layer])


def _model_and_task(cfg: RunConfig, state: dict[str, Any], path: Path) -> tuple[nn.Module, Task]:
    """The run's model and task, rebuilt from its config (recipes and ``package.module:function`` tasks)."""
    from gputrain.tools.from_checkpoint import PYTHON_TASK, build_fitting_model

    if cfg.task == PYTHON_TASK:
        raise ValueError(f"{path} is of a run trained from Python with model {cfg.model.name or 'of your own'}; replay "
                         f"it from Python: gputrain.tools.diagnose.replay.replay_bundle({str(path)!r}, model=..., "
                         "task=gputrain.tasks.base.Task(loss)), with the model built as in training")
    from gputrain.tasks import TASKS, build_task, prediction_task

    model = build_fitting_model(cfg, state, path)
    try:
        return model, build_task(cfg).task  # the training task: its loss and any on-device normalisation
    except (OSError, ValueError) as err:
        if cfg.task not in TASKS:
            raise
        # Its data is not on this machine; the micro-batches are in the bundle, and evaluation's task has the loss.
        print(f"gputrain: the run's data is not here ({str(err).splitlines()[0]}): replaying with the task "
              "evaluation builds", flush=True)
        return model, prediction_task(cfg)[0]


def replay_bundle(path: str | Path, *, model: nn.Module | None = None, task: Task | None = None,
                  device: str = "cpu") -> Report:
    """Replay the bundle at ``path`` in this process and return its report (``model``/``task``: a Python-API run's)."""
    bundle = _bundle(path)
    record = json.loads((bundle / "report.json").read_text())
    state = load_checkpoint(bundle / "state.pt")
    cfg = _config(state.get("config") or {}, device)
    if model is None or task is None:
        model, task = _model_and_task(cfg, state, bundle)
    loop = setup.build_runtime(cfg, DistInfo(device=torch.device(device)), task, model)
    loop.module = loop.strategy.setup_module(loop.module)
    loop.optimizer = loop.strategy.setup_optimizer(loop.module, cfg.optim)
    loop.scheduler = build_scheduler(loop.optimizer, cfg.scheduler, total_steps=1, steps_per_epoch=1)
    restore(loop.parts, state, str(bundle / "state.pt"))
    ranks = int(record.get("world_size", 1))
    dp = int(record.get("dp_size", ranks))
    missing = [f"rank{r}.pt" for r in range(ranks) if not (bundle / f"rank{r}.pt").is_file()]
    if missing:
        raise ValueError(f"{bundle} lacks {', '.join(missing)} of its {ranks} rank(s)' micro-batches (copied in part?); "
                         "copy the whole nonfinite/ folder the run wrote")
    micros = [loaded_micro_batches(torch.load(bundle / f"rank{r}.pt", weights_only=True), loop.strategy.root_device)
              for r in range(ranks)]
    findings = [Findings(r, samples=[list(key) for _, keys in micros[r] for key in keys],
                         bad_samples=bad_samples(micros[r])) for r in range(ranks)]
    float16 = loop.precision.name == "16-mixed"
    before = StateCopy(loop)
    loop.module.train()
    for found, share in zip(findings, micros, strict=True):  # each rank's gradients added: 1/dp makes their average
        loop.precision.begin_step(loop.module)
        watch, finite = watched_pass(loop.strategy, loop.module, share, loop.task, loop.precision, float16=float16,
                                     weight_scale=1.0 / dp)
        record_pass(found, watch, finite, float32=False, model=loop.module)
        before.restore_weights(loop)  # the next rank starts from the same weights and buffers
    outcome = step_outcome(loop)
    before.restore(loop)
    for found, share in zip(findings, micros, strict=True):
        watch, finite = watched_pass(loop.strategy, loop.module, share, loop.task, float32_precision(loop.precision),
                                     float16=False, weight_scale=1.0 / dp)
        record_pass(found, watch, finite, float32=True)
        before.restore(loop)
    return decide(findings, outcome, step=int(record["step"]), epoch=int(record["epoch"]) - 1,
                  precision=str(record["precision"]), data_parallel=bool(record["data_parallel"]),
                  sample_names=record.get("sample_files") or {}, float32_modules=list(cfg.trainer.fp32_modules))


def run_replay(path: str | Path, *, device: str = "cpu") -> int:
    """The CLI: print the report of the replayed step; exit 0 (the replay ran, whatever it found)."""
    torch.manual_seed(0)
    report = replay_bundle(path, device=device)
    print(report.line, flush=True)
    saved = json.loads((_bundle(path) / "report.json").read_text())["report"]["line"]
    if saved != report.line:
        print(f"gputrain: note: the run reported: {saved}", flush=True)
    return 0
