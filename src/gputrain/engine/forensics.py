"""When a run goes non-finite: find the first bad step, replay it under watch, write ``nonfinite/`` (issue 41).

Nothing here runs until a run has failed. Then, on every rank, before the error ends the run:

1. The state before the first bad step. A 16-mixed run that ended on a streak of skipped steps still holds it: a
   skipped step changes neither weights, buffers nor optimizer state, only the loss scale, which is put back. A run
   that ended on a NaN loss or NaN weights goes back to its newest whole checkpoint (or the weights it started from,
   kept on the host until its first checkpoint) and trains forward, checking every step, until a step's loss or
   weights go non-finite; the epoch plan gives each step's samples, so the replayed steps are the run's.
2. That step is replayed three ways from that state (:mod:`gputrain.engine.replay`): in the run's precision with
   every module watched, then its optimizer step, then again in float32.
3. Rank 0 writes ``nonfinite/``: the state before the step (a full checkpoint), each rank's micro-batches as the
   model received them, each module's largest |output| and |gradient| in both precisions, and the report, whose
   line :mod:`gputrain.engine.verdict` decides. ``gputrain replay`` reruns it from these files alone.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gputrain.checkpoint.checkpointer import resume_from
from gputrain.checkpoint.files import atomic_save
from gputrain.checkpoint.state import TrainState, checkpoint_state, restore
from gputrain.data.names import sample_file
from gputrain.dist import comm
from gputrain.engine.replay import (
    Findings,
    Micro,
    StepOutcome,
    bad_samples,
    float32_precision,
    largest_gradient,
    record_pass,
    watched_pass,
)
from gputrain.engine.step import StepReader, optimizer_step
from gputrain.engine.verdict import Report, decide, finite_or_none, stats_of
from gputrain.errors import NonFiniteError
from gputrain.strategies.base import MicroBatch, move_to_device

if TYPE_CHECKING:
    from gputrain.engine.setup import Loop

BUNDLE = "nonfinite"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (an FSDP shard's local tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


class StateCopy:
    """This rank's weights, optimizer, schedule and loss scale, to come back to; on the host with ``on_host``."""

    def __init__(self, loop: Loop, *, on_host: bool = False) -> None:
        assert loop.optimizer is not None
        with torch.no_grad():
            self.weights = [_local(t).detach().to("cpu" if on_host else _local(t).device, copy=True)
                            for t in loop.strategy.named_weights(loop.module).values()]
        self.optimizer = copy.deepcopy(loop.optimizer.state_dict())
        self.scheduler = copy.deepcopy(loop.scheduler.state_dict())
        self.precision = copy.deepcopy(loop.precision.state_dict())

    @torch.no_grad()
    def restore_weights(self, loop: Loop) -> None:
        """The weights and buffers alone (the gradients are kept)."""
        for live, saved in zip(loop.strategy.named_weights(loop.module).values(), self.weights, strict=True):
            _local(live).copy_(saved)

    def restore(self, loop: Loop) -> None:
        """Everything, the gradients cleared."""
        assert loop.optimizer is not None
        self.restore_weights(loop)
        loop.optimizer.zero_grad(set_to_none=True)
        loop.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        loop.scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        loop.precision.load_state_dict(copy.deepcopy(self.precision))


def explain(loop: Loop, err: NonFiniteError, progress: TrainState, *, out: Path, initial: StateCopy | None,
            config: dict[str, Any]) -> NonFiniteError:
    """``err`` with the replay's report added, after writing ``out/nonfinite`` (a collective, every rank)."""
    if loop.strategy.name == "pipeline":  # a stage's modules on each rank: not replayed yet (docs/precision.md)
        return err
    started = time.perf_counter()
    try:
        report = investigate(loop, err, progress, out=out, initial=initial, config=config)
    except Exception as failed:  # noqa: BLE001  (the run's own error must reach the user, not the replay's)
        if loop.dist.is_main:
            first = (str(failed).splitlines() or [""])[0]
            print(f"gputrain: warning: the replay of the failing step failed ({type(failed).__name__}: {first}); the "
                  "run's error follows without its report", file=sys.stderr, flush=True)
        return err
    if report is None:
        return err
    bundle = out / BUNDLE
    if loop.dist.is_main:
        start = json.loads((bundle / "report.json").read_text()).get("replayed_from", "")
        print(f"gputrain: replayed the first non-finite step from {start} in {time.perf_counter() - started:.1f} s; "
              f"its state, samples and per-module figures are in {bundle}", flush=True)
    explained = NonFiniteError(f"{err.head}; {report.line}; {err.kept}; `gputrain replay {bundle}` reruns the step"
                               if err.head else f"{err}; {report.line}")
    explained.streak, explained.head, explained.kept = err.streak, err.head, err.kept
    return explained


