"""What a run records about itself besides checkpoints and logs, and what it removes when it never started.

The run folder it chose (and marked as gputrain's), ``config.yaml`` and the start-up line, ``summary.json``
when training ends; the config of a run started from Python (which used no recipe); the answer to resuming a
finished run; and the cleanup after a fresh run that failed before its first step, so that its folder is not
later taken for a run to continue.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gputrain.checkpoint.state import position
from gputrain.config.load import to_yaml
from gputrain.config.schema import LaunchConfig, RunConfig
from gputrain.dist import DistInfo, comm, node_name, restart_attempt, restarts_left
from gputrain.runs import folder as run_folder
from gputrain.runs import membership
from gputrain.runs.records import append_record, last_event, strict_json

if TYPE_CHECKING:
    from gputrain.checkpoint.state import TrainState
    from gputrain.engine.setup import Loop


CONFIG_HEADER = ("# The resolved config of the run in this folder (every `auto` as it was decided). Train it again\n"
                 "# with `gputrain train RUN/config.yaml`: a new run folder, or --out DIR.\n")


def open_run_folder(cfg: RunConfig, dist: DistInfo, *, for_training: bool,
                    api: bool = False) -> tuple[Path, tuple[Path, bool] | None]:
    """Rank 0 resolves and checks the run folder, every rank gets its path; also (folder, existed before) of a
    fresh training run, which :func:`discard_untrained_run` removes if it fails before its first step."""
    t = cfg.trainer
    chosen, fresh = "", None
    if dist.is_main:
        out = Path(t.out) if t.out else run_folder.default_run_dir(Path(str(cfg.task)).name.split(":")[-1])
        if for_training:
            run_folder.check_run_folder(out, resume=t.resume, overwrite=t.overwrite, api=api)
            fresh = None if t.resume else (out, out.exists())
            if t.overwrite:
                run_folder.clear_run_folder(out)
            run_folder.mark_run_folder(out)  # ours: a later --overwrite may clear what gputrain wrote here
            if not t.out:
                run_folder.point_latest(out)
        chosen = str(out)
    return Path(comm.broadcast_object(chosen)), fresh


def announce(loop: Loop, model: nn.Module, out: Path) -> None:
    """Rank 0 writes ``config.yaml`` and prints the start-up line: how this run was resolved."""
    if not loop.dist.is_main:
        return
    t = loop.cfg.trainer
    # Where and how this run was started stays out: the file is a recipe for the next run (`gputrain train
    # RUN/config.yaml`), which would otherwise be sent back into this folder and refused there.
    where = dataclasses.replace(t, out="", resume="", overwrite=False)
    (out / "config.yaml").write_text(CONFIG_HEADER + to_yaml(dataclasses.replace(loop.cfg, trainer=where)))
    sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
    frozen = sum(n for n, trains in sizes if not trains) / max(sum(n for n, _ in sizes), 1)
    checkpoints = loop.checkpointer.mode if loop.checkpointer is not None else ""
    ema = loop.ema
    # The decay each update applies, beside the one asked for when the reference's adjustment changed it.
    averaged = "" if ema is None else (f" ema={ema.decay:.6g}/{ema.every}steps" + (
        f"(trainer.ema_decay={t.ema_decay:g} adjusted for the global batch and epochs)" if ema.decay != t.ema_decay
        else ""))
    print(f"gputrain: {loop.strategy.describe()} device={loop.dist.device} precision={loop.precision.name} "
          f"{loop.fast.describe()} {training_options(loop.cfg, checkpoints=checkpoints, frozen_share=frozen)}{averaged} "
          f"batch_size={t.batch_size}/process global_batch={loop.global_batch}{loop.lr_note} out={out}", flush=True)


def describe_python_run(cfg: RunConfig, model: nn.Module) -> RunConfig:
    """A run from the Python API saves a config that says so, not the defaults of a recipe it never used."""
    cls = type(model)
    return dataclasses.replace(cfg, task="custom",
                               model=dataclasses.replace(cfg.model, name=f"{cls.__module__}:{cls.__qualname__}"),
                               data=dataclasses.replace(cfg.data, root=""))


def training_options(cfg: RunConfig, *, checkpoints: str, frozen_share: float = 0.0) -> str:
    """The start-up line's words for what else changes what or how the run trains: only what is on.

    ``checkpoints``: how checkpoints are written (``background`` or ``synchronous``; empty when off);
    ``frozen_share``: the share of the model's parameters that do not train.
    """
    from gputrain.data.synthetic import SYNTHETIC_SAMPLES

    d, m, t = cfg.data, cfg.model, cfg.trainer
    words = [f"workers={d.num_workers}"]
    if d.synthetic:
        words.append(f"data=synthetic(the first {SYNTHETIC_SAMPLES} samples repeated)")
    if frozen_share:
        words.append(f"frozen={','.join(m.freeze) or 'parameters'}({frozen_share:.0%} of the parameters)")
    flags = (("decode_on_device", d.decode_on_device), ("frozen_batchnorm", m.frozen_batchnorm),
             ("sync_batchnorm", t.sync_batchnorm), ("drop_last", t.drop_last))
    words += [name for name, on in flags if on]
    values = (("weights", m.weights),
              ("accumulate", t.accumulate_grad_batches if t.accumulate_grad_batches > 1 else 0),
              ("grad_clip_norm", t.grad_clip_norm), ("max_steps_per_epoch", t.max_steps_per_epoch),
              ("checkpoints", checkpoints))
    words += [f"{name}={value}" for name, value in values if value]
    return " ".join(words)


def discard_untrained_run(out: Path, existed: bool) -> None:
    """Remove what a fresh run wrote into ``out`` (which was empty, or cleared by --overwrite, when it began)."""
    for path in (list(out.iterdir()) if existed and out.is_dir() else []):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        latest = out.parent / "latest"
        if latest.is_symlink() and not latest.exists():
            latest.unlink()  # it pointed to the folder just removed


def already_finished(out: Path, state: TrainState, epochs: int, is_main: bool) -> dict[str, Any]:
    """Resuming a finished run changes nothing: say so and return its summary."""
    path = out / "summary.json"
    if is_main:
        print(f"gputrain: {out} is finished (epoch {state.epoch} of {epochs}); nothing was changed. To train longer, "
              "resume with a larger --epochs", flush=True)
    return json.loads(path.read_text()) if path.is_file() else {"epochs": state.epoch}


def write_summary(loop: Loop, out: Path, state: TrainState, metrics: dict[str, float], *, wall_s: float,
                  train_s: float, samples: float) -> dict[str, Any]:
    """The run's ``summary.json`` (rank 0 writes it); every rank returns it."""
    assert loop.train_loader is not None
    train_iters = len(loop.train_loader)
    val_iters = len(loop.val_loader) if loop.val_loader is not None else 0
    summary = {
        "final": metrics,
        "world_size": loop.dist.world_size,
        "strategy": loop.strategy.name,
        "precision": loop.precision.name,
        "device": str(loop.dist.device),
        "batch_size_per_device": loop.cfg.trainer.batch_size,
        "global_batch": loop.global_batch,
        "iters_per_epoch": {"train": train_iters, "val": val_iters, "total": train_iters + val_iters},
        "epochs": state.epoch,
        "global_step": state.global_step,
        "samples_seen": state.samples_seen,
        "wall_s": wall_s,
        "train_s": train_s,
        "images_per_s": samples / train_s if train_s > 0 else 0.0,
        "peak_memory_bytes": peak_memory_bytes(loop.dist.device),
        "fast": loop.fast.describe().removeprefix("fast="),
        # The run's first optimizer step: with trainer.compile it holds the compile time (bench throughput
        # reports compile_s = first step - a steady step).
        "first_step_s": loop.first_step_s,
    }
    if loop.dist.is_main:
        summary |= membership.counts(out / "metrics.jsonl")  # an elastic job's restarts (issue 45)
        pace = last_event(out / "metrics.jsonl", "pace")  # the first steps' pace (issue 42)
        if pace is not None:
            summary["pace"] = pace
        (out / "summary.json").write_text(strict_json(summary, indent=2))
    return summary


