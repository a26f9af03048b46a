"""Measured time: a few real training steps of the whole model on this machine's device, and the block profile.

Step time is measured, not derived from FLOPs: one warm-up step, then the median of ``repeats`` steps of the run's
model, loss, precision and optimizer at a small batch on the device the run trains on. A step's time grows in
proportion to its samples once the device is busy, so other batches are scaled from it (on a GPU a small batch
underuses the device: the probe batch is the largest per-device batch whose memory was predicted to fit).
How the step divides over pipeline stages comes from the partitioner's own profiler
(:func:`gputrain.parallel.profile.profile_blocks`), per block, at the micro-batch.

On CUDA the same steps give the allocator's overhead over the counted tensor memory (cuDNN workspaces,
rounding), added to every plan's prediction.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gputrain.tools.plan.workload import Workload

PROBE_SIDE = 128
"""On a CPU, a run whose images are larger than this is timed mostly at this side (:func:`timed_at`): its steps at
the plan's batches, which give the part of a step that no sample adds, and checkpointing's extra cost; one step at
the run's own size (the smallest batch) then gives the per-sample time. A ResNet-50 step at 1024x1024 takes 10-60 s
on 2 cores, and time is not linear in pixels there (docs/plan.md: benchmarks/plan_probe.py)."""

LONG_STEP_S = 2.0
"""A warm-up step longer than this is followed by one timed step, not ``repeats``."""


@dataclass(frozen=True)
class Probe:
    batch_size: int
    step_s: float
    """Median seconds of one training step at ``batch_size``."""
    cuda_peak_bytes: int | None
    """``torch.cuda.max_memory_allocated`` during a step (None on a CPU)."""
    fixed_s: float = 0.0
    """What a step costs whatever its batch (launches, the optimizer), from a second probe at twice the batch."""

    @property
    def per_sample_s(self) -> float:
        return (self.step_s - self.fixed_s) / self.batch_size

    def step_at(self, samples: float) -> float:
        return self.fixed_s + self.per_sample_s * samples

    def at_pixels(self, ratio: float) -> Probe:
        """This probe scaled to samples of ``ratio`` times the pixels (the per-sample part only). Not what the plan
        uses: on a CPU a step is not linear in pixels at large sizes (benchmarks/plan_probe.py keeps it to show it)."""
        return Probe(self.batch_size, self.fixed_s + (self.step_s - self.fixed_s) * ratio, self.cuda_peak_bytes,
                     self.fixed_s)

    def with_step_at_size(self, step: Probe) -> Probe:
        """This probe's fixed part (what a step costs whatever its batch and image size: the optimizer, launches),
        with the per-sample time of ``step``, measured at the run's own image size."""
        fixed = min(self.fixed_s, step.step_s)
        return Probe(step.batch_size, step.step_s, step.cuda_peak_bytes, fixed)

    def scaled(self, factor: float) -> Probe:
        """The same probe for a step ``factor`` times as long (activation checkpointing's recomputed forward)."""
        return Probe(self.batch_size, self.step_s * factor, self.cuda_peak_bytes, self.fixed_s * factor)


def timed_at(work: Workload) -> tuple[Workload, float]:
    """The workload whose steps are timed, and how many times the run's pixels per sample exceed its own.

    On a CPU, a run with ``data.image_size`` above :data:`PROBE_SIDE` is timed on the same recipe at that side, when
    its inputs are one image tensor whose size follows ``data.image_size`` (a detection model resizes its inputs
    itself, so it is timed as it runs). Elsewhere: the run itself, ratio 1. The plan's notes say which.
    """
    side = work.cfg.data.image_size
    if work.device.type != "cpu" or not side or side <= PROBE_SIDE:
        return work, 1.0
    data = dataclasses.replace(work.cfg.data, image_size=PROBE_SIDE)
    small = Workload.from_config(dataclasses.replace(work.cfg, data=data), work.device, work.precision)
    full_x, small_x = work.batch(1)[0], small.batch(1)[0]
    if not (isinstance(full_x, torch.Tensor) and isinstance(small_x, torch.Tensor) and full_x.dim() == 4
            and full_x.shape[:2] == small_x.shape[:2] and full_x[0, 0].numel() > small_x[0, 0].numel()):
        return work, 1.0
    ratio = full_x[0, 0].numel() / small_x[0, 0].numel()
    work.notes.add(f"step time from one step at {full_x.shape[-2]}x{full_x.shape[-1]} px, its fixed part and "
                   f"activation checkpointing's cost from steps at {small_x.shape[-2]}x{small_x.shape[-1]} "
                   "(a CPU probe, docs/plan.md)")
    return dataclasses.replace(small, notes=work.notes), ratio


