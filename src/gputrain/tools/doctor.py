"""``gputrain doctor RECIPE``: a short dry run on real ranks that reports distributed mistakes, each with its fix.

The recipe's own task, model and data train for a few steps over two epochs (2 gloo ranks on
CPU, or one process per GPU) through the normal :class:`~gputrain.loop.Trainer`, with one extra
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
from gputrain.dist import DistInfo
from gputrain.hooks.base import Hook
from gputrain.tools import probes
from gputrain.tools.doctor_checks import DoctorReport, analyse
from gputrain.tools.ranks import append_record, open_records, run_on_ranks


class DoctorHook(Hook):
    """Watches one rank of the dry run; every record goes to the parent at once (see :func:`append_record`)."""

    def __init__(self, watch: probes.WriteWatch | None = None) -> None:
        self.watch = watch
        """Files and prints of a rank other than 0, watched from before the task was built."""
        self.step = 0
        self.epoch_first_step = True

    def before_fit(self, trainer: Any) -> None:
        t, model = trainer.cfg.trainer, probes.unwrapped(trainer)
        self.usage = probes.ParamUsage(model)
        self.shapes = probes.ShapeProbe(model)
        self.pending_unused: list[str] | None = None
        trainer.train_loader = self.loader = probes.TimedLoader(trainer.train_loader)
        group = trainer.optimizer.param_groups[0]
        eval_part: dict[str, Any] | None = None
        if getattr(trainer, "val_loader", None) is not None:
            eval_part = {"indices": probes.sampler_indices(trainer.val_loader.batch_sampler),
                         "length": len(trainer.val_loader.dataset)}
        world = trainer.dist.world_size
        append_record({
            "kind": "setup", "rank": trainer.dist.rank, "world_size": world, "strategy": trainer.strategy.name,
            "device": str(trainer.dist.device), "batch_size": t.batch_size, "accumulate": t.accumulate_grad_batches,
            "global_batch": int(getattr(trainer, "global_batch", t.batch_size * world * t.accumulate_grad_batches)),
            "lr": float(group.get("initial_lr", group["lr"])), "workers": trainer.cfg.data.num_workers,
            "sync_batchnorm": t.sync_batchnorm, "unsynced_bn": probes.unsynced_batchnorm(model),
            "params": len(self.usage.names), "eval": eval_part,
        })
        self.mark = time.perf_counter()

    def before_epoch(self, trainer: Any) -> None:
        self.epoch_first_step = True
        self.mark = time.perf_counter()

    def before_optimizer_step(self, trainer: Any) -> None:
        # Gradients of this step's backward passes are complete here, and a crash in the step's
        # all-reduce on another rank has not happened yet: record now what got no gradient.
        self.pending_unused = self.usage.take()
        append_record({"kind": "grads", "epoch": trainer.state.epoch, "step": self.step + 1,
                       "unused": self.pending_unused})

    def after_step(self, trainer: Any, logs: dict[str, float] | None) -> None:
        now = time.perf_counter()
        self.step += 1
        unused = self.pending_unused if self.pending_unused is not None else self.usage.take()
        self.pending_unused = None
        waits = self.loader.take()
        shapes = self.shapes.take()
        record: dict[str, Any] = {
            "kind": "step", "epoch": trainer.state.epoch, "step": self.step, "unused": unused,
            "inputs": shapes[0] if shapes else None, "outputs": shapes[1] if shapes else None,
            "wait_s": sum(waits), "batches": len(waits), "wall_s": now - self.mark,
            "first_of_epoch": self.epoch_first_step,
        }
        if self.epoch_first_step:
            record["order"] = probes.sampler_indices(self.loader.batch_sampler, limit=2)
        append_record(record)
        self.epoch_first_step = False
        self.mark = time.perf_counter()

    def _finish(self, trainer: Any) -> None:
        if self.watch is not None:
            self.watch.active = False
        model = probes.unwrapped(trainer)
        bn = {k: v.tolist() for k, v in probes.batchnorm_buffers(model).items()}
        append_record({"kind": "end", "bn": bn, "writes": self.watch.take() if self.watch else None})
        self.usage.remove()
        self.shapes.remove()

    def after_fit(self, trainer: Any, summary: dict[str, Any]) -> None:
        self._finish(trainer)
        append_record({"kind": "summary", "train_s": summary.get("train_s", 0.0)})

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        if hasattr(self, "usage"):
            self._finish(trainer)


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
    )
    known = {f.name for f in dataclasses.fields(TrainerConfig)}
    return {k: v for k, v in options.items() if k in known}


def _doctor_rank(info: DistInfo, cfg: RunConfig, steps: int, out: str, timeout_s: float, probe: bool = True
                 ) -> dict[str, Any]:
    """One rank of the dry run (spawned by :func:`run_on_ranks`). ``probe=False`` runs the same steps bare."""
    from gputrain import Trainer
    from gputrain.loop_state import seed_everything
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
               recipe: str = "", env: dict[str, str] | None = None) -> DoctorReport:
    """Dry-run ``cfg`` on real ranks and return the findings (see :mod:`gputrain.tools.doctor_checks`).

    ``env`` adds environment variables for the ranks.
    """
    if steps < 1:
        raise ValueError(f"--steps {steps} must be at least 1")
    world, accelerator = choose_devices(cfg, devices)
    with tempfile.TemporaryDirectory(prefix="gputrain-doctor-") as tmp:
        out = str(Path(tmp) / "run")
        start = time.perf_counter()
        outcomes = run_on_ranks(_doctor_rank, cfg, steps, out, timeout_s, devices=world, accelerator=accelerator,
                                timeout_s=timeout_s, env=env)
        wall = time.perf_counter() - start
    return analyse(cfg, outcomes, world_size=world, accelerator=accelerator, steps=steps, wall_s=wall, recipe=recipe)


def cmd_doctor(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    cfg = load_config(args.recipe, list(args.overrides))
    report = run_doctor(cfg, devices=args.devices, steps=args.steps, timeout_s=args.timeout, recipe=args.recipe)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 1 if report.failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gputrain.tools.doctor ...``: the same as ``gputrain doctor ...`` (flags: gputrain.cli_parser)."""
    from gputrain.cli import main as cli_main

    return cli_main(["doctor", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
