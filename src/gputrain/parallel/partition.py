"""Choose contiguous pipeline stages from per-block costs: pure arithmetic, no torch.

A partition of ``n`` blocks into ``K`` stages is given by its *split indices*: the ``K - 1`` block
indices that start stages 2..K (``[2]`` cuts ``[a, b, c, d]`` into ``[a, b] | [c, d]``). Costs are
lists of floats, one per block, in any time unit; memory is in bytes. :mod:`gputrain.parallel.plan`
turns a partition of measured costs into a plan with predicted time and memory per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

StageCost = Callable[[int, int, int], float]
"""``cost(stage, first, stop)``: the cost of blocks ``first..stop-1`` as stage ``stage`` (0-based)."""

_REL_TOL = 1e-9


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``; binary units, as GPU memory is quoted."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _check(n_blocks: int, n_stages: int) -> None:
    if not 1 <= n_stages <= n_blocks:
        raise ValueError(f"cannot cut {n_blocks} blocks into {n_stages} stages; use 1 to {n_blocks} stages")


def _sums(values: Sequence[float]) -> Callable[[int, int], float]:
    """``total(first, stop)`` = ``sum(values[first:stop])`` in O(1), from prefix sums."""
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + float(v))
    return lambda first, stop: prefix[stop] - prefix[first]


def _solve(n: int, n_stages: int, cost: StageCost, fits: StageCost | None = None) -> list[int] | None:
    """Split indices minimising the largest stage ``cost``, the most even among ties.

    Exact dynamic programming over contiguous partitions, O(K n^2) for K stages of n blocks. A first
    pass finds the best bottleneck T; a second, over stages no costlier than T, minimises the sum of
    squared stage costs, so ties go to the most even partition. Stages with ``fits(...) > 0`` are
    not allowed; None when no partition is left.
    """
    inf = float("inf")

    def run(combine: Callable[[float, float], float], cap: float) -> list[int] | None:
        best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
        back = [[0] * (n + 1) for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, n_stages + 1):
            for stop in range(s, n - (n_stages - s) + 1):
                for first in range(s - 1, stop):
                    c = cost(s - 1, first, stop)
                    if best[s - 1][first] == inf or c > cap or (fits and fits(s - 1, first, stop) > 0):
                        continue
                    value = combine(best[s - 1][first], c)
                    if value < best[s][stop]:
                        best[s][stop], back[s][stop] = value, first
        if best[n_stages][n] == inf:
            return None
        splits = [n]
        for s in range(n_stages, 1, -1):
            splits.append(back[s][splits[-1]])
        return splits[:0:-1]

    fastest = run(max, inf)
    if fastest is None:
        return None
    bottleneck = max(cost(s, a, b) for s, (a, b) in enumerate(stage_bounds(fastest, n)))
    return run(lambda acc, c: acc + c * c, bottleneck + _REL_TOL * max(abs(bottleneck), 1.0)) or fastest


def stage_bounds(split: Sequence[int], n: int) -> list[tuple[int, int]]:
    """``[2]``, 4 -> ``[(0, 2), (2, 4)]``: each stage's first and stop block index."""
    edges = [0, *split, n]
    return list(zip(edges, edges[1:], strict=False))


