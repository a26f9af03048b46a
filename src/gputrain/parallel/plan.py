"""A pipeline plan: contiguous stages of measured blocks with their predicted time and memory, and its table.

:func:`plan_from_costs` partitions measured :class:`~gputrain.parallel.profile.BlockCost` (by
:mod:`gputrain.parallel.partition`) into a :class:`PipelinePlan`; :func:`format_plan` prints it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gputrain.parallel.partition import (
    format_bytes,
    partition_by_cost,
    partition_by_params,
    plan_from_split_points,
    stage_bounds,
)

SCHEDULES = ("gpipe", "1f1b")
PARTITIONS = ("measured", "params")


def bubble(n_stages: int, micro_batches: int) -> float:
    """The idle fraction of a GPipe or 1F1B pipeline: (K - 1) / (M + K - 1)."""
    return (n_stages - 1) / (micro_batches + n_stages - 1)


def activation_scale(n_stages: int, micro_batches: int, schedule: str = "gpipe") -> list[float]:
    """Per stage, the fraction of one batch's saved activations held at that stage's peak.

    GPipe runs all M forwards before any backward: every stage holds M micro-batches of B/M, i.e. 1.
    1F1B starts backwards as soon as the last stage can: stage s (1-based) holds min(M, K - s + 1).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule={schedule!r} is unknown; choose one of {SCHEDULES}")
    if micro_batches < 1:
        raise ValueError(f"parallel.micro_batches={micro_batches} must be at least 1")
    if schedule == "gpipe":
        return [1.0] * n_stages
    return [min(micro_batches, n_stages - s) / micro_batches for s in range(n_stages)]


@dataclass(frozen=True)
class StagePlan:
    """One stage: its blocks and predicted figures for a full batch (split into the plan's micro-batches)."""

    blocks: tuple[str, ...]
    params: int
    time_s: float
    """Forward+backward of the whole batch through this stage (sum of its blocks)."""
    static_bytes: float
    """Parameters, gradients and optimizer state."""
    activation_bytes: float
    """Saved activations held at the stage's peak (scaled for the schedule)."""

    @property
    def memory_bytes(self) -> float:
        return self.static_bytes + self.activation_bytes


@dataclass(frozen=True)
class PipelinePlan:
    """Contiguous stages with predicted time and memory, and how they were chosen."""

    stages: tuple[StagePlan, ...]
    split_indices: tuple[int, ...]
    micro_batches: int = 1
    schedule: str = "gpipe"
    method: str = "measured"
    """measured, params or split_points."""

    @property
    def bubble(self) -> float:
        return bubble(len(self.stages), self.micro_batches)

    @property
    def slowest_stage_s(self) -> float:
        return max(stage.time_s for stage in self.stages)

    @property
    def step_time_s(self) -> float:
        """Fill and drain: one micro-batch through every stage, then M - 1 more at the slowest stage's pace.

        (sum_s t_s + (M - 1) max_s t_s) / M; with equal stages, (M + K - 1) t / M = t / (1 - bubble).
        Ignores transfers between stages; M = 1 is the naive split, the sum of the stages.
        """
        m = self.micro_batches
        return (sum(stage.time_s for stage in self.stages) + (m - 1) * self.slowest_stage_s) / m


class CostLike(Protocol):
    """What planning reads from :class:`~gputrain.parallel.profile.BlockCost`."""

    @property
    def name(self) -> str: ...
    @property
    def forward_backward_s(self) -> float: ...
    @property
    def params(self) -> int: ...
    @property
    def static_bytes(self) -> int: ...
    @property
    def activation_bytes(self) -> int: ...


def make_plan(
    costs: Sequence[CostLike],
    split_indices: Sequence[int],
    *,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    method: str = "measured",
) -> PipelinePlan:
    """The predicted plan of cutting ``costs`` (measured at the full batch) before ``split_indices``."""
    bounds = stage_bounds(split_indices, len(costs))
    scale = activation_scale(len(bounds), micro_batches, schedule)
    stages = tuple(
        StagePlan(
            blocks=tuple(c.name for c in costs[a:b]),
            params=sum(c.params for c in costs[a:b]),
            time_s=sum(c.forward_backward_s for c in costs[a:b]),
            static_bytes=sum(c.static_bytes for c in costs[a:b]),
            activation_bytes=scale[s] * sum(c.activation_bytes for c in costs[a:b]),
        )
        for s, (a, b) in enumerate(bounds)
    )
    return PipelinePlan(stages, tuple(split_indices), micro_batches, schedule, method)


def plan_from_costs(
    costs: Sequence[CostLike],
    n_stages: int,
    *,
    partition: str = "measured",
    split_points: Sequence[str] = (),
    memory_caps: Sequence[float] | None = None,
    micro_batches: int = 1,
    schedule: str = "gpipe",
) -> PipelinePlan:
    """The plan the settings of ``parallel`` (the config section) ask for: hand split points if given, else by
    measured cost under ``memory_caps`` (bytes), or by parameter count (which ignores memory)."""
    names = [c.name for c in costs]
    if split_points:
        if len(split_points) != n_stages - 1:
            raise ValueError(
                f"parallel.split_points has {len(split_points)} names for {n_stages} stages; "
                f"give {n_stages - 1} (the blocks that start stages 2..{n_stages})"
            )
        split, method = plan_from_split_points(names, split_points), "split_points"
    elif partition == "params":
        split, method = partition_by_params([c.params for c in costs], n_stages), partition
    elif partition == "measured":
        split = partition_by_cost(
            [c.forward_backward_s for c in costs],
            n_stages,
            [float(c.static_bytes) for c in costs],
            memory_caps,
            activation=[float(c.activation_bytes) for c in costs],
            activation_scale=activation_scale(n_stages, micro_batches, schedule),
            names=names,
        )
        method = partition
    else:
        raise ValueError(f"parallel.partition={partition!r} is unknown; choose one of {PARTITIONS}")
    return make_plan(costs, split, micro_batches=micro_batches, schedule=schedule, method=method)


def _blocks_label(blocks: Sequence[str], width: int = 40) -> str:
    text = ", ".join(blocks)
    return text if len(text) <= width else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)} blocks)"


def format_plan(plan: PipelinePlan) -> str:
    """A table of stages (blocks, parameters, time, memory), then the predicted bubble and step time."""
    rows = [("stage", "blocks", "params", "time", "memory")]
    rows += [
        (
            str(i),
            _blocks_label(st.blocks),
            f"{st.params / 1e6:.2f} M",
            f"{st.time_s * 1e3:.1f} ms",
            format_bytes(st.memory_bytes),
        )
        for i, st in enumerate(plan.stages, 1)
    ]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        "  ".join(
            x.ljust(w) if c == 1 else x.rjust(w) for c, (x, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    m = plan.micro_batches
    lines.append(
        f"{len(plan.stages)} stages by {plan.method}, {m} micro-batch{'es' if m != 1 else ''} ({plan.schedule}): "
        f"bubble {plan.bubble:.1%}, slowest stage {plan.slowest_stage_s * 1e3:.1f} ms, "
        f"predicted step {plan.step_time_s * 1e3:.1f} ms"
    )
    return "\n".join(lines)
