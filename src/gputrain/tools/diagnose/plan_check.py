"""doctor's comparison of ``gputrain plan``'s prediction with what its dry run measured (docs/plan.md).

The dry run measures each rank's memory over its first two steps (``trainer.measure_memory``) and times every
step; the plan for the same strategy, device count and batch predicts both. Apart by more than
:data:`TOLERANCE`: a WARN saying which figure, by how much, and what to trust.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from gputrain.config import RunConfig
from gputrain.tools.diagnose.doctor_checks import Finding
from gputrain.tools.diagnose.outcome import RankOutcome

TOLERANCE = 0.15
MEMORY_FLOOR = 16 * 2**20
STEP_FLOOR_S = 0.02
"""Differences under these are left alone whatever their share: a toy model's few MiB and milliseconds are the
loop's own buffers and per-step costs (hooks, a gloo round trip), which the plan does not count and no run feels."""
MEASURED_STEPS = 2
"""Steps the memory count slows on a CPU: left out of the step time."""
INPUT_TOLERANCE = 0.25
"""The plan's loader rate this far from the dry run's reads (either way) is a WARN."""
READ_FLOOR = 0.05
"""A rate error worth less than this share of the step (per batch) is left alone: reads of microseconds slow down
between steps (docs/benchmarks.md) by more than 25 %, and no choice of workers turns on it."""


def trained_batch(outcomes: list[RankOutcome]) -> int | None:
    """The largest batch one rank's step read in the dry run (a data set smaller than the batch gives less)."""
    sizes = [r["inputs"][0] for o in outcomes for r in o.records if r.get("kind") == "step"
             and isinstance(r.get("inputs"), list) and r["inputs"] and isinstance(r["inputs"][0], int)]
    return max(sizes) if sizes else None


def predict(cfg: RunConfig, options: dict[str, Any], world_size: int, batch_size: int | None = None
            ) -> tuple[Any, Any]:
    """The plan of the dry run as it trained (its strategy, devices and per-rank ``batch_size``), or one line
    saying why there is none; and the plan's input line (:class:`~gputrain.tools.plan.input.InputPlan`, or None)."""
    from gputrain.tools.plan.command import make_report

    strategy = options.get("strategy", cfg.trainer.strategy)
    label = f"pipeline-{cfg.parallel.schedule}" if strategy == "pipeline" else strategy
    dry = dataclasses.replace(cfg, trainer=dataclasses.replace(
        cfg.trainer, strategy=strategy, accelerator=options.get("accelerator", cfg.trainer.accelerator),
        batch_size=batch_size or cfg.trainer.batch_size))
    try:
        report = make_report(dry, devices=world_size, only=label, choice_only=True)
    except Exception as err:  # noqa: BLE001  a plan that cannot be made must not end the doctor's report
        return (f"no {label} plan could be predicted: "
                f"{str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__}"), None
    found = [p for p in report.plans if p.label == label]
    return (found[0] if found else f"no {label} plan for {world_size} devices ({'; '.join(report.notes)})",
            report.input)


def _apart(measured: float, predicted: float) -> float:
    return (predicted - measured) / measured if measured else 0.0