def partition_by_cost(
    costs: Sequence[float],
    n_stages: int,
    memory: Sequence[float] | None = None,
    memory_caps: Sequence[float] | None = None,
    *,
    activation: Sequence[float] | None = None,
    activation_scale: Sequence[float] | None = None,
    names: Sequence[str] | None = None,
) -> list[int]:
    """Split indices minimising the slowest stage's total ``costs``, each stage's memory within its cap.

    A stage's memory is ``sum(memory) + activation_scale[stage] * sum(activation)`` over its blocks:
    give static bytes (parameters, gradients, optimizer) as ``memory`` and one batch's saved bytes as
    ``activation``, with :func:`activation_scale` for the schedule, or everything in ``memory``.
    ``memory_caps`` holds one cap per stage, or one for all. Among equally slow partitions the most
    even one wins. When none fits, raises ValueError naming the stage closest to fitting, its
    memory and cap, and the smallest cap (or more stages) that would fit.
    """
    n = len(costs)
    _check(n, n_stages)
    for label, values in (("memory", memory), ("activation", activation)):
        if values is not None and len(values) != n:
            raise ValueError(f"{label} has {len(values)} values for {n} blocks; give one per block")
    caps = [float("inf")] * n_stages if memory_caps is None else [float(c) for c in memory_caps]
    caps = caps * n_stages if len(caps) == 1 else caps
    scale = [1.0] * n_stages if activation_scale is None else list(activation_scale)
    if len(caps) != n_stages or len(scale) != n_stages or min(caps) <= 0:
        raise ValueError(
            f"memory_caps ({caps}) and activation_scale need {n_stages} values (or 1 cap), caps > 0"
        )
    static, act, time = _sums(memory or [0.0] * n), _sums(activation or [0.0] * n), _sums(costs)

    def stage_memory(s: int, first: int, stop: int) -> float:
        return static(first, stop) + scale[s] * act(first, stop)

    split = _solve(n, n_stages, lambda s, a, b: time(a, b), lambda s, a, b: stage_memory(s, a, b) - caps[s])
    if split is not None:
        return split
    # Nothing fits: find the partition with the lowest worst memory/cap ratio and say what it lacks.
    closest = _solve(n, n_stages, lambda s, a, b: stage_memory(s, a, b) / caps[s])
    assert closest is not None
    ratios = [stage_memory(s, a, b) / caps[s] for s, (a, b) in enumerate(stage_bounds(closest, n))]
    worst = max(range(n_stages), key=ratios.__getitem__)
    a, b = stage_bounds(closest, n)[worst]
    labels = [str(i) for i in range(n)] if names is None else list(names)
    need = stage_memory(worst, a, b)
    fix = f"a cap of {format_bytes(need)} per stage would fit"
    if len(set(caps)) > 1:
        fix = f"caps {ratios[worst]:.2f}x as large would fit"
    alone = [i for i in range(n) if all(stage_memory(s, i, i + 1) > caps[s] for s in range(n_stages))]
    if alone:
        fix += f" (block {labels[alone[0]]} alone exceeds every cap: lower the batch or the precision)"
    elif n_stages < n:
        fix += ", or use more stages"
    span = labels[a] if b - a == 1 else f"{labels[a]}..{labels[b - 1]}"
    raise ValueError(
        f"no {n_stages}-stage split fits the memory caps: at best stage {worst + 1} ({span}) needs "
        f"{format_bytes(need)} but its cap is {format_bytes(caps[worst])}; {fix}"
    )


def partition_by_params(params: Sequence[int], n_stages: int) -> list[int]:
    """Split indices balancing parameter counts, as DeepSpeed's ``partition_method="parameters"`` does.

    Kept for comparison: in a CNN, compute follows feature-map size, not parameter count, so this
    puts the few wide late layers alone on a stage (see docs/partitioning.md).
    """
    _check(len(params), n_stages)
    total = _sums(params)
    split = _solve(len(params), n_stages, lambda s, a, b: total(a, b))
    assert split is not None  # no constraint: some partition always exists
    return split


def plan_from_split_points(
    names: Sequence[str], split_points: Sequence[str], *, field: str = "parallel.split_points"
) -> list[int]:
    """Split indices from hand-given block names that start stages 2..K (``field`` names the setting)."""
    index = {name: i for i, name in enumerate(names)}
    valid = ", ".join(names)
    splits: list[int] = []
    for k, point in enumerate(split_points):
        if point not in index:
            raise ValueError(f"{field}[{k}]={point!r} is not a block; valid names in order: {valid}")
        if index[point] == 0:
            raise ValueError(
                f"{field}[{k}]={point!r} is the first block, so stage 1 would be empty; name a later block"
            )
        if splits and index[point] <= splits[-1]:
            raise ValueError(
                f"{field}[{k}]={point!r} does not come after {names[splits[-1]]!r}; give block names in model "
                f"order: {valid}"
            )
        splits.append(index[point])
    return splits
