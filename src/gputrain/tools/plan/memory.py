"""Predicted tensor memory of one training step on one device, counted on fake tensors.

Two steps (forward, loss, backward, optimizer step) of the real model run under ``FakeTensorMode``: shapes, dtypes and the order of allocations are the run's, but no tensor
memory is allocated, so a ResNet-50 at 1024x1024 is predicted on a laptop. The first step creates the optimizer
state; during the second, torch's ``MemTracker`` counts the live tensors by kind and keeps the breakdown at the moment of the peak; for FSDP, ``FSDPMemTracker`` follows the sharded
model on a fake process group of the plan's world size (torch's ``fake`` backend, no other process), so the shards
and the all-gathered units are the ones FSDP itself allocates.

What this counts is tensor memory, as ``MemTracker`` measures a real step on a CPU; a CUDA allocator's rounding,
cuDNN workspaces and the CUDA context come on top (calibrated by a real step, not here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


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
    """The batch and anything else."""

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other}


# MemTracker's and FSDPMemTracker's kinds, as StepMemory's fields.
_KINDS = {
    "Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
    "Unsharded Param": "parameters", "All Gather": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Temp": "activations",
    "Inputs": "other", "Other": "other",
}


def _parts(snapshot: dict[Any, dict[Any, int]]) -> StepMemory:
    totals = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "other"), 0)
    for by_kind in snapshot.values():
        for kind, size in by_kind.items():
            name = getattr(kind, "value", kind)
            if name != "Total":
                totals[_KINDS.get(name, "other")] += size
    return StepMemory(**totals)


def run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
              loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int) -> None:
    for _ in range(steps):
        inputs, targets = batch
        loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def predict_step_memory(
    build_model: Callable[[], nn.Module],
    batch: Batch,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    build_optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer],
    *,
    fsdp_units: Sequence[str] | None = None,
    world_size: int = 1,
) -> StepMemory:
    """The tensor memory one device holds at the peak of a training step at ``batch`` (this device's batch).

    ``fsdp_units`` (module names, ``""`` for the root last) shards the model with FSDP2 over ``world_size`` ranks
    of a fake process group; without it the model is whole, as single and DDP hold it. ``build_model`` is called
    under the meta device; ``batch`` may be real tensors (only their shapes and dtypes are used).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with torch.device("meta"):
        model = build_model()
    if fsdp_units is None:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model.to_empty(device="cpu")
            fake_batch = (fake.from_tensor(batch[0]), fake.from_tensor(batch[1]))
            optimizer = build_optimizer(list(model.parameters()))
            run_steps(model, optimizer, fake_batch, loss, steps=1)  # the optimizer state exists from here on
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                run_steps(model, optimizer, fake_batch, loss, steps=1)
            return _parts(tracker.get_tracker_snapshot("peak"))
    return _predict_fsdp(model, fake_batch_of=batch, loss=loss, build_optimizer=build_optimizer,
                         units=fsdp_units, world_size=world_size)


def _predict_fsdp(model: nn.Module, *, fake_batch_of: Batch, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  build_optimizer: Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer],
                  units: Sequence[str], world_size: int) -> StepMemory:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("predicting FSDP memory needs a process of its own (it makes a fake process group)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))  # outside fake mode: a mesh is made of real groups
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model.to_empty(device="cpu")
            for name in units:
                fully_shard(model.get_submodule(name) if name else model, mesh=mesh)
            batch = (fake.from_tensor(fake_batch_of[0]), fake.from_tensor(fake_batch_of[1]))
            optimizer = build_optimizer(list(model.parameters()))
            run_steps(model, optimizer, batch, loss, steps=1)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(batch)
            with tracker:
                run_steps(model, optimizer, batch, loss, steps=1)
            return _parts(tracker.get_tracker_snapshot("peak"))
    finally:
        dist.destroy_process_group()