def investigate(loop: Loop, err: NonFiniteError, progress: TrainState, *, out: Path, initial: StateCopy | None,
                config: dict[str, Any]) -> Report | None:
    """Find the state before the first bad step and replay that step; the report, or None (no state to start from)."""
    spe = loop.steps_per_epoch
    if err.streak:  # the live state is the state before the streak's first step: only the loss scale moved
        first = progress.global_step - err.streak  # steps done before it
        scaler = getattr(loop.precision, "scaler", None)
        if scaler is not None:
            scaler.update(new_scale=scaler.get_scale() * 2.0 ** err.streak)
        return examine(loop, *divmod(first, spe), out=out, config=config,
                       start=f"the run's state before its {err.streak} skipped steps in a row")
    gone_back = _go_back(loop, initial)
    if gone_back is None:
        return None
    done, start = gone_back
    reader: StepReader | None = None
    while done < progress.global_step:
        epoch, k = divmod(done, spe)
        if reader is None or reader.epoch != epoch:
            reader = StepReader(loop, epoch, k)
        before = StateCopy(loop)
        if not _step_stays_finite(loop, reader, k, done):
            before.restore(loop)
            return examine(loop, epoch, k, out=out, config=config, start=start)
        done += 1
    return examine(loop, *divmod(progress.global_step - 1, spe), out=out, config=config, start=start)


def checkpoint_written(loop: Loop) -> bool:
    """Whether a whole checkpoint is on disk, the background save in flight included (a collective; asked once, at
    the first epoch's end, to let a fresh run drop the starting weights it keeps for a replay)."""
    if loop.checkpointer is None:
        return False
    loop.checkpointer.wait()
    return bool(comm.broadcast_object(bool(loop.checkpointer.store.latest_valid()) if loop.dist.is_main else None))


def _go_back(loop: Loop, initial: StateCopy | None) -> tuple[int, str] | None:
    """Load the newest whole checkpoint, else the run's first weights: the global step it stands at, and what it is."""
    checkpointer = loop.checkpointer
    newest = checkpointer.store.latest_valid() if checkpointer is not None and loop.dist.is_main else None
    if checkpointer is not None and comm.broadcast_object(str(newest) if newest else ""):
        saved = resume_from(str(newest) if loop.dist.is_main else "", checkpointer.store, loop.dist)
        assert saved is not None
        if saved.get("sharded"):
            from gputrain.checkpoint.sharded import load_sharded

            load_sharded(loop.strategy, loop.module, loop.optimizer, Path(saved["_path"]).parent / saved["sharded"])
        return restore(loop.parts, saved, saved["_path"]).global_step, f"checkpoint {saved['_path']}"
    if initial is None:
        return None
    initial.restore(loop)
    return 0, "the run's starting weights"


def _step_stays_finite(loop: Loop, reader: StepReader, k: int, done: int) -> bool:
    """Train step ``k`` as the run did; whether its loss (every rank's) and the weights after it are finite."""
    assert loop.optimizer is not None
    loop.precision.begin_step(loop.module)
    finite = True
    for micro, _keys in reader.micro_batches(k):
        loss = loop.strategy.forward_backward(loop.module, micro, task=loop.task, precision=loop.precision)
        finite = finite and (loss is None or bool(torch.isfinite(loss)))
    if reader.finishes_by_hand(k):
        loop.strategy.finish_gradients(loop.module)
    optimizer_step(loop, TrainState(global_step=done), lambda *_: None)
    flag = torch.tensor([0.0 if finite else 1.0], device=loop.strategy.root_device)
    return not float(comm.all_reduce(flag, op="max")) and loop.all_finite()


def on_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_host(v) for v in value)
    return value


def saved_micro_batches(micros: list[Micro]) -> list[dict[str, Any]]:
    """Micro-batches as plain containers of host tensors: what ``torch.load(weights_only=True)`` reads back."""
    return [{"inputs": on_host(m.inputs), "targets": on_host(m.targets), "size": m.size, "weight": m.weight,
             "sync": m.sync, "keys": [list(key) for key in keys]} for m, keys in micros]


def loaded_micro_batches(saved: list[dict[str, Any]], device: torch.device) -> list[Micro]:
    return [(MicroBatch(inputs=move_to_device(s["inputs"], device), targets=move_to_device(s["targets"], device),
                        size=int(s["size"]), weight=float(s["weight"]), sync=bool(s["sync"])),
             [tuple(key) for key in s["keys"]]) for s in saved]