def check_plan(plan: Any, measured: list[dict[str, Any]] | None, outcomes: list[RankOutcome], busy: str = "") -> Finding:
    """Predicted per-device memory and step time against the dry run's. Each difference is the prediction's, from
    the measure: ``+25%`` predicts a quarter more than was measured. ``busy`` (:func:`~gputrain.config.resolve.machine_busy`): step times are
    shown but not compared, and the line says why."""
    if isinstance(plan, str):
        return Finding("SKIP", "plan", plan)
    if not measured:
        return Finding("SKIP", "plan", "the dry run ended before its memory was measured")
    ranks = sorted(measured, key=lambda r: r["rank"])
    memory = [(r["rank"], r["peak_bytes"], want) for r, want in
              zip(ranks, plan.per_device * len(ranks) if len(plan.per_device) == 1 else plan.per_device, strict=False)]
    worst_rank, got, want = max(memory, key=lambda m: abs(_apart(m[1], m[2].peak)))
    mem_off = _apart(got, want.peak)
    steps = [r["wall_s"] - r["wait_s"] for o in outcomes for r in o.records
             if r.get("kind") == "step" and r["step"] > MEASURED_STEPS and not r["first_of_epoch"]]
    step_s = statistics.median(steps) if steps else 0.0
    time_off = _apart(step_s, plan.step_s) if step_s else 0.0
    what = (f"{plan.label} on {plan.devices}: memory predicted {want.peak / 2**20:,.1f} MiB on rank {worst_rank}, "
            f"measured {got / 2**20:,.1f} MiB (prediction {mem_off:+.0%}); step predicted {plan.step_s * 1e3:.0f} ms, "
            "measured " + (f"{step_s * 1e3:.0f} ms (prediction {time_off:+.0%})" if step_s else "no steady step")
            + (f"; step times not compared: {busy}" if busy and step_s else ""))
    off = [name for name, x, gap in (("memory", mem_off, abs(got - want.peak) > MEMORY_FLOOR),
                                     ("step time", time_off, abs(step_s - plan.step_s) > STEP_FLOOR_S and not busy))
           if abs(x) > TOLERANCE and gap]
    if not off:
        return Finding("OK", "plan", what)
    return Finding("WARN", "plan", f"{' and '.join(off)} more than {TOLERANCE:.0%} from the prediction: {what}",
                   "trust the measured figures (memory.json of a run with trainer.measure_memory=true); "
                   "`gputrain plan` has not seen what differs here (docs/plan.md#limits)")


def check_input_plan(loader: Any, outcomes: list[RankOutcome], busy: str = "") -> Finding:
    """The plan's loader rate (one worker's images/s) against the dry run's reads. With ``data.num_workers=0`` each
    batch's data wait is one reader's time for it: reads, transforms and collate, what a worker does. With workers,
    the dry run's few steps come from what they prefetched, which says nothing of their rate."""
    if loader is None:
        return Finding("SKIP", "input plan", "the plan has no input line (no plan of the dry run fits)")
    if loader.workers:
        predicted = loader.images_per_s_per_worker
        return Finding("SKIP", "input plan", f"{predicted:.0f} images/s per loader worker predicted; with "
                       f"data.num_workers={loader.workers} the dry run's few steps come from what the workers "
                       "prefetched, which hides their rate (a run's pace record measures the wait over 20 steps)")
    # As the step times: the memory count's steps left out (its dispatch mode slows every op, the reads' too).
    timed = [r for o in outcomes for r in o.records if r.get("kind") == "step" and not r["first_of_epoch"]
             and r["step"] > MEASURED_STEPS and r["wait_s"] > 0 and isinstance(r.get("inputs"), list) and r["inputs"]
             and isinstance(r["inputs"][0], int)]
    if not timed:
        return Finding("SKIP", "input plan", "no steady step of the dry run read its batch")
    predicted = loader.images_per_s_in_process  # the reads in series with the step, as the dry run's
    samples = sum(r["inputs"][0] * r["batches"] for r in timed)
    measured = samples / sum(r["wait_s"] for r in timed)
    off = _apart(measured, predicted)
    # What the error costs a step: the batch's read time one way or the other, against the step's compute.
    batch = samples / len(timed)
    cost = batch * abs(1 / measured - 1 / max(predicted, 1e-9))
    compute = statistics.median(r["wall_s"] - r["wait_s"] for r in timed)
    what = (f"the training process's reads predicted {predicted:.0f} images/s, the dry run's (data.num_workers=0) gave "
            f"{measured:.0f} (prediction {off:+.0%})")
    if busy:
        return Finding("OK", "input plan", f"{what}; not compared: {busy}")
    if cost < READ_FLOOR * compute:
        return Finding("OK", "input plan", f"{what}; not compared: the two differ by {cost * 1e3:.1f} ms a batch, under "
                       f"{READ_FLOOR:.0%} of the {compute * 1e3:.0f} ms step")
    if abs(off) <= INPUT_TOLERANCE:
        return Finding("OK", "input plan", what)
    return Finding("WARN", "input plan", f"the loader rate more than {INPUT_TOLERANCE:.0%} from the prediction: {what}",
                   "trust the measured rate: each worker gives about that many images/s; size data.num_workers by it")
