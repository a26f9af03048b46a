"""The plans that apply to N devices, each with its predicted memory per device and step time, and the choice.

Every plan trains the same global batch ``G`` (what the recipe trains as configured), so any of them computes
what the others would: ``single`` takes all of it, ``ddp`` and ``fsdp`` ``G / N`` per rank, ``pipeline`` (GPipe and
1F1B, one process per stage) and ``model_parallel`` (one process, one stage per device) cut it into micro-batches.
Memory is counted on fake tensors (:mod:`gputrain.tools.plan.memory`); time is a measured step scaled by the
plan's samples per device, stage shares from the block profile, plus the collectives' bytes over the link.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gputrain.parallel.partition import format_bytes
from gputrain.tools.plan import memory, split_memory
from gputrain.tools.plan.memory import StepMemory
from gputrain.tools.plan.timing import BlockShares, Probe, allreduce_s, send_s
from gputrain.tools.plan.workload import Workload

MARGIN = 0.10
"""A plan is chosen only when its predicted peak stays this far under the budget: the accuracy the plan is tested to."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket: the last one's all-reduce cannot overlap the backward."""


@dataclass(frozen=True)
class Plan:
    strategy: str
    devices: int
    global_batch: int
    batch_size: int
    """trainer.batch_size of this plan: per process for ddp and fsdp, the whole batch otherwise."""
    per_device: tuple[StepMemory, ...]
    step_s: float
    budget: int
    micro_batches: int = 1
    schedule: str = ""
    split_points: tuple[str, ...] = ()
    max_global_batch: int = 0
    """The largest global batch predicted to fit the budget with the margin (0: none; -1: not asked for, as
    ``--strategy auto`` does not)."""
    activation_checkpointing: bool = False
    nodes: int = 1
    """Nodes the plan's ``devices`` are spread over (ddp and fsdp; the others run on one node)."""

    @property
    def peak(self) -> int:
        return max(m.peak for m in self.per_device)

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    @property
    def fits_with_margin(self) -> bool:
        return self.peak <= self.budget * (1 - MARGIN)

    @property
    def images_per_s(self) -> float:
        return self.global_batch / self.step_s if self.step_s > 0 else 0.0

    @property
    def label(self) -> str:
        name = f"{self.strategy}-{self.schedule}" if self.strategy == "pipeline" else self.strategy
        return f"{name}+ac" if self.activation_checkpointing else name

    def overrides(self) -> list[str]:
        """The config values that train this plan."""
        # trainer.devices counts the devices of one node; the plan's devices are the job's (launch.nnodes nodes)
        out = [f"trainer.strategy={self.strategy}", f"trainer.batch_size={self.batch_size}",
               f"trainer.devices={self.devices // self.nodes}"]
        if self.strategy in ("pipeline", "model_parallel"):
            out += [f"parallel.micro_batches={self.micro_batches}", f"parallel.stages={self.devices}",
                    f"parallel.split_points=[{','.join(self.split_points)}]"]
            if self.schedule:
                out.append(f"parallel.schedule={self.schedule}")
        if self.activation_checkpointing:
            out.append("trainer.activation_checkpointing=true")
        return out

    def predictions(self) -> list[str]:
        """The config values that hand this plan's predictions to the run that trains it (the closed loop: the run
        sets its first steps' pace and measured memory against them)."""
        return [f"trainer.predicted_step_s={self.step_s:.6g}",
                f"trainer.predicted_peak_bytes=[{','.join(str(m.peak) for m in self.per_device)}]"]

    def as_json(self) -> dict[str, Any]:
        worst = max(self.per_device, key=lambda m: m.peak)
        return {"label": self.label, "strategy": self.strategy, "devices": self.devices, "batch_size": self.batch_size,
                "global_batch": self.global_batch, "micro_batches": self.micro_batches,
                "schedule": self.schedule or None, "split_points": list(self.split_points),
                "activation_checkpointing": self.activation_checkpointing, "peak_memory_bytes": self.peak,
                "per_device_memory_bytes": [m.peak for m in self.per_device], "memory_parts": worst.as_dict(),
                "step_s": self.step_s, "images_per_s": self.images_per_s, "fits": self.fits_with_margin,
                "within_budget": self.fits,
                "max_global_batch": self.max_global_batch, "overrides": self.overrides(),
                "predictions": self.predictions()}


