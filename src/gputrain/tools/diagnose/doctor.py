"""``gputrain doctor RECIPE``: a short dry run on real ranks that reports distributed mistakes, each with its fix.

The recipe's own task, model and data train for a few steps over two epochs (2 gloo ranks on
CPU, or one process per GPU) through the normal :class:`~gputrain.engine.trainer.Trainer`, with one extra
hook, :class:`DoctorHook`. The hook issues no collectives of its own: each rank streams what it saw
(parameters without gradients, shapes, sample order, timings, files written) to its parent, which
compares the ranks (:mod:`gputrain.tools.doctor_checks`). A rank that dies or hangs still leaves
its records, and the report names the last collective each rank entered.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gputrain.config import RunConfig, TrainerConfig, load_config
from gputrain.config.resolve import machine_busy
from gputrain.dist import DistInfo
from gputrain.engine.hooks import Hook, RunContext
from gputrain.tools.diagnose import doctor_checks, headroom, plan_check, probes
from gputrain.tools.diagnose.doctor_checks import DoctorReport
from gputrain.tools.diagnose.outcome import RankOutcome, append_record, open_records
from gputrain.tools.diagnose.ranks import run_on_ranks
from gputrain.tools.progress import Progress, Silent


class DoctorHook(Hook):
    """Watches one rank of the dry run; every record goes to the parent at once (see :func:`append_record`)."""

    def __init__(self, watch: probes.WriteWatch | None = None) -> None:
        self.watch = watch
        """Files and prints of a rank other than 0, watched from before the task was built."""
        self.step = 0
        self.epoch_first_step = True

    def before_fit(self, ctx: RunContext) -> None:
        t, model = ctx.cfg.trainer, ctx.model
        self.usage = probes.ParamUsage(model)
        self.shapes = probes.ShapeProbe(model)
        self.peaks = headroom.ActivationPeaks(model)
        self.pending_unused: list[str] | None = None
        evaluation = ctx.eval_indices()
        append_record({
            "kind": "setup", "rank": ctx.dist.rank, "world_size": ctx.dist.world_size, "strategy": ctx.strategy,
            "device": str(ctx.dist.device), "batch_size": t.batch_size, "accumulate": t.accumulate_grad_batches,
            "global_batch": ctx.global_batch, "lr": ctx.initial_lr, "workers": ctx.cfg.data.num_workers,
            "sync_batchnorm": t.sync_batchnorm, "unsynced_bn": probes.unsynced_batchnorm(model),
            "params": len(self.usage.names),
            "eval": {"indices": evaluation[0], "length": evaluation[1]} if evaluation is not None else None,
        })
        self.mark = time.perf_counter()

    def before_epoch(self, ctx: RunContext) -> None:
        self.epoch_first_step = True
        self.mark = time.perf_counter()

    def before_optimizer_step(self, ctx: RunContext) -> None:
        # Gradients of this step's backward passes are complete here, and a crash in the step's
        # all-reduce on another rank has not happened yet: record now what got no gradient.
        self.pending_unused = self.usage.take()
        append_record({"kind": "grads", "epoch": ctx.state.epoch, "step": self.step + 1,
                       "unused": self.pending_unused})

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        now = time.perf_counter()
        self.step += 1
        unused = self.pending_unused if self.pending_unused is not None else self.usage.take()
        self.pending_unused = None
        waits = list(ctx.data_waits)
        shapes = self.shapes.take()
        record: dict[str, Any] = {
            "kind": "step", "epoch": ctx.state.epoch, "step": self.step, "unused": unused,
            "inputs": shapes[0] if shapes else None, "outputs": shapes[1] if shapes else None,
            "wait_s": sum(waits), "batches": len(waits), "wall_s": now - self.mark,
            "first_of_epoch": self.epoch_first_step,
        }
        if self.epoch_first_step:
            record["order"] = ctx.train_indices(2)
        if logs and "train/loss_scale" in logs:
            record["loss_scale"] = logs["train/loss_scale"]
        append_record(record)
        self.epoch_first_step = False
        self.mark = time.perf_counter()

    def _finish(self, ctx: RunContext) -> None:
        if self.watch is not None:
            self.watch.active = False
        bn = {k: v.tolist() for k, v in probes.batchnorm_buffers(ctx.model).items()}
        append_record({"kind": "end", "bn": bn, "writes": self.watch.take() if self.watch else None,
                       "peaks": self.peaks.take()})
        self.usage.remove()
        self.shapes.remove()
        self.peaks.remove()

    def after_fit(self, ctx: RunContext, summary: dict[str, Any]) -> None:
        self._finish(ctx)
        append_record({"kind": "summary", "train_s": summary.get("train_s", 0.0)})

    def on_exception(self, ctx: RunContext, error: BaseException) -> None:
        if hasattr(self, "usage"):
            self._finish(ctx)


def dry_run_options(cfg: RunConfig, *, world_size: int, steps: int, out: str, timeout_s: float,
                    accelerator: str) -> dict[str, Any]:
    """Trainer options that turn a recipe into a short, silent dry run on ``world_size`` ranks.

    Two epochs, so a sampler whose epoch is never set shows; no checkpoints, loggers or evaluation
    (the evaluation sampler is checked without running it). A strategy that runs one process
    (single, dp, model_parallel) is dry-run as ddp, to show what breaks across ranks.
    ``find_unused_parameters`` is on (only DDP reads it) so that a model with an unused parameter
    runs to the end and every check gets its data; the report says whether the recipe needs it.
    """
    from gputrain.strategies import strategy_class

    t = cfg.trainer
    one_process = strategy_class(t.strategy).processes_per_node(2) == 1  # single, dp, model_parallel
    options: dict[str, Any] = dict(
        strategy="ddp" if one_process and world_size > 1 else t.strategy, devices=world_size, accelerator=accelerator,
        epochs=2, max_steps_per_epoch=steps, enable_checkpointing=False, loggers=[], progress_bar=False, out=out,
        eval_every_n_epochs=10**9, timeout_s=timeout_s, resume="", find_unused_parameters=True,
        measure_memory=True,
    )
    known = {f.name for f in dataclasses.fields(TrainerConfig)}
    return {k: v for k, v in options.items() if k in known}


def _doctor_rank(info: DistInfo, cfg: RunConfig, steps: int, out: str, timeout_s: float, probe: bool = True
                 ) -> dict[str, Any]:
    """One rank of the dry run (spawned by :func:`run_on_ranks`). ``probe=False`` runs the same steps bare."""
    from gputrain.engine.state import seed_everything
    from gputrain.engine.trainer import Trainer
    from gputrain.tasks import build_task

    open_records()  # before the write watch starts: the record file is the doctor's, not the user's
    if "" not in sys.path:
        sys.path.insert(0, "")  # recipes name user code relative to the working directory, as the CLI does
    watch = None
    if probe and info.rank != 0:
        watch = probes.WriteWatch(watched=[out], ignored=[])
        watch.active = True
    seed_everything(cfg.trainer.seed)
    spec = build_task(cfg)
    options = dry_run_options(cfg, world_size=info.world_size, steps=steps, out=out, timeout_s=timeout_s,
                              accelerator=info.device.type)
    hooks: list[Hook] = [DoctorHook(watch)] if probe else []
    cpu = time.process_time()
    summary = Trainer(cfg, hooks=hooks, **options).fit(spec.model, spec.train_data, spec.val_data, task=spec.task)
    return {"train_s": float(summary.get("train_s", 0.0)), "cpu_s": time.process_time() - cpu,
            "global_step": int(summary.get("global_step", 0))}


def choose_devices(cfg: RunConfig, devices: int | None) -> tuple[int, str]:
    """(ranks, accelerator) of the dry run: the recipe's GPUs when there are enough, else 2 gloo ranks on CPU."""
    wanted = devices or max(cfg.trainer.devices, 2)
    cuda = cfg.trainer.accelerator != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= wanted
    return wanted, "cuda" if cuda else "cpu"


