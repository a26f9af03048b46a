"""Predicted tensor memory of one training step on one device, counted on fake tensors.

The run's own model, loss and optimizer take two training steps under ``FakeTensorMode``: shapes, dtypes and the
order of allocations are the run's, but no memory is allocated, so a ResNet-50 at 1024x1024 is planned on a laptop.
The first step creates the optimizer state; during the second, torch's ``MemTracker`` counts the live tensors by
kind and keeps the breakdown at the moment of the peak. Plans that split the model (FSDP units, pipeline
stages) are counted the same way in :mod:`gputrain.tools.plan.split_memory`.

This is tensor memory, as ``MemTracker`` measures a real step; a CUDA allocator's rounding, cuDNN workspaces and
the CUDA context come on top and are calibrated by one real step (:mod:`gputrain.tools.plan.timing`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from gputrain.engine.callbacks.memory import memory_parts, peak_only
from gputrain.strategies.base import tensors_of
from gputrain.tools.plan.workload import Workload

PARTS = ("parameters", "gradients", "optimizer", "activations", "other")


@dataclass(frozen=True)
class StepMemory:
    """Bytes held at the step's peak, by what holds them."""

    parameters: int
    """Parameters and buffers (FSDP: the local shards plus the units gathered at the peak)."""
    gradients: int
    optimizer: int
    activations: int
    """Saved for backward, and the backward's temporaries."""
    other: int
    """The batch, anything else."""
    moments: tuple[tuple[int, int], ...] = dataclasses.field(default=(), compare=False, repr=False)
    """Every moment of the step: (bytes that do not grow with the batch, the most the rest reached then), as
    :func:`~gputrain.engine.callbacks.memory.peak_only` records them; empty where nothing recorded them."""

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in PARTS}

    def plus(self, **extra: int) -> StepMemory:
        """More bytes that do not grow with the batch (the CUDA allocator's, the rest of a pipeline rank's model)."""
        added = sum(extra.values())
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in extra.items()},
                                   moments=tuple((held + added, rest) for held, rest in self.moments))


def counted(tracker: Any) -> StepMemory:
    """What a finished ``peak_only`` tracker counted: the peak by part, and its moments."""
    return StepMemory(**memory_parts(tracker.get_tracker_snapshot("peak")),
                      moments=tuple(sorted(getattr(tracker, "moments", {}).items())))


def largest_batch(low: StepMemory, high: StepMemory, at: int, room: float) -> int:
    """The largest batch whose step fits ``room`` bytes, from its counts at ``at`` (``low``) and ``2 at`` (``high``).

    Every moment's bytes are affine in the batch (activations and the batch grow with it, the fixed parts do not):
    the line through a moment's two counts, and the batch whose every moment stays within ``room``. Counts without
    moments (a real step's of a model that cannot run on fake tensors) fall back to the line through the peaks.
    """
    lines = [(low.peak, high.peak - low.peak)]
    if low.moments and high.moments:
        at_high = dict(high.moments)
        lines = [(held + rest, at_high[held] - rest) for held, rest in low.moments if held in at_high]
    largest = float("inf")
    for value, growth in lines:  # bytes at `at` samples, and how many more at `2 at`
        if growth > 0:
            largest = min(largest, at + (room - value) * at / growth)
        elif value > room:  # what does not grow with the batch does not fit by itself
            return 0
    return max(int(largest), 0) if largest != float("inf") else 2**31 - 1


class UnprofilableModel(ValueError):
    """The model cannot take a step on fake tensors (an op whose output shape depends on values)."""


class _ReducedLossStorage(TorchDispatchMode):
    """Gives a reduced loss the storage its real kernel leaves it, which the fake kernel does not.

    These kernels (CPU and CUDA alike: mse_loss and smooth_l1_loss are structured TensorIterator ops, the other two
    reduce in place) write the elementwise loss into their output, then reduce it and ``resize_`` that output to a
    scalar: the scalar loss keeps a storage of the unreduced size until it dies after backward (an autoencoder's
    MSE: one more image-sized buffer at the peak). Their meta kernels return a fresh scalar; this mode, under the
    fake mode and above it the trackers, hands the trackers a scalar on a storage of the real size instead.
    """

    _OPS = frozenset({torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default,
                      torch.ops.aten.binary_cross_entropy.default, torch.ops.aten.soft_margin_loss.default})

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in self._OPS or out.dim() != 0:  # reduction="none": the output is already elementwise
            return out
        if func is torch.ops.aten.smooth_l1_loss.default and kwargs.get("beta", args[3] if len(args) > 3 else 1.0) == 0:
            return out  # beta=0 is l1_loss, which reduces a temporary into a fresh scalar
        size = torch.broadcast_shapes(args[0].shape, args[1].shape)
        return torch.empty(size, dtype=out.dtype, device=out.device).resize_(()).copy_(out)