def examine(loop: Loop, epoch: int, k: int, *, out: Path, config: dict[str, Any], start: str) -> Report:
    """Replay step ``k`` of ``epoch`` from the live state (the state before it) and write the bundle."""
    assert loop.optimizer is not None
    rank, step = loop.dist.rank, epoch * loop.steps_per_epoch + k + 1
    bundle = out / BUNDLE
    extra = {"state": dataclasses.asdict(TrainState(epoch=epoch, global_step=step - 1, step_in_epoch=k)),
             "config": config, "global_batch": loop.global_batch}
    state = checkpoint_state(loop.parts, extra)  # a collective: the full weights on rank 0
    if loop.dist.is_main:
        shutil.rmtree(bundle, ignore_errors=True)
        atomic_save(state, bundle / "state.pt")
    del state
    comm.barrier()
    before = StateCopy(loop)
    reader = StepReader(loop, epoch, k)
    micros = list(reader.micro_batches(k))
    atomic_save(saved_micro_batches(micros), bundle / f"rank{rank}.pt")
    found = Findings(rank, samples=[list(key) for _, keys in micros for key in keys], bad_samples=bad_samples(micros))
    outcome = run_watched(loop, micros, found, finish=reader.finishes_by_hand(k))
    before.restore(loop)
    gathered = comm.gather_objects(dataclasses.asdict(found))
    report = None
    if loop.dist.is_main:
        findings = [Findings(**f) for f in (gathered or [dataclasses.asdict(found)])]
        names = sample_names(loop, findings)
        report = write_report(bundle, findings, outcome, step=step, epoch=epoch, precision=loop.precision.name,
                              data_parallel=loop.strategy.dp_size == loop.dist.world_size, names=names,
                              meta={"world_size": loop.dist.world_size, "dp_size": loop.strategy.dp_size,
                                    "strategy": loop.strategy.name, "replayed_from": start},
                              float32_modules=list(loop.cfg.trainer.fp32_modules))
    return Report(**comm.broadcast_object(dataclasses.asdict(report) if report else None))


def run_watched(loop: Loop, micros: list[Micro], found: Findings, *, finish: bool) -> StepOutcome:
    """The watched passes of one rank's micro-batches (this rank's, in a run): run precision, step, float32."""
    assert loop.optimizer is not None
    float16 = loop.precision.name == "16-mixed"
    before = StateCopy(loop)
    loop.precision.begin_step(loop.module)
    watch, finite = watched_pass(loop.strategy, loop.module, micros, loop.task, loop.precision, float16=float16)
    record_pass(found, watch, finite, float32=False, model=loop.module)
    if finish:
        loop.strategy.finish_gradients(loop.module)
    outcome = step_outcome(loop)
    before.restore(loop)
    watch, finite = watched_pass(loop.strategy, loop.module, micros, loop.task, float32_precision(loop.precision),
                                 float16=False)
    record_pass(found, watch, finite, float32=True)
    return outcome


def step_outcome(loop: Loop) -> StepOutcome:
    """The optimizer step after the watched backward: the largest unscaled gradient, and whether the weights stay
    finite (a collective)."""
    assert loop.optimizer is not None
    loop.precision.unscale(loop.optimizer)
    peak = torch.tensor([largest_gradient(loop.module)], device=loop.strategy.root_device)
    largest = float(comm.all_reduce(peak, op="max"))
    lr = float(loop.optimizer.param_groups[0]["lr"])
    loop.precision.optimizer_step(loop.optimizer)
    return StepOutcome(largest_gradient=largest, weights_finite=loop.all_finite(), lr=lr)


def sample_names(loop: Loop, findings: list[Findings]) -> dict[str, str]:
    """The file of each sample of the step, where the dataset knows it (by dataset index)."""
    dataset = loop.train_loader.dataset if loop.train_loader is not None else None
    keys = {key[1] for f in findings for key in f.samples if len(key) > 1}
    return {str(i): name for i in sorted(keys) if (name := sample_file(dataset, i))}


def write_report(bundle: Path, findings: list[Findings], outcome: StepOutcome, *, step: int, epoch: int,
                 precision: str, data_parallel: bool, names: dict[str, str], meta: dict[str, Any],
                 float32_modules: list[str]) -> Report:
    """Decide the report and write it, the per-module figures and what ``gputrain replay`` needs (rank 0)."""
    report = decide(findings, outcome, step=step, epoch=epoch, precision=precision, data_parallel=data_parallel,
                    sample_names=names, float32_modules=float32_modules)
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "stats.json").write_text(json.dumps(stats_of(findings), indent=1) + "\n")
    # Strict JSON (no NaN), and the epoch counted from 1 as the report's line counts it.
    record = {"report": dataclasses.asdict(report), "step": step, "epoch": epoch + 1, "precision": precision,
              "data_parallel": data_parallel, "sample_files": names, "fp32_modules": float32_modules, **meta,
              "outcome": {k: finite_or_none(v) if isinstance(v, float) else v
                          for k, v in dataclasses.asdict(outcome).items()}}
    (bundle / "report.json").write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")
    (bundle / "report.txt").write_text(report.line + "\n")
    return report
