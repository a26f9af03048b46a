"""From what the replay of a non-finite step saw on each rank, the one-line report and its fix (issue 41).

The causes are tried in the order they explain each other: data that is already NaN explains every module after it;
a module's forward explains the loss and the backward; a backward explains the optimizer step; an optimizer step
that turned finite gradients into non-finite weights is the step's, not any module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gputrain.engine.replay import Findings, StepOutcome, event
from gputrain.nn.watch import FLOAT16_MAX, Event


@dataclass
class Report:
    line: str
    """The report: cause, where, and the fix, in one line."""
    cause: str
    """``data``, ``forward``, ``backward``, ``loss``, ``loss backward``, ``optimizer step`` or ``not reproduced``."""
    rank: int | None = None
    module: str = ""
    samples: list[list[int]] | None = None
    float32_fixes: bool | None = None
    fix: str = ""


def _samples(keys: list[list[int]], names: dict[str, str], limit: int = 4) -> str:
    shown = []
    for key in keys[:limit]:
        index = key[1] if len(key) > 1 else key[0]
        name = names.get(str(index), "")
        shown.append(f"{index}" + (f" ({name})" if name else ""))
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(shown) + more


def _first(findings: list[Findings], phase: str, data_parallel: bool) -> tuple[Event, Findings] | None:
    """The first bad module of ``phase`` over the ranks: by the order it fired, then the lowest rank.

    Data-parallel ranks run the same modules on different samples, so the earliest module wins. Without data
    parallelism (a pipeline's stages) ranks run in stage order: the forward's first stage, the backward's last."""
    hits = [(e, f) for f in findings if (e := event(f.forward if phase == "forward" else f.backward)) is not None]
    if not hits:
        return None
    if data_parallel:
        return min(hits, key=lambda h: (h[0].order, h[1].rank))
    return min(hits, key=lambda h: (h[1].rank if phase == "forward" else -h[1].rank, h[0].order))


def decide(findings: list[Findings], outcome: StepOutcome, *, step: int, epoch: int, precision: str,
           data_parallel: bool, sample_names: dict[str, str], float32_modules: list[str] | None = None) -> Report:
    """The report of the replayed step ``step`` (a global step count, 1-based) of ``epoch`` (0-based).

    ``float32_modules``: the run's ``trainer.fp32_modules``, which a suggested list keeps."""
    at = f"step {step} (epoch {epoch + 1})"
    float32_ok = all(f.float32_finite for f in findings)
    in_16 = "mixed" in precision
    for found in findings:
        if found.bad_samples:
            named = any(str(key[1] if len(key) > 1 else key[0]) in sample_names for key in found.bad_samples)
            what = "that sample's file" if named else "that sample (by its index in the dataset)"
            return Report(
                f"replay of {at}: sample {_samples(found.bad_samples, sample_names)} on rank {found.rank} holds NaN/inf "
                f"in its input or target; fix: inspect or replace {what} (the data, not the model, is non-finite)",
                "data", found.rank, samples=found.bad_samples, float32_fixes=False, fix=f"inspect {what}")
    for phase in ("forward", "backward"):
        hit = _first(findings, phase, data_parallel)
        if hit is None:
            continue
        bad, found = hit
        if float32_ok:
            keep = [m for m in float32_modules or [] if m != bad.module]
            fix = (f"trainer.fp32_modules=[{','.join([*keep, bad.module])}] (or --precision bf16-mixed)" if in_16
                   else "lower optim.lr or set trainer.grad_clip_norm")
            verdict = "float32 makes the step finite"
        elif phase == "backward":
            fix = (f"make the backward of {bad.module} finite (a sqrt, log or division at 0 needs an epsilon, a "
                   "clamp, or a custom gradient)")
            verdict = "float32 does not make it finite, so precision is not the cause"
        else:
            fix = "lower optim.lr or set trainer.grad_clip_norm (the activations have grown beyond float32)"
            verdict = "float32 does not make it finite, so precision is not the cause"
        source = event(found.beyond) if phase == "forward" else None
        after = (f", from values up to {source.value:.3g} out of {source.module} ({source.kind}), beyond float16's "
                 f"{FLOAT16_MAX:.0f}" if source else "")
        if phase == "forward" and found.forward_weights is not None:  # weights grown by earlier steps show here
            after += f" (its weights up to {found.forward_weights:.3g} in size)"
        return Report(
            f"replay of {at} at precision {precision}: the first non-finite value is in {bad.describe()}{after}, on rank "
            f"{found.rank} (samples {_samples(found.samples, sample_names)}); {verdict}; fix: {fix}",
            phase, found.rank, bad.module, found.samples, float32_ok, fix)
    bad_loss = [f for f in findings if not f.loss_finite]
    if bad_loss:
        found = bad_loss[0]
        return Report(
            f"replay of {at}: every module's output and gradient is finite but the loss of rank {found.rank} is "
            f"NaN/inf (samples {_samples(found.samples, sample_names)}); fix: check those samples' targets and the "
            "loss function", "loss", found.rank, samples=found.samples, float32_fixes=float32_ok,
            fix="check the targets and the loss")
    from_loss = [f for f in findings if f.loss_gradient]
    if from_loss:
        found = from_loss[0]
        verdict = ("float32 makes the step finite" if float32_ok
                   else "float32 does not make it finite, so precision is not the cause")
        return Report(
            f"replay of {at}: the loss of rank {found.rank} is finite but its backward sends a NaN/inf gradient into "
            f"the model (at the output of {found.loss_gradient}; samples {_samples(found.samples, sample_names)}); "
            f"{verdict}; fix: make the loss's gradient finite (a sqrt, log or division at 0 in the loss needs an "
            "epsilon or a clamp)", "loss backward", found.rank, found.loss_gradient, found.samples, float32_ok,
            "make the loss's gradient finite")
    if not outcome.weights_finite:
        grad = outcome.largest_gradient
        return Report(
            f"replay of {at}: the forward and backward are finite (largest |gradient| {grad:.3g}) but the optimizer "
            f"step made the weights NaN/inf at lr {outcome.lr:.3g}; no module is the cause; fix: lower optim.lr or set "
            "trainer.grad_clip_norm", "optimizer step", float32_fixes=False,
            fix="lower optim.lr or set trainer.grad_clip_norm")
    return Report(
        f"replay of {at}: the step is finite in the replay, so the failure did not reproduce (a non-deterministic "
        "kernel, or data read differently); fix: see which modules come nearest to float16's range in stats.json beside "
        "this report", "not reproduced")


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def stats_of(findings: list[Findings]) -> dict[str, Any]:
    """Each rank's largest |output| and |input gradient| per module, in the run's precision and in float32."""
    clean = lambda d: {k: finite_or_none(v) for k, v in d.items()}  # noqa: E731  (JSON has no NaN)
    return {str(f.rank): {"outputs": clean(f.outputs), "gradients": clean(f.gradients),
                          "outputs_float32": clean(f.outputs_float32), "gradients_float32": clean(f.gradients_float32)}
            for f in findings}
