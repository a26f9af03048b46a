"""Precision as a plugin: the loop calls the same four methods whatever the precision.

``32`` is plain float32. ``16-mixed`` runs the forward under ``torch.autocast`` in float16
and scales the loss with a ``GradScaler`` (whose state goes into checkpoints, since a
resumed run must start from the same scale). ``bf16-mixed`` autocasts to bfloat16, whose
exponent range makes loss scaling unnecessary.

A step the scaler skips (its gradients held inf/NaN) leaves the model as it was: the scaler keeps the
parameters, and :meth:`MixedPrecision.begin_step` keeps a copy of the buffers, which the forward changes before
the scaler decides (BatchNorm's running statistics: a forward that overflowed float16 would leave them NaN).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class Precision:
    """float32: every method is the plain PyTorch call."""

    name = "32"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin_step(self, module: nn.Module) -> None:
        """Called before the first forward of each optimizer step."""

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        yield

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale (before clipping)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; returns False when the step was skipped (non-finite gradients)."""
        optimizer.step()
        return True

    def log_values(self, skipped_steps: int = 0) -> dict[str, float]:
        """What a logging step records of the precision: 16-mixed's loss scale, and the steps of the window that
        its scaler skipped."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module


class BufferSnapshot:
    """A module's buffers as they were before a step, put back when the step is skipped.

    One ``torch._foreach_copy_`` into the same memory each step while the module keeps its buffer tensors; a module
    that replaced one (a forward that assigns ``self.stat = ...``) is restored by name into its current tensors.
    """

    def __init__(self) -> None:
        self.module: nn.Module | None = None
        self.names: list[str] = []
        self.sources: list[torch.Tensor] = []
        self.saved: list[torch.Tensor] = []

    def _same(self, buffers: list[torch.Tensor]) -> bool:
        return len(buffers) == len(self.sources) and all(a is b for a, b in zip(buffers, self.sources, strict=True))

    @torch.no_grad()
    def take(self, module: nn.Module) -> None:
        buffers = list(module.buffers())
        if buffers and module is self.module and self._same(buffers):
            torch._foreach_copy_(self.saved, buffers)
        else:
            self.module, self.sources = module, buffers
            self.names = [name for name, _ in module.named_buffers()]
            self.saved = [b.detach().clone() for b in buffers]

    @torch.no_grad()
    def restore(self) -> None:
        if self.module is None or not self.saved:
            return
        buffers = list(self.module.buffers())
        if self._same(buffers):
            torch._foreach_copy_(buffers, self.saved)
            return
        current = dict(self.module.named_buffers())
        for name, value in zip(self.names, self.saved, strict=True):
            if name in current and current[name].shape == value.shape:
                current[name].copy_(value)


class MixedPrecision(Precision):
    """Autocast to ``dtype``; with float16 also a GradScaler."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device)
        self.dtype = dtype
        self.name = "16-mixed" if dtype == torch.float16 else "bf16-mixed"
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self._before_step = BufferSnapshot()

    def begin_step(self, module: nn.Module) -> None:
        if self.scaler is not None:
            self._before_step.take(module)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            optimizer.step()
            return True
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # GradScaler lowers the scale exactly when it skipped the step for inf/NaN gradients.
        stepped = self.scaler.get_scale() >= scale_before
        if not stepped:
            self._before_step.restore()
        return stepped

    def log_values(self, skipped_steps: int = 0) -> dict[str, float]:
        if self.scaler is None:
            return {}
        return {"train/loss_scale": self.scaler.get_scale(), "train/skipped_steps": float(skipped_steps)}

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def build_precision(name: str, device: torch.device) -> Precision:
    """``32``, ``16-mixed`` or ``bf16-mixed`` for ``device``."""
    name = str(name)
    if name in ("32", "32-true", "fp32"):
        return Precision(device)
    if name in ("16-mixed", "fp16-mixed"):
        return MixedPrecision(device, torch.float16)
    if name in ("bf16-mixed",):
        # Native only, as `auto` and `mixed` decide: torch's default answer also counts GPUs that emulate bfloat16
        # (a V100, a T4), where it runs without tensor cores, slower than float16.
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            raise ValueError("trainer.precision=bf16-mixed but this GPU has no bfloat16; use 16-mixed")
        return MixedPrecision(device, torch.bfloat16)
    raise ValueError(f"trainer.precision={name!r} is unknown; choose auto, mixed, 32, 16-mixed or bf16-mixed")
