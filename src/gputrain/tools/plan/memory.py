"""Predicted tensor memory of one training step on one device, counted on fake tensors.

The run's own model, loss and optimizer take two training steps under ``FakeTensorMode``: shapes, dtypes and the
order of allocations are the run's, but no memory is allocated, so a ResNet-50 at 1024x1024 is planned on a laptop.
The first step creates the optimizer state; during the second, torch's ``MemTracker`` counts the live tensors by
kind and keeps the breakdown at the moment of the peak. FSDP runs under ``FSDPMemTracker`` on a fake process group
of the plan's world size (torch's ``fake`` backend, no other process), so the shards and gathered units are the ones
FSDP itself allocates. A pipeline stage runs its own schedule (GPipe: every forward, then every backward; 1F1B: at
most ``stages - stage`` micro-batches in flight) on fake inputs of the shape the previous stage hands it.

This is tensor memory, as ``MemTracker`` measures a real step; a CUDA allocator's rounding, cuDNN workspaces and
the CUDA context come on top and are calibrated by one real step (:mod:`gputrain.tools.plan.timing`).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
def _fake(work: Workload) -> Iterator[tuple[nn.Module, Callable[[Any], Any]]]:
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


def _guarded(what: str, run: Callable[[], StepMemory]) -> StepMemory:
    with _running_modules() as running:
        try:
            return run()
        except (RuntimeError, NotImplementedError) as err:  # fake-tensor failures are RuntimeError subclasses
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            layer = f"layer {running[-1]} " if running else ""
            raise UnprofilableModel(f"{what}: {layer}cannot run on fake tensors ({type(err).__name__}: "
                                    f"{first[:160]})") from err


def _once(work: Workload, key: tuple[Any, ...], count: Callable[[], StepMemory]) -> StepMemory:
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
    return _once(work, ("step", batch_size, held_gradients), lambda: _step_memory(work, batch_size, held_gradients))


def _step_memory(work: Workload, batch_size: int, held_gradients: bool) -> StepMemory:
    if work.runs_on_fake_tensors:
        try:
            return _guarded(f"model {type(work.model).__name__}",
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
    with _fake(work) as (model, fake):
        inputs, targets = fake(work.batch(batch_size))
        return _counted_step(work, model, inputs, targets, held_gradients)


def fsdp_memory(work: Workload, batch_size: int, world_size: int, units: Sequence[str]) -> StepMemory:
    """One FSDP2 training step of one rank of ``world_size``, ``units`` sharded as gputrain's FSDP shards them."""
    return _once(work, ("fsdp", batch_size, world_size, tuple(units)),
                 lambda: _fsdp_memory(work, batch_size, world_size, units))


def _fsdp_memory(work: Workload, batch_size: int, world_size: int, units: Sequence[str]) -> StepMemory:
    def run() -> StepMemory:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            raise RuntimeError("predicting FSDP memory makes a fake process group: run it outside a training job")
        hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; this process is no rank
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            mesh = init_device_mesh(work.device.type, (world_size,))  # outside fake mode: a mesh holds real groups
            with _fake(work) as (model, fake):
                for name in [*units, ""]:
                    fully_shard(model.get_submodule(name) if name else model, mesh=mesh)
                inputs, targets = fake(work.batch(batch_size))
                optimizer = work.optimizer(model)
                make_optimizer_state(model, optimizer)  # sharded state: the parameters are their shards
                tracker = peak_only(FSDPMemTracker(model, optimizer))
                tracker.track_inputs((inputs, targets))
                with tracker:
                    work.train_step(model, optimizer, inputs, targets)
                return counted(tracker)
        finally:
            dist.destroy_process_group()
            sys.excepthook = hook

    return _guarded(f"model {type(work.model).__name__} under FSDP", run)


def in_flight_limit(stages: int, stage: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at once: the partitioner's activation scale
    (all of them under GPipe; under 1F1B the stage starts backwards once ``stages - stage`` are in flight)."""
    from gputrain.parallel.plan import activation_scale

    return round(activation_scale(stages, micro_batches, schedule)[stage] * micro_batches)


def stage_memory(work: Workload, split: Sequence[int], stage: int, *, batch_size: int, micro_batches: int,
                 schedule: str) -> StepMemory:
    """Stage ``stage`` of the model cut before ``split``: its parameters, gradients and optimizer state, and the
    activations of the micro-batches it holds at once under ``schedule`` (model_parallel runs as gpipe)."""
    return _once(work, ("stage", tuple(split), stage, batch_size, micro_batches, schedule),
                 lambda: _stage_memory(work, split, stage, batch_size, micro_batches, schedule))


def _stage_memory(work: Workload, split: Sequence[int], stage: int, batch_size: int, micro_batches: int,
                  schedule: str) -> StepMemory:
    from gputrain.parallel.blocks import run_blocks, sequential_blocks, split_stages
    from gputrain.strategies.micro_batches import chunk_batch, split_size

    def run() -> StepMemory:
        from torch.distributed._tools.mem_tracker import MemTracker

        with _fake(work) as (model, fake):
            blocks = sequential_blocks(model, children_in_order=bool(work.split_points))
            stages = split_stages(blocks, split)
            inputs, targets = fake(work.batch(batch_size))
            size = split_size(batch_size, micro_batches)
            chunks = list(zip(chunk_batch(inputs, size), chunk_batch(targets, size), strict=True))
            with torch.no_grad():  # what each stage receives: the chain's state before it
                received = [run_blocks(blocks[:split[stage - 1]], x) if stage else x for x, _ in chunks]
                # What torch's pipelining holds beside the stage: every rank reads the whole batch, and a buffer per
                # micro-batch for the activations it receives and for the gradients that come back for its outputs.
                start = split[stage - 1] if stage else 0
                sent = [] if stage == len(split) else [torch.empty_like(t) for x in received
                                                        for t in tensors_of(run_blocks(blocks[start:split[stage]], x))]
                buffers = [*tensors_of((inputs, targets)), *(tensors_of(received) if stage else []), *sent]
            mine = stages[stage]
            optimizer = work.optimizer(mine)
            limit = in_flight_limit(len(stages), stage, len(chunks), schedule)
            last = stage == len(stages) - 1

            def one_step(tracker: Any) -> None:
                pending: list[Any] = []
                outputs: list[Any] = []  # the last stage's schedule keeps every micro-batch's output to the end

                def backward() -> None:
                    out, y = pending.pop(0)
                    if last:
                        outputs.append(tuple(t.detach() for t in tensors_of(out)))
                        work.loss_of(out, y).backward()
                    else:
                        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
                        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

                for x, (_, y) in zip(received, chunks, strict=True):
                    if len(pending) == limit:
                        backward()
                    # A later stage's input is an activation whose gradient goes back to the stage before; the first
                    # stage's is the batch, which needs none (torch's first stage computes no input gradient).
                    state = tuple(t.detach().requires_grad_(t.is_floating_point() and stage > 0)
                                  for t in (x if isinstance(x, tuple) else (x,)))
                    tracker.reset_mod_stats()  # it refuses a root module called twice; the peak is kept apart
                    with work.autocast():
                        pending.append((mine(*state), y))
                while pending:
                    backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            make_optimizer_state(mine, optimizer)
            tracker = peak_only(MemTracker())
            tracker.track_external(mine, optimizer, *buffers)
            with tracker:
                one_step(tracker)
            return counted(tracker)

    return _guarded(f"stage {stage + 1} of {type(work.model).__name__}", run)
