"""Predicted tensor memory of one device of a plan that splits the model: an FSDP rank, or a pipeline stage.

Counted as :mod:`gputrain.tools.plan.memory` counts a whole step, on fake tensors. FSDP runs under
``FSDPMemTracker`` on a fake process group of the plan's world size (torch's ``fake`` backend, no other process), so
the shards and gathered units are the ones FSDP itself allocates. A pipeline stage runs its own schedule (GPipe:
every forward, then every backward; 1F1B: at most ``stages - stage`` micro-batches in flight) on fake inputs of the
shape the previous stage hands it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gputrain.engine.callbacks.memory import peak_only
from gputrain.strategies.base import tensors_of
from gputrain.tools.plan.memory import (
    StepMemory,
    count_once,
    counted,
    fake_model,
    guarded,
    make_optimizer_state,
)
from gputrain.tools.plan.workload import Workload


def fsdp_memory(work: Workload, batch_size: int, world_size: int, units: Sequence[str]) -> StepMemory:
    """One FSDP2 training step of one rank of ``world_size``, ``units`` sharded as gputrain's FSDP shards them."""
    return count_once(work, ("fsdp", batch_size, world_size, tuple(units)),
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
            with fake_model(work) as (model, fake):
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

    return guarded(f"model {type(work.model).__name__} under FSDP", run)


def in_flight_limit(stages: int, stage: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) holds at once: the partitioner's activation scale
    (all of them under GPipe; under 1F1B the stage starts backwards once ``stages - stage`` are in flight)."""
    from gputrain.parallel.plan import activation_scale

    return round(activation_scale(stages, micro_batches, schedule)[stage] * micro_batches)


def stage_memory(work: Workload, split: Sequence[int], stage: int, *, batch_size: int, micro_batches: int,
                 schedule: str) -> StepMemory:
    """Stage ``stage`` of the model cut before ``split``: its parameters, gradients and optimizer state, and the
    activations of the micro-batches it holds at once under ``schedule`` (model_parallel runs as gpipe)."""
    return count_once(work, ("stage", tuple(split), stage, batch_size, micro_batches, schedule),
                 lambda: _stage_memory(work, split, stage, batch_size, micro_batches, schedule))


def _stage_memory(work: Workload, split: Sequence[int], stage: int, batch_size: int, micro_batches: int,
                  schedule: str) -> StepMemory:
    from gputrain.parallel.blocks import run_blocks, sequential_blocks, split_stages
    from gputrain.strategies.micro_batches import chunk_batch, split_size

    def run() -> StepMemory:
        from torch.distributed._tools.mem_tracker import MemTracker

        with fake_model(work) as (model, fake):
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

    return guarded(f"stage {stage + 1} of {type(work.model).__name__}", run)