def _per_process(processes: int, largest: int) -> int:
    """A data-parallel plan's largest global batch from one process's (-1, not asked for, stays -1)."""
    return processes * largest if largest >= 0 else -1


@dataclass
class Planner:
    work: Workload
    devices: int
    global_batch: int
    budget: int
    probe: Probe
    """A measured whole-model step on this device."""
    shares: BlockShares | None
    """Per-block time shares and boundary sizes (None: the model has no chain of blocks; no split plans)."""
    micro_batches: int
    fsdp_units: Sequence[str] = ()
    cuda_overhead: int = 0
    """Bytes the CUDA allocator holds beyond the counted tensors (measured by the probe step)."""
    largest: bool = True
    """Whether to find each plan's largest batch (a second count at twice the batch); else it is -1."""
    nodes: int = 1
    """The nodes ``devices`` are spread over."""
    ema: bool = False
    """Whether the run keeps an EMA of the weights (``trainer.ema_decay``): a copy of each device's share of them."""

    def _largest(self, at: int, low: Sequence[StepMemory], high: Callable[[], Sequence[StepMemory]],
                 ema_share: float = 1.0) -> int:
        """The largest batch (per process, as ``at``) whose every device fits the budget with the margin, from each
        device's counts at ``at`` (``low``) and ``2 at`` (``high()``, counted only here):
        :func:`~gputrain.tools.plan.memory.largest_batch`. -1 when not asked for (:attr:`largest`)."""
        if not self.largest:
            return -1
        room = self.budget * (1 - MARGIN)
        return min(memory.largest_batch(a, self._with_overhead(b, ema_share), at, room)
                   for a, b in zip(low, high(), strict=True))

    @property
    def device_type(self) -> str:
        return self.work.device.type

    def _with_overhead(self, parts: StepMemory, ema_share: float = 1.0) -> StepMemory:
        """``parts`` with what the count of a step leaves out: the CUDA allocator's own bytes (``other``), and with an
        EMA its copy of ``ema_share`` of the parameters and of every buffer (``parameters``, as a run counts it)."""
        if self.cuda_overhead:
            parts = parts.plus(other=self.cuda_overhead)
        if self.ema:
            model = self.work.model
            parts = parts.plus(parameters=int(ema_share * sum(p.numel() * p.element_size() for p in model.parameters()))
                               + sum(b.numel() * b.element_size() for b in model.buffers()))
        return parts

    def _compute_s(self, samples_per_device: float) -> float:
        # CPU "devices" are processes sharing one set of cores: the machine does all G samples' work either way.
        samples = self.global_batch if self.device_type == "cpu" else samples_per_device
        return self.probe.step_at(samples)

    def _grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.work.model.parameters() if p.requires_grad)

    def single(self) -> Plan:
        g = self.global_batch
        mem = self._with_overhead(memory.step_memory(self.work, g))
        largest = self._largest(g, [mem], lambda: [memory.step_memory(self.work, 2 * g)])
        return Plan("single", 1, g, g, (mem,), self._compute_s(g), self.budget, max_global_batch=largest)

    def ddp(self) -> Plan:
        n, b = self.devices, self.global_batch // self.devices
        buckets = self._grad_bytes()
        # The gradients are views into DDP's buckets: all of them allocated for the whole step.
        mem = self._with_overhead(memory.step_memory(self.work, b, held_gradients=True))
        compute = self._compute_s(b)
        comm = allreduce_s(buckets, n, self.device_type)
        exposed = max(allreduce_s(min(buckets, DDP_BUCKET_BYTES), n, self.device_type), comm - compute * 2 / 3)
        largest = _per_process(n, self._largest(b, [mem], lambda: [memory.step_memory(self.work, 2 * b,
                                                                                       held_gradients=True)]))
        return Plan("ddp", n, self.global_batch, b, (mem,) * n, compute + exposed, self.budget,
                    max_global_batch=largest, nodes=self.nodes)

    def fsdp(self) -> Plan:
        n, b = self.devices, self.global_batch // self.devices

        def at(k: int) -> StepMemory:
            return split_memory.fsdp_memory(self.work, k, n, self.fsdp_units)

        mem = self._with_overhead(at(b), 1 / n)  # the EMA of this rank's shards only
        compute = self._compute_s(b)
        # Parameters all-gathered for the forward and again for the backward, gradients reduce-scattered: each
        # moves (N - 1) / N of the model, 1.5 all-reduces' worth; units overlap with compute except the first.
        comm = 1.5 * allreduce_s(self._grad_bytes(), n, self.device_type)
        exposed = max(comm / (len(self.fsdp_units) + 1), comm - compute)
        largest = _per_process(n, self._largest(b, [mem], lambda: [at(2 * b)], 1 / n))
        return Plan("fsdp", n, self.global_batch, b, (mem,) * n, compute + exposed, self.budget,
                    max_global_batch=largest, nodes=self.nodes)

    def _stage_memory(self, strategy: str, schedule: str, split: Sequence[int], batch: int) -> list[StepMemory]:
        """Each stage's device at ``batch`` (model_parallel's micro-batches run as GPipe's)."""
        if self.device_type == "cpu" and strategy == "model_parallel":
            # Every stage is on the one CPU: one process holding all of them, the whole batch's activations alive.
            return [memory.step_memory(self.work, batch)]
        stages = [split_memory.stage_memory(self.work, split, s, batch_size=batch, micro_batches=self.micro_batches,
                                      schedule=schedule or "gpipe") for s in range(self.devices)]
        if self.device_type == "cpu":  # a pipeline rank keeps the whole model object on the CPU, other stages too
            whole = sum(p.numel() * p.element_size() for p in self.work.model.parameters())
            stages = [s.plus(parameters=whole - s.parameters) for s in stages]
        return stages

    def split(self, strategy: str, schedule: str, split: Sequence[int]) -> Plan:
        """pipeline (``schedule`` gpipe or 1f1b) or model_parallel (``schedule`` empty)."""
        assert self.shares is not None
        k, m, g = self.devices, self.micro_batches, self.global_batch
        stages = self._stage_memory(strategy, schedule, split, g)
        share = 1 / len(stages)  # an EMA per stage: about its share of the weights (one CPU process: all of them)
        per_stage = [self._with_overhead(s, share) for s in stages]
        micro = g / m
        if self.device_type == "cpu":
            step = self._compute_s(g)
        else:
            bounds = [0, *split, len(self.shares.time)]
            stage_s = [self.probe.step_at(micro) * sum(self.shares.time[a:b])
                       for a, b in zip(bounds, bounds[1:], strict=False)]
            step = sum(stage_s) + (m - 1) * max(stage_s)  # fill and drain, then the slowest stage's pace
            boundary = sum(self.shares.output_bytes_per_sample[i - 1] for i in split) * micro
            step += 2 * m * send_s(boundary, self.device_type)  # activations forward, their gradients back
        largest = self._largest(g, per_stage, lambda: self._stage_memory(strategy, schedule, split, 2 * g), share)
        return Plan(strategy, k, g, g, tuple(per_stage), step, self.budget, micro_batches=m, schedule=schedule,
                    split_points=tuple(self.shares.names[i] for i in split), max_global_batch=largest)