def run_doctor(cfg: RunConfig, *, devices: int | None = None, steps: int = 3, timeout_s: float = 60.0,
               recipe: str = "", env: dict[str, str] | None = None, announce: bool = False) -> DoctorReport:
    """Dry-run ``cfg`` on real ranks and return the findings (see :mod:`gputrain.tools.doctor_checks`).

    ``env`` adds environment variables for the ranks; ``announce``: say each stage on stderr (the command does).
    """
    if steps < 1:
        raise ValueError(f"--steps {steps} must be at least 1")
    world, accelerator = choose_devices(cfg, devices)
    progress = Progress("gputrain doctor", 2) if announce else Silent()
    with tempfile.TemporaryDirectory(prefix="gputrain-doctor-") as tmp:
        out = str(Path(tmp) / "run")
        progress.stage(f"dry run: 2 epochs of {steps} steps on {world} {accelerator} ranks, every check recording")
        start = time.perf_counter()
        outcomes = run_on_ranks(_doctor_rank, cfg, steps, out, timeout_s, devices=world, accelerator=accelerator,
                                timeout_s=timeout_s, env=env)
        wall = time.perf_counter() - start
        memory = Path(out) / "memory.json"
        measured = json.loads(memory.read_text())["ranks"] if memory.is_file() else None
    # Planned after the ranks ended, so that its timing steps do not share the machine with them.
    options = dry_run_options(cfg, world_size=world, steps=steps, out=out, timeout_s=timeout_s, accelerator=accelerator)
    if measured:
        progress.stage("planning the same run (gputrain plan) to compare with what the dry run measured")
    plan, loader = (plan_check.predict(cfg, options, world, plan_check.trained_batch(outcomes)) if measured
                    else (None, None))
    progress.close()
    report = analyse(cfg, outcomes, world_size=world, accelerator=accelerator, steps=steps, wall_s=wall, recipe=recipe)
    if plan is not None:
        busy = machine_busy(accelerator)
        report.findings += [plan_check.check_plan(plan, measured, outcomes, busy=busy),
                            plan_check.check_input_plan(loader, outcomes, busy=busy)]
    return report