def measure_steps(work: Workload, batch_size: int) -> Probe:
    """Steps at ``batch_size`` and at twice it: a step's time is taken as affine in its batch."""
    small, large = measure_step(work, batch_size), measure_step(work, 2 * batch_size)
    per_sample = max(large.step_s - small.step_s, 0.0) / batch_size
    fixed = min(max(small.step_s - per_sample * batch_size, 0.0), small.step_s)
    return Probe(batch_size, small.step_s, small.cuda_peak_bytes, fixed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _cudnn_benchmark(on: bool) -> Iterator[None]:
    """cuDNN's autotuner as the run sets it, for the probe's steps alone (the caller's setting is put back)."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def measure_step(work: Workload, batch_size: int, repeats: int = 3) -> Probe:
    """Time real training steps of a copy of the model at ``batch_size`` (the user's model is left untouched).

    On CUDA the steps run with the run's memory format and cuDNN autotuner, and the peak counts from the first
    step, as the run's ``memory.json`` does: the autotuner tries each convolution's kernels, workspaces and all,
    there. (A probe without them predicted the autoencoder's peak 30% low on an H200, 2026-11-29.)
    """
    from gputrain.strategies.base import move_to_device

    device = work.device
    cuda = device.type == "cuda"
    model = copy.deepcopy(work.model)
    autotune: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if cuda:
        from gputrain.config.resolve import Facts, resolve_run
        from gputrain.engine.fast import prepare_model

        fast = resolve_run(work.cfg, Facts(device=device, fixed_shapes=work.task.fixed_shapes))[1]
        model = prepare_model(model, fast)
        autotune = _cudnn_benchmark(fast.cudnn_benchmark)
    model = model.to(device).train()
    optimizer = work.optimizer(model)
    inputs, targets = move_to_device(work.batch(batch_size), device)
    with torch.random.fork_rng(devices=[device] if cuda else []), autotune:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        work.train_step(model, optimizer, inputs, targets)  # warm-up: kernels chosen, optimizer state made
        _sync(device)
        if time.perf_counter() - start > LONG_STEP_S:
            repeats = 1  # a step of seconds (a large input on a CPU): its noise is small against it
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work.train_step(model, optimizer, inputs, targets)
            _sync(device)
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
    del model, optimizer
    return Probe(batch_size, statistics.median(times), peak)


@dataclass(frozen=True)
class BlockShares:
    names: list[str]
    time: list[float]
    """Each block's share of a forward+backward (they sum to 1)."""
    output_bytes_per_sample: list[float]
    """What a stage ending at the block sends to the next, per sample."""


def block_shares(work: Workload, batch_size: int, repeats: int = 2) -> BlockShares:
    """Each block's share of a forward+backward, measured by the partitioner's profiler at ``batch_size``."""
    from gputrain.parallel.blocks import sequential_blocks
    from gputrain.parallel.profile import profile_blocks
    from gputrain.strategies.base import move_to_device

    model = copy.deepcopy(work.model).to(work.device)
    blocks = sequential_blocks(model, children_in_order=bool(work.split_points))
    inputs, _ = move_to_device(work.batch(batch_size), work.device)
    with torch.random.fork_rng(devices=[work.device] if work.device.type == "cuda" else []), work.autocast():
        costs = profile_blocks(blocks, inputs, device=work.device, repeats=repeats)
    total = sum(c.forward_backward_s for c in costs) or 1.0
    return BlockShares([c.name for c in costs], [c.forward_backward_s / total for c in costs],
                       [c.output_bytes / batch_size for c in costs])


LINK_BYTES_PER_S = {"cpu": 2e9, "cuda": 100e9}
"""What collectives move per second between the devices of one node: gloo over a host's loopback, about 2 GB/s
measured on this project's CPU machines; NVLink-class GPUs, a conservative 100 GB/s (PCIe-only GPUs get about a
fifth). The one figure planning assumes rather than measures (docs/plan.md)."""


def allreduce_s(nbytes: float, world_size: int, device_type: str) -> float:
    """A ring all-reduce of ``nbytes``: each device sends and receives 2 (N - 1) / N of it."""
    if world_size < 2:
        return 0.0
    return 2 * (world_size - 1) / world_size * nbytes / LINK_BYTES_PER_S.get(device_type, 2e9)


def send_s(nbytes: float, device_type: str) -> float:
    return nbytes / LINK_BYTES_PER_S.get(device_type, 2e9)