def choose(plans: Sequence[Plan]) -> Plan | None:
    """The fastest plan predicted to fit with the margin; ties go to fewer devices, then to the list's order."""
    fitting = [p for p in plans if p.fits_with_margin]
    return min(fitting, key=lambda p: (round(p.step_s, 9), p.devices)) if fitting else None


def fits_cell(plan: Plan) -> str:
    """The table's ``fits`` column, by the rule the choice uses (the margin): ``yes`` only for a plan it may choose."""
    if plan.fits_with_margin:
        return "yes"
    return f"no ({MARGIN:.0%} margin)" if plan.fits else "NO"


def why(chosen: Plan, plans: Sequence[Plan]) -> str:
    """One line: why this plan."""
    faster = [p for p in plans if p.step_s < chosen.step_s and p is not chosen]
    reason = (f"the fastest of {sum(p.fits_with_margin for p in plans)} plans that fit"
              if not faster else f"faster plans ({', '.join(p.label for p in faster)}) do not fit")
    return (f"{chosen.label}: {reason} (predicted peak {format_bytes(chosen.peak)} per device of "
            f"{format_bytes(chosen.budget)}, keeping a {MARGIN:.0%} margin; {chosen.images_per_s:.1f} images/s)")


def micro_batch_count(requested: int, stages: int, global_batch: int, has_batchnorm: bool) -> int:
    """The recipe's micro-batches when it sets more than one, else two per stage; never micro-batches of one sample
    under BatchNorm, never more than the batch."""
    m = requested if requested > 1 else 2 * stages
    smallest = 2 if has_batchnorm else 1
    return max(1, min(m, global_batch // smallest))