def interrupted_line(state: TrainState, where: str, command: str, launch: LaunchConfig) -> str:
    """The one line a run stopped by a signal prints: where it stopped, its checkpoint, and how to go on."""
    line = f"interrupted at {position(state)}; {where}; "
    if not (launch.elastic or restarts_left()):
        return line + f"continue with: {command}"
    # torchrun's agent stops the workers this way before it restarts them: the job may go on by itself.
    return line + (f"if torchrun restarts the workers (a node joined or left, or a rank failed with restarts left), "
                   f"they continue from it by themselves; if the whole job was stopped, continue with: {command}")


def record_membership(loop: Loop, out: Path, resume: dict[str, Any], state: TrainState) -> None:
    """After torchrun restarted the workers (an elastic job's every resume), or SLURM requeued the job: one record in
    ``metrics.jsonl`` and one line saying what changed and what it cost (rank 0). A resume by hand is none."""
    before, after = int(resume.get("world_size") or 0), loop.dist.world_size
    requeued = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    elastic = loop.cfg.launch.elastic  # a node that joins restarts the workers with a restart count of 0
    # The same on every rank (the restart count, the requeue count, the config, the resumed epoch), so every rank
    # reaches the gather of the nodes below, or none does.
    if restart_attempt() == 0 and requeued == 0 and not elastic:
        return
    if state.epoch >= loop.cfg.trainer.epochs:  # a finished run started again: it trains nothing, nothing changed
        return
    nodes = comm.gather_objects(node_name())
    if not loop.dist.is_main or nodes is None:
        return
    record = membership.change_record(metrics=out / "metrics.jsonl", checkpoint=Path(resume["_path"]),
                                      step=state.global_step, epoch=state.epoch, before=before, after=after,
                                      global_batch=loop.global_batch, nodes_before=resume.get("nodes") or [],
                                      nodes=nodes)
    append_record(out / "metrics.jsonl", record)
    change = (f"the job went from {before} to {after} process(es)" if before != after
              else f"the job restarted on its {after} process(es)")
    print(f"gputrain: {change}{membership.who(record)} and resumed at step {state.global_step}: "
          f"{record['seconds_lost']:.0f} s since that checkpoint, {record['samples_retrained']} sample(s) trained again",
          flush=True)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA's allocator peak on a GPU, the peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def check_monitor(monitor: str, metrics: dict[str, float], *, is_main: bool) -> None:
    """A ``trainer.monitor`` that names no metric of the run (``val/acc`` for ``val/accuracy``) picks no best.pt:
    said at the run's first evaluation, with the names it could be."""
    if monitor and monitor not in metrics and is_main:
        names = ", ".join(sorted(k for k in metrics if k.startswith(("val/", "val_ema/"))))
        print(f"gputrain: warning: trainer.monitor={monitor} is not a metric of this run ({names}); no best.pt is "
              "written: set trainer.monitor to one of these", file=sys.stderr, flush=True)