def cmd_doctor(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    cfg = load_config(args.recipe, list(args.overrides))
    report = run_doctor(cfg, devices=args.devices, steps=args.steps, timeout_s=args.timeout, recipe=args.recipe,
                        announce=True)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 1 if report.failed else 0


def analyse(cfg: RunConfig, outcomes: list[RankOutcome], *, world_size: int, accelerator: str, steps: int,
            wall_s: float, recipe: str = "") -> DoctorReport:
    """Every check over the ranks' records, in the order the report lists them."""
    steps_done = max((len([r for r in o.records if r.get("kind") == "step"]) for o in outcomes), default=0)
    workers = cfg.data.num_workers
    if not isinstance(workers, int):  # data.num_workers=auto: the count the ranks resolved on this node
        from gputrain.config.resolve import resolve_num_workers, usable_cores

        workers = resolve_num_workers(workers, cores=usable_cores(), local_processes=world_size)
    findings = [doctor_checks.check_run(outcomes, steps_done, wall_s), doctor_checks.check_unused(outcomes, cfg),
                *doctor_checks.check_batchnorm(outcomes, world_size), *doctor_checks.check_shapes(outcomes), doctor_checks.check_eval_sampler(outcomes),
                doctor_checks.check_epoch_order(outcomes), *doctor_checks.check_writes(outcomes), doctor_checks.check_input(outcomes, workers),
                doctor_checks.check_lr(outcomes, cfg), headroom.check_headroom(outcomes, cfg)]
    return DoctorReport(recipe=recipe or str(cfg.task), world_size=world_size, accelerator=accelerator,
                        wall_s=wall_s, findings=findings)
