"""Replay one training step under watch, and say in one line what made it non-finite (issue 41).

The same functions serve the run that just failed (:mod:`gputrain.engine.forensics`, every rank its own samples)
and ``gputrain replay`` (one process playing each rank in turn from the bundle the run wrote), so both print the
same report. A step is examined three ways from the same state: in the run's precision with every module watched
(:class:`~gputrain.nn.watch.Watch`), then the optimizer step that follows it, then again in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from gputrain.nn.watch import Event, Watch, plain_name
from gputrain.precision import Precision
from gputrain.strategies.base import MicroBatch, Strategy
from gputrain.tasks.base import Task

Micro = tuple[MicroBatch, list[tuple[int, ...]]]
"""A micro-batch and its samples' keys ``(epoch, index[, repeat])``."""


@dataclass
class Findings:
    """What one rank's share of the step showed."""

    rank: int
    samples: list[list[int]] = field(default_factory=list)
    """The keys of the rank's samples in the step."""
    bad_samples: list[list[int]] = field(default_factory=list)
    """Samples whose input (or floating target) holds NaN/inf."""
    forward: dict[str, Any] | None = None
    beyond: dict[str, Any] | None = None
    """Before ``forward``: the first float32 output beyond float16's range, which the next float16 op overflowed on."""
    backward: dict[str, Any] | None = None
    loss_finite: bool = True
    loss_gradient: str = ""
    """With no module to blame: the module whose output received a NaN/inf gradient from the loss's backward."""
    float32_finite: bool = True
    forward_weights: float | None = None
    """The largest |weight| of the module ``forward`` names, before the step (None: it holds none)."""
    outputs: dict[str, float] = field(default_factory=dict)
    gradients: dict[str, float] = field(default_factory=dict)
    outputs_float32: dict[str, float] = field(default_factory=dict)
    gradients_float32: dict[str, float] = field(default_factory=dict)


@dataclass
class StepOutcome:
    """What the optimizer step after the watched forward and backward did (every rank sees the same)."""

    largest_gradient: float = 0.0
    """The largest |gradient| of a parameter, unscaled, after the ranks' gradients were averaged."""
    weights_finite: bool = True
    lr: float = 0.0


def _rows(value: Any, n: int) -> list[bool]:
    """Per sample, whether ``value`` (a batch of ``n``: a tensor, a list of tensors or of dicts) is finite."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() and value.shape[0] == n:
        return torch.isfinite(value.reshape(n, -1)).all(dim=1).tolist()
    if isinstance(value, (list, tuple)) and len(value) == n:
        return [all(_rows(v, 1)) for v in value]
    if isinstance(value, dict):
        flags = [True] * n
        for v in value.values():
            flags = [a and b for a, b in zip(flags, _rows(v, n), strict=True)]
        return flags
    if isinstance(value, torch.Tensor) and value.is_floating_point() and n == 1:
        return [bool(torch.isfinite(value).all())]
    return [True] * n


def bad_samples(micros: Sequence[Micro]) -> list[list[int]]:
    """The keys of samples whose inputs or floating targets hold NaN/inf."""
    bad: list[list[int]] = []
    for micro, keys in micros:
        if not keys:
            continue
        inputs = _rows(micro.inputs, len(keys))
        targets = _rows(micro.targets, len(keys))
        bad += [list(key) for key, a, b in zip(keys, inputs, targets, strict=True) if not (a and b)]
    return bad


def watched_pass(strategy: Strategy, module: nn.Module, micros: Sequence[Micro], task: Task, precision: Precision,
                 *, float16: bool, weight_scale: float = 1.0) -> tuple[Watch, bool]:
    """Forward and backward of ``micros`` with every module watched; returns the watch and whether the loss was finite.

    ``weight_scale`` scales each micro-batch's loss weight (one process playing every rank sums their gradients:
    ``1 / dp`` makes the sum the ranks' average)."""
    finite = True
    with Watch(module, float16=float16) as watch:
        for micro, _keys in micros:
            if weight_scale != 1.0:
                micro = MicroBatch(inputs=micro.inputs, targets=micro.targets, size=micro.size,
                                   weight=micro.weight * weight_scale, sync=micro.sync)
            loss = strategy.forward_backward(module, micro, task=task, precision=precision)
            if loss is not None and not math.isfinite(float(loss)):
                finite = False
    return watch, finite


def record_pass(found: Findings, watch: Watch, loss_finite: bool, *, float32: bool,
                model: nn.Module | None = None) -> None:
    """Keep what a watched pass saw: its first bad modules, or (float32) whether it was finite. ``model``: the
    watched model, whose weights are still the step's starting ones (the optimizer has not stepped)."""
    if float32:
        found.float32_finite = (loss_finite and watch.forward is None and watch.backward is None
                                and not watch.first_bad_output_gradient)
        found.outputs_float32, found.gradients_float32 = watch.outputs, watch.gradients
        return
    found.forward = asdict(watch.forward) if watch.forward else None
    if watch.forward and model is not None:
        found.forward_weights = largest_weight(model, watch.forward.module)
    found.beyond = asdict(watch.beyond) if watch.beyond and watch.forward else None
    found.backward = asdict(watch.backward) if watch.backward else None
    found.loss_finite = loss_finite
    found.loss_gradient = watch.first_bad_output_gradient if watch.backward is None else ""
    found.outputs, found.gradients = watch.outputs, watch.gradients


def largest_weight(model: nn.Module, name: str) -> float | None:
    """The largest |weight| of the module the watch calls ``name`` (this rank's shard under FSDP); None when it
    holds no floating parameter of its own."""
    for full, module in model.named_modules():
        if full and plain_name(full) == name:
            local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters(recurse=False)]
            peaks = [float(p.detach().abs().amax().float()) for p in local if p.is_floating_point() and p.numel()]
            return max(peaks) if peaks else None
    return None


def largest_gradient(module: nn.Module) -> float:
    """The largest |gradient| of this rank's parameters (a shard under FSDP)."""
    peaks = [float(p.grad.detach().abs().amax().float()) for p in module.parameters()
             if p.grad is not None and p.grad.numel()]
    return max(peaks, default=0.0)


def float32_precision(precision: Precision) -> Precision:
    """The same device in float32: the control replay."""
    return Precision(precision.device)


def event(data: dict[str, Any] | None) -> Event | None:
    return Event(**data) if data else None
