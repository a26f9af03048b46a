"""The doctor's float16 headroom (issue 41, item 4): each module's largest |activation| in the dry run against
float16's largest value, and the loss scale over the steps.

A module within 10x of float16's 65,504 is where a ``16-mixed`` run overflows first, a few steps or a few epochs in,
as activations grow; the fix is to run it in float32 (``trainer.fp32_modules``) or to train in ``bf16-mixed``,
whose range is float32's. The probe is a forward hook per module that keeps a running maximum: a reduction per
module per step, only in the doctor's dry run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gputrain.config import RunConfig
from gputrain.tools.diagnose.doctor_checks import Finding
from gputrain.tools.diagnose.outcome import RankOutcome

FLOAT16_MAX = float(torch.finfo(torch.float16).max)
WARN_WITHIN = 10.0
"""A module whose largest |activation| is within this factor of float16's largest value is named."""
FLOAT16_PRECISIONS = ("16-mixed", "fp16-mixed")
"""Precisions that run in float16 (``mixed`` does only on GPUs without bfloat16: noted, not warned)."""


def _largest(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().abs().max()) if value.is_floating_point() and value.numel() else 0.0
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return max((_largest(v) for v in value), default=0.0)
    return 0.0


class ActivationPeaks:
    """The largest |output| of every named module of ``model`` over the forwards it sees."""

    def __init__(self, model: nn.Module) -> None:
        self.peaks: dict[str, float] = {}

        def hook(name: str) -> Any:
            def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
                peak = _largest(output)
                if peak > self.peaks.get(name, -1.0):
                    self.peaks[name] = peak
            return record

        self.handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]

    def take(self) -> dict[str, float]:
        return dict(self.peaks)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _plain(name: str) -> str:
    """The user's module name, without the wrappers a strategy adds (DDP's ``module.``, a compiled ``_orig_mod.``)."""
    for prefix in ("module.", "_orig_mod."):
        name = name.removeprefix(prefix)
    return name


def check_headroom(outcomes: list[RankOutcome], cfg: RunConfig) -> Finding:
    """The tightest modules' headroom over every rank, and the loss scale's course; WARN within 10x under float16."""
    peaks: dict[str, float] = {}
    for outcome in outcomes:
        for record in outcome.records:
            for name, peak in (record.get("peaks") or {}).items():
                peaks[_plain(name)] = max(peaks.get(_plain(name), 0.0), float(peak))
    if not peaks:
        return Finding("SKIP", "float16 headroom", "no activation was recorded (the dry run ended before a step)")
    tight = sorted(((FLOAT16_MAX / p if p > 0 else float("inf"), n) for n, p in peaks.items() if n), key=lambda x: x[0])
    close = [(h, n) for h, n in tight if h < WARN_WITHIN]
    scales = [r["loss_scale"] for o in outcomes[:1] for r in o.records if r.get("loss_scale") is not None]
    details = [f"{n}: largest |activation| {FLOAT16_MAX / h:.4g}, {h:.3g}x below float16's {FLOAT16_MAX:.0f}"
               for h, n in (close or tight)[:5]]
    if scales:
        details.append(f"loss scale over the dry run: {scales[0]:g} -> {scales[-1]:g}")
    in_float16 = str(cfg.trainer.precision) in FLOAT16_PRECISIONS
    if close and in_float16:
        # The innermost modules: a block whose output is its last layer's needs only that layer in float32.
        inner = [n for _, n in close if not any(o.startswith(f"{n}.") for _, o in close)]
        names = ",".join(inner[:3])
        return Finding("WARN", "float16 headroom", f"{len(close)} module(s) within {WARN_WITHIN:g}x of float16's "
                       "largest value: a 16-mixed run overflows there first",
                       f"trainer.fp32_modules=[{names}] runs them in float32, or --precision bf16-mixed", details)
    headroom, name = tight[0]
    what = f"the tightest module, {name}, is {headroom:.3g}x below float16's largest value"
    note = "" if in_float16 else f"not in float16 at precision {cfg.trainer.precision}; for a 16-mixed run"
    return Finding("OK", "float16 headroom", what, note, details if close else [])
