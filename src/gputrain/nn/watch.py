"""Where a step first goes non-finite: hooks on every module of a model, for one replayed step.

This is forensics, attached only to the replay of a step that failed (:mod:`gputrain.engine.forensics`); a run
that never fails never sees these hooks.

The forward: a forward hook per module takes the largest |output| (one reduction: a NaN or inf anywhere makes it
NaN or inf). Forward hooks fire as each module's forward ends, children before their parent, so the first module
whose output is NaN/inf, in firing order, is the innermost one where the values went wrong. Under a float16 precision
the first output beyond float16's largest value before it is kept too: a float32 module (BatchNorm under autocast, a
module of ``trainer.fp32_modules``) hands such values to the next float16 op, which overflows.

The backward: tensor hooks, not module backward hooks, which refuse a module whose output is changed in place
afterwards (ResNet's ``out += identity``, an in-place ReLU); a tensor hook registered before an in-place change
still receives the gradient of the value the module produced. A hook on each output gets the gradient that reached
the module; a hook on each input, the gradient the module's backward made of it. The first module whose input
gradient is non-finite while the gradient of its output was finite made the NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

FLOAT16_MAX = float(torch.finfo(torch.float16).max)

_WRAPPERS = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def plain_name(name: str) -> str:
    """The user's module name, without what a strategy or compiler wraps around it (DDP's ``module.``)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def largest(value: Any) -> float:
    """The largest |x| of the floating tensors in ``value`` (nested tuples, lists, dicts); NaN or inf if any is."""
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() and value.numel()):
            return 0.0
        return float(value.detach().abs().amax().float())
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        peaks = [largest(v) for v in value]
        bad = [p for p in peaks if not math.isfinite(p)]
        return bad[0] if bad else max(peaks, default=0.0)
    return 0.0


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@dataclass
class Event:
    """A module where the step went bad."""

    module: str
    kind: str
    """The module's class name."""
    phase: str
    """``forward`` (its output) or ``backward`` (the gradient its backward made)."""
    value: float
    """The largest |value|: NaN or inf, or beyond float16's largest value."""
    order: int
    """When, among the hooks that fired in this replay (forward and backward counted apart)."""

    def describe(self) -> str:
        what = "output" if self.phase == "forward" else "input gradient"
        if math.isfinite(self.value):
            return f"{self.module} ({self.kind}): its {what} reached {self.value:.3g}, beyond float16's {FLOAT16_MAX:.0f}"
        return f"{self.module} ({self.kind}): its {what} became {'NaN' if math.isnan(self.value) else 'inf'}"


class Watch:
    """Forward and backward hooks on every named module of ``model`` while in a ``with`` block.

    ``float16``: an output beyond float16's range counts as bad (the run's precision is 16-mixed).
    """

    def __init__(self, model: nn.Module, *, float16: bool) -> None:
        self.model, self.float16 = model, float16
        self.outputs: dict[str, float] = {}
        """Each module's largest |output| over the replay."""
        self.gradients: dict[str, float] = {}
        """Each module's largest |input gradient| over the replay."""
        self.forward: Event | None = None
        """The first module whose output became NaN/inf."""
        self.beyond: Event | None = None
        """Under float16: the first module, before :attr:`forward`, whose (float32) output went beyond float16's
        range: the values the next float16 op overflowed on."""
        self._out_bad: set[str] = set()
        self.first_bad_output_gradient = ""
        """The first module whose output's gradient arrived NaN/inf (the loss's backward made it, if no module did)."""
        self._input_events: list[tuple[Event, int]] = []
        self._fired = [0, 0]
        self._handles: list[Any] = []

    def __enter__(self) -> Watch:
        for name, module in self.model.named_modules():
            if name:
                self._handles.append(module.register_forward_pre_hook(self._before(plain_name(name), module)))
                self._handles.append(module.register_forward_hook(self._after(plain_name(name), module)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


    def _before(self, name: str, module: nn.Module) -> Any:
        def hook(_module: nn.Module, args: Any) -> None:
            for t in _tensors(args):
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(lambda g: self._input_gradient(name, module, g))
        return hook

    def _after(self, name: str, module: nn.Module) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            peak = largest(output)
            self.outputs[name] = peak if not math.isfinite(peak) else max(self.outputs.get(name, 0.0), peak)
            self._fired[0] += 1
            if self.forward is None and not math.isfinite(peak):
                self.forward = Event(name, type(module).__name__, "forward", peak, self._fired[0])
            elif self.forward is None and self.beyond is None and self.float16 and peak > FLOAT16_MAX:
                self.beyond = Event(name, type(module).__name__, "forward", peak, self._fired[0])
            for t in _tensors(output):
                if t.requires_grad and t.is_floating_point():
                    t.register_hook(lambda g: self._output_gradient(name, g))
        return hook

    def _output_gradient(self, name: str, grad: torch.Tensor) -> None:
        if not math.isfinite(largest(grad)):
            self._out_bad.add(name)
            self.first_bad_output_gradient = self.first_bad_output_gradient or name

    def _input_gradient(self, name: str, module: nn.Module, grad: torch.Tensor) -> None:
        peak = largest(grad)
        self.gradients[name] = peak if not math.isfinite(peak) else max(self.gradients.get(name, 0.0), peak)
        self._fired[1] += 1
        # Gradients are never held to float16's range here: 16-mixed scales them, and its scaler handles overflow.
        if not math.isfinite(peak) and name not in self._out_bad and len(self._input_events) < 64:
            event = Event(name, type(module).__name__, "backward", peak, self._fired[1])
            self._input_events.append((event, grad.data_ptr()))

    @property
    def backward(self) -> Event | None:
        """The first module whose backward made a non-finite gradient of its input from a finite one.

        A block and its first layer share their input tensor, whose hooks fire together (the block's first): of
        the modules handed the same bad gradient, the innermost is named."""
        if not self._input_events:
            return None
        first, ptr = self._input_events[0]
        same = [e for e, p in self._input_events if p == ptr]
        return max(same, key=lambda e: (e.module.count(".") + 1 if e.module else 0, -e.order))