@contextmanager
def fake_model(work: Workload) -> Iterator[tuple[nn.Module, Callable[[Any], Any]]]:
    """A fake copy of the run's model on the run's device, and a function that fakes a batch."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = copy.deepcopy(work.meta_model())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _ReducedLossStorage():
        meta.to_empty(device=work.device)
        meta.train()

        def fake(batch: Any) -> Any:
            return tree_map(lambda t: mode.from_tensor(t).to(work.device) if isinstance(t, torch.Tensor) else t, batch)

        yield meta, fake


@contextmanager
def _running_modules() -> Iterator[list[str]]:
    """The qualified names of the modules whose forward is running, innermost last; a forward that raises stays."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    running: list[str] = []
    names: dict[int, str] = {}

    def enter(module: nn.Module, args: Any) -> None:
        if id(module) not in names:  # a top-level call: name it and everything under it
            root = type(module).__name__
            names.update({id(m): f"{root}.{n}" if n else root for n, m in module.named_modules()})
        running.append(names[id(module)])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        running.pop()

    handles = (register_module_forward_pre_hook(enter), register_module_forward_hook(leave))
    try:
        yield running
    finally:
        for handle in handles:
            handle.remove()


def guarded(what: str, run: Callable[[], StepMemory]) -> StepMemory:
    with _running_modules() as running:
        try:
            return run()
        except (RuntimeError, NotImplementedError) as err:  # fake-tensor failures are RuntimeError subclasses
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            layer = f"layer {running[-1]} " if running else ""
            raise UnprofilableModel(f"{what}: {layer}cannot run on fake tensors ({type(err).__name__}: "
                                    f"{first[:160]})") from err


def count_once(work: Workload, key: tuple[Any, ...], count: Callable[[], StepMemory]) -> StepMemory:
    """``count()``, or what it gave before for the same ``key`` on this workload (a pass on fake tensors takes
    seconds for a ResNet-50; single and model_parallel on a CPU, GPipe and model_parallel's stages, share them)."""
    if key not in work.counted:
        work.counted[key] = count()
    return work.counted[key]  # type: ignore[no-any-return]


def step_memory(work: Workload, batch_size: int, *, held_gradients: bool = False) -> StepMemory:
    """One whole-model training step at ``batch_size`` on one device (single, DDP's replica, model_parallel on a CPU).

    ``held_gradients``: every gradient is allocated for the whole step, as DDP's buckets hold them (its gradients
    are views into the buckets), instead of appearing during the backward.

    A model that cannot run on fake tensors (Mask R-CNN: how many boxes survive depends on values) is measured
    instead: a real step at ``batch_size`` on the device, counted the same way, said in the plan's notes (and fake
    tensors are not tried again for it).
    """
    return count_once(work, ("step", batch_size, held_gradients), lambda: _step_memory(work, batch_size, held_gradients))


def _step_memory(work: Workload, batch_size: int, held_gradients: bool) -> StepMemory:
    if work.runs_on_fake_tensors:
        try:
            return guarded(f"model {type(work.model).__name__}",
                            lambda: _fake_step_memory(work, batch_size, held_gradients))
        except UnprofilableModel as err:
            work.runs_on_fake_tensors = False
            work.notes.add(f"{err}; its memory is measured by real steps instead (slower to plan, same figures)")
    return measured_step_memory(work, batch_size, held_gradients)


def _counted_step(work: Workload, model: nn.Module, inputs: Any, targets: Any, held_gradients: bool) -> StepMemory:
    """A training step counted by ``MemTracker`` at its peak, the optimizer's state made first. The batch counts as
    the run's does: it is on the device during the step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer = work.optimizer(model)
    make_optimizer_state(model, optimizer, keep_gradients=held_gradients)
    tracker = peak_only(MemTracker())
    tracker.track_external(model, optimizer, *tensors_of((inputs, targets)))
    with tracker:
        work.train_step(model, optimizer, inputs, targets)
    return counted(tracker)


def make_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, keep_gradients: bool = False) -> None:
    """The optimizer state a first training step leaves, made by one optimizer step on zero gradients (a whole
    forward and backward cheaper; every trainable parameter is taken to get a gradient, as in the recipes' models).
    ``keep_gradients``: the zero gradients stay allocated, as DDP's buckets hold them for the whole step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    if not keep_gradients:
        optimizer.zero_grad(set_to_none=True)


def measured_step_memory(work: Workload, batch_size: int, held_gradients: bool = False) -> StepMemory:
    """A real training step of a copy of the model, counted as :func:`step_memory` counts a fake one."""
    from gputrain.strategies.base import move_to_device

    model = copy.deepcopy(work.model).to(work.device).train()
    inputs, targets = move_to_device(work.batch(batch_size), work.device)
    with torch.random.fork_rng(devices=[work.device] if work.device.type == "cuda" else []):
        return _counted_step(work, model, inputs, targets, held_gradients)


def _fake_step_memory(work: Workload, batch_size: int, held_gradients: bool) -> StepMemory:
    with fake_model(work) as (model, fake):
        inputs, targets = fake(work.batch(batch_size))
        return _counted_step(work, model, inputs, targets, held_gradients)
