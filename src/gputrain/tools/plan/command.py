"""``gputrain plan``: every plan that applies to the devices, predicted before the run, and the one to choose."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gputrain.config import RunConfig
from gputrain.parallel.partition import format_bytes
from gputrain.tools.plan import memory
from gputrain.tools.plan.budget import device_budget, parse_size
from gputrain.tools.plan.input import InputPlan, input_plan
from gputrain.tools.plan.plans import Plan, Planner, choose, fits_cell, micro_batch_count, why
from gputrain.tools.plan.timing import Probe, block_shares, measure_step, measure_steps, timed_at
from gputrain.tools.plan.workload import Workload
from gputrain.tools.progress import Progress, Silent

SPLIT = ("pipeline", "model_parallel")


@dataclass
class Report:
    plans: list[Plan]
    chosen: Plan | None
    budget: int
    budget_source: str
    device: str
    precision: str
    global_batch: int
    notes: list[str]
    seconds: float
    input: InputPlan | None = None  # the data loader against the chosen plan's step (issue 42)

    def as_json(self) -> dict[str, Any]:
        return {"plans": [p.as_json() for p in self.plans], "chosen": self.chosen.as_json() if self.chosen else None,
                "budget_bytes": self.budget, "device": self.device, "precision": self.precision,
                "global_batch": self.global_batch, "notes": self.notes, "plan_s": self.seconds,
                "input": self.input.as_json() if self.input else None}


def global_batch(cfg: RunConfig, devices: int, nnodes: int) -> int:
    """The batch one optimizer step of the recipe trains as configured (``--strategy auto``: trainer.batch_size):
    the batch times its data-parallel size over the processes it starts (one per node for single, dp and
    model_parallel, whose one process takes the whole batch)."""
    from gputrain.strategies import processes_per_node, strategy_class

    t = cfg.trainer
    if t.strategy == "auto":
        return t.batch_size
    processes = processes_per_node(t.strategy, devices) * nnodes
    return t.batch_size * strategy_class(t.strategy).data_parallel_size(processes)


def _device(cfg: RunConfig) -> torch.device:
    from gputrain.dist.env import resolve_accelerator

    kind = resolve_accelerator(cfg.trainer.accelerator)
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def _check_devices(device: torch.device, devices: int) -> None:
    if devices < 1:
        raise ValueError(f"--devices {devices}: give 1 or more")
    if device.type == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(f"--devices {devices} but this machine has {torch.cuda.device_count()} GPU(s); give "
                         f"--devices {torch.cuda.device_count()} or fewer, or plan on the machine the run trains on")


def make_report(cfg: RunConfig, *, devices: int, nnodes: int = 1, budget_text: str = "", only: str = "",
                choice_only: bool = False, progress: Progress | None = None) -> Report:
    """Predict every plan for ``devices`` per node of ``nnodes`` nodes and choose one (``only``: that plan's label
    alone, e.g. ``ddp`` or ``pipeline-1f1b``, as doctor compares one).

    ``choice_only``: what choosing needs, about a third of the counting (``--strategy auto``, doctor's one plan):
    no largest batches (a second count of every plan at twice its batch), and activation checkpointing only for a
    strategy whose plain plan does not fit yet is at least as fast as the fastest that does (checkpointing makes a
    plan slower, never faster). When nothing fits, the whole report: its line names the largest batch.
    ``progress`` hears each stage (none by default: ``gputrain plan`` and ``--strategy auto`` pass theirs)."""
    from gputrain.config.resolve import resolve_precision
    from gputrain.strategies.fsdp import shard_units

    started = time.perf_counter()
    device = _device(cfg)
    _check_devices(device, devices)
    precision = resolve_precision(cfg.trainer.precision, device)
    budget = parse_size(budget_text) if budget_text else device_budget(device.type, device.index or 0)
    source = "--memory-budget" if budget_text else ("free GPU memory" if device.type == "cuda" else "available RAM")
    g = global_batch(cfg, devices, nnodes)
    world = devices * nnodes
    progress = progress or Silent()
    progress.stage("reading a batch of the training data and building the model")
    work = Workload.from_config(cfg, device, precision)
    notes: list[str] = []
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in work.model.modules())

    # The probe batch: this device's share of the data-parallel plans, small on a CPU (its time is linear in the
    # batch). On a GPU never one whose predicted memory exceeds the budget, and the probe's measured peak against
    # its count is the allocator's overhead; a CPU has neither (the budget only bounds the plans).
    probe_batch = max(min(g // world or 1, 4 if device.type == "cpu" else g), 2 if has_bn else 1)
    overhead = 0
    if device.type == "cuda":
        while memory.step_memory(work, probe_batch).peak > budget and probe_batch > 1:
            probe_batch //= 2
    timed, pixels = timed_at(work)  # on a CPU, large images: the fixed part and checkpointing's cost timed smaller
    size = "" if pixels == 1 else f" at {timed.cfg.data.image_size} px a side, and one at the run's size"
    progress.stage(f"timing training steps at batch {probe_batch} and {2 * probe_batch}{size}")
    measured = measure_steps(timed, probe_batch)
    if pixels > 1:  # one step at the run's size gives the per-sample time: it is not linear in pixels on a CPU
        measured_here = measure_step(work, 2 if has_bn else 1)
        probe = measured.with_step_at_size(measured_here)
    else:
        probe = measured
    if probe.cuda_peak_bytes:
        overhead = max(probe.cuda_peak_bytes - memory.step_memory(work, probe_batch).peak, 0)

    shares, m, split = None, 1, None
    wanted = (lambda label: not only or only in (label, f"{label}+ac"))  # noqa: E731
    if world > 1 and nnodes == 1 and any(wanted(x) for x in SPLIT_PLANS):
        m = micro_batch_count(cfg.parallel.micro_batches, world, g, has_bn)
        progress.stage("timing each block of the model, to split it into stages")
        try:
            # Shares at the run's own size (which blocks cost most shifts with the image size, and the split with
            # it); where images are large (timed smaller), one sample once: a share hardly moves with the batch.
            shares = block_shares(work, max(g // m, 1)) if pixels == 1 else block_shares(work, 1, repeats=1)
            split = _split_indices(cfg, shares, world)
        except ValueError as err:
            notes.append(f"no pipeline or model_parallel plan: {err}")
    elif nnodes > 1:
        notes.append("pipeline and model_parallel plans are for one node; --nnodes > 1 plans ddp and fsdp")
    planner = Planner(work, world, g, budget, probe, shares, m, fsdp_units=shard_units(work.model),
                      cuda_overhead=overhead, largest=not choice_only, nodes=nnodes, ema=cfg.trainer.ema_decay > 0)
    labels = ["single"] if nnodes == 1 else []  # one device is one node's job: on K nodes, every node starts ranks
    if world > 1:
        if g % world:
            notes.append(f"no ddp or fsdp plan: the global batch {g} does not divide over {world} devices")
        else:
            labels += ["ddp", "fsdp"]
        if split is not None:
            labels += SPLIT_PLANS
    labels = [x for x in labels if not only or only == x]
    progress.total = progress.done + len(labels) + (1 + len(labels) if labels else 0)  # at most: +ac follow
    plans = [_attempt(lambda x=x: _predict(planner, x, split), notes, progress, x) for x in labels]
    checkpointed = [x for x in labels if not only or only == f"{x}+ac"]
    if choice_only:
        fastest = choose([p for p in plans if p is not None])
        checkpointed = [p.label for p in plans if p is not None and p.label in checkpointed and not p.fits_with_margin
                        and (fastest is None or p.step_s <= fastest.step_s)]
    plans += _checkpointed_plans(planner, checkpointed, (timed, measured), notes, split, progress)
    found = [p for p in plans if p is not None]
    notes += sorted(work.notes)
    if not found:
        raise ValueError(f"no plan could be predicted for {cfg.model.name or 'the model'}: {'; '.join(notes)}")
    chosen = choose(found)
    if choice_only and chosen is None:
        return make_report(cfg, devices=devices, nnodes=nnodes, budget_text=budget_text, only=only, progress=progress)
    from gputrain.strategies import processes_per_node

    loader = None if chosen is None else input_plan(
        cfg, chosen.strategy, chosen.devices, chosen.images_per_s,
        work.seconds_per_sample_in_worker or work.seconds_per_sample, seconds_in_process=work.seconds_per_sample,
        processes_per_node=processes_per_node(chosen.strategy, devices))
    return Report(found, chosen, budget, source, str(device), precision, g, notes, time.perf_counter() - started,
                  loader)


SPLIT_PLANS = ["pipeline-gpipe", "pipeline-1f1b", "model_parallel"]


def _predict(planner: Planner, label: str, split: list[int] | None) -> Plan:
    """The plan ``label`` names (``single``, ``ddp``, ``fsdp``, ``pipeline-gpipe``, ``pipeline-1f1b``,
    ``model_parallel``)."""
    if label == "model_parallel" or label.startswith("pipeline-"):
        assert split is not None
        strategy, _, schedule = label.partition("-")
        return planner.split(strategy, schedule, split)
    return getattr(planner, label)()  # type: ignore[no-any-return]


def _checkpointed_plans(planner: Planner, labels: list[str], timed: tuple[Workload, Probe], notes: list[str],
                        split: list[int] | None, progress: Progress) -> list[Plan | None]:
    """The plans ``labels`` again with ``trainer.activation_checkpointing=true``: memory counted on the checkpointed
    model (a pipeline stage recomputes its own blocks), time from the plain probe scaled by one measured
    checkpointed step of the workload ``timed`` measured plainly (its workload and probe)."""
    if not labels:
        return []
    try:
        work = planner.work.checkpointed()
    except ValueError as err:
        notes.append(f"no activation-checkpointing plans: {err}")
        return []
    timed_work, plain = timed
    progress.stage("timing a training step with activation checkpointing", total=progress.done + 1 + len(labels))
    slower = (measure_step(timed_work.checkpointed(), plain.batch_size).step_s / plain.step_s
              if plain.step_s > 0 else 1.0)  # at the plain probe's batch and size
    ac = dataclasses.replace(planner, work=work, probe=planner.probe.scaled(max(slower, 1.0)))
    return [_attempt(lambda x=x: dataclasses.replace(_predict(ac, x, split), activation_checkpointing=True), notes,
                     progress, f"{x}+ac") for x in labels]


def _attempt(predict: Any, notes: list[str], progress: Progress, label: str) -> Plan | None:
    """One plan's prediction (memory counted on fake tensors), or None with a note when the model cannot run there."""
    progress.stage(f"counting memory on fake tensors: {label}")
    try:
        return predict()  # type: ignore[no-any-return]
    except memory.UnprofilableModel as err:
        notes.append(str(err))
        return None


def _split_indices(cfg: RunConfig, shares: Any, stages: int) -> list[int]:
    from gputrain.parallel.partition import partition_by_cost, plan_from_split_points

    if cfg.parallel.split_points and len(cfg.parallel.split_points) == stages - 1:
        return plan_from_split_points(shares.names, cfg.parallel.split_points, field="parallel.split_points")
    if len(shares.names) < stages:
        raise ValueError(f"the model has {len(shares.names)} blocks, fewer than {stages} stages")
    return partition_by_cost(shares.time, stages, names=shares.names)


def format_report(report: Report, title: str) -> str:
    rows: list[tuple[str, ...]] = [("plan", "dev", "batch", "micro", "split at", "params", "grads", "optim", "activ", "other",
             "peak/device", "step", "images/s", "fits", "largest G")]
    for p in report.plans:
        worst = max(p.per_device, key=lambda m: m.peak)
        rows.append((p.label, str(p.devices), str(p.batch_size), str(p.micro_batches) if p.micro_batches > 1 else "-",
                     ",".join(p.split_points) or "-", *(format_bytes(v) for v in worst.as_dict().values()),
                     format_bytes(p.peak), f"{p.step_s * 1e3:.0f} ms", f"{p.images_per_s:.1f}",
                     fits_cell(p), str(p.max_global_batch)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [title] + ["  ".join(x.ljust(w) if c < 5 else x.rjust(w) for c, (x, w) in enumerate(zip(r, widths,
                                                                                               strict=True)))
                       for r in rows]
    lines += [f"  {p.label} per stage: " + ", ".join(format_bytes(m.peak) for m in p.per_device)
              for p in report.plans if len({m.peak for m in p.per_device}) > 1]
    lines += [f"note: {n}" for n in report.notes]
    if report.chosen:  # none: the command ends in its one error line (cmd_plan)
        lines.append(f"chosen: {why(report.chosen, report.plans)}")
    if report.input:
        lines.append(report.input.line())
    lines.append(f"planned in {report.seconds:.1f} s; memory counted on fake tensors, time from measured steps "
                 f"(docs/plan.md)")
    return "\n".join(lines)


def no_plan_line(report: Report) -> str:
    least = min(report.plans, key=lambda p: p.peak)
    best = max(report.plans, key=lambda p: p.max_global_batch)
    return (f"no plan fits {format_bytes(report.budget)} ({report.budget_source}) with a 10% margin: the smallest "
            f"needs {format_bytes(least.peak)} per device ({least.label}); the largest global batch that fits is "
            f"{best.max_global_batch} ({best.label})" + ("" if best.max_global_batch else ": none; a smaller model "
                                                          "or input size is needed"))


def cmd_plan(cfg: RunConfig, *, recipe: str, devices: int, nnodes: int, budget_text: str, json_path: str) -> int:
    if json_path:  # before the planning: a folder that cannot be made answers at once
        try:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--json {json_path}: cannot write there ({err.strerror}); give a writable path") from None
    with Progress("gputrain plan") as progress:
        report = make_report(cfg, devices=devices, nnodes=nnodes, budget_text=budget_text, progress=progress)
    title = (f"gputrain plan: {recipe} on {devices * nnodes} x {report.device}, global batch {report.global_batch}, "
             f"precision {report.precision}, budget {format_bytes(report.budget)} per device ({report.budget_source})")
    print(format_report(report, title), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(report.as_json(), indent=2) + "\n")
    if report.chosen is None:
        print(f"gputrain: error: {no_plan_line(report)}", file=sys.stderr, flush=True)
        return 2
    return 0


def auto_overrides(cfg: RunConfig, *, devices: int, nnodes: int, budget_text: str) -> tuple[list[str], str]:
    """``--strategy auto``: the chosen plan as config overrides, and its one line; one line when none fits."""
    with Progress("gputrain train --strategy auto", log_lines=False) as progress:
        report = make_report(cfg, devices=devices, nnodes=nnodes, budget_text=budget_text, choice_only=True,
                             progress=progress)
    if report.chosen is None:  # a usage error: the command line prints it as every other, prefix and exit 2
        raise ValueError(no_plan_line(report))
    c = report.chosen
    per_device = ", ".join(format_bytes(m.peak) for m in c.per_device)
    split = f" split at {','.join(c.split_points)}" if c.split_points else ""
    micro = f" {c.micro_batches} micro-batches" if c.micro_batches > 1 else ""
    line = (f"gputrain: --strategy auto chose {c.label} on {c.devices} device(s){micro}{split}, batch {c.batch_size} "
            f"per process; predicted peak {per_device} per device (budget {format_bytes(report.budget)}), "
            f"{c.images_per_s:.1f} images/s")
    if cfg.data.num_workers == "auto" and report.input is not None:  # the input plan's count, not every core
        override, note = report.input.auto_override()
        return [*c.overrides(), *c.predictions(), override], f"{line}; {note}"
    return c.overrides() + c.predictions(), line
