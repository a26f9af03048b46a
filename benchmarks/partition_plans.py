"""2-stage partitions by measured cost vs by parameter count, predicted and measured (issue 8, item 3).

For ResNet-50 (torchvision, 1000 classes) and DeepLabv3+ (ResNet-50, output stride 16): profile every
block (``profile_blocks``), choose the 2-stage plan by measured forward+backward time and by
parameter count (DeepSpeed's ``partition_method="parameters"``), print both side by side, then run
each plan as a naive two-stage split in this process and time every stage's forward+backward as a
pipeline stage does it (stage 1 forward, stage 2 forward, loss and backward, stage 1 backward with
the gradient stage 2 returned). Plans are interleaved (A B A B ...) after one warm-up each; the
medians of ``--pairs`` runs are reported, with CPU time beside wall time, at 1 thread (see
docs/platform-notes). A pipeline runs at the pace of its slowest stage, so the figure of merit is
the slowest stage's time, and the ratio params-plan / measured-plan of it (above 1: measured wins).
On a machine shared with other work, ``--clock cpu`` profiles with CPU time, and predictions are then
compared with measured CPU time.

    python benchmarks/partition_plans.py --json runs/bench/partition_plans.json
    python benchmarks/partition_plans.py --stages 2,3 --clock cpu     # as in docs/partitioning.md
    python benchmarks/partition_plans.py --models resnet50 --size 160 --batch 4 --pairs 3   # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gputrain.models import build_model
from gputrain.parallel import (
    PipelinePlan,
    format_plan,
    plan_from_costs,
    profile_blocks,
    sequential_blocks,
    split_stages,
)


def _tensors(state: object) -> list[torch.Tensor]:
    return [state] if isinstance(state, torch.Tensor) else [t for t in state if isinstance(t, torch.Tensor)]


def _received(state: object) -> tuple[torch.Tensor, ...]:
    """What the next stage receives: detached copies, floats requiring a gradient (as pipelining does)."""
    return tuple(t.detach().requires_grad_(t.is_floating_point()) for t in _tensors(state))


def time_stages(
    stages: Sequence[nn.Module], x: torch.Tensor, target: torch.Tensor
) -> list[tuple[float, float]]:
    """(wall, cpu) seconds of each stage's forward+backward in one step of a naive split."""
    for stage in stages:
        for p in stage.parameters():
            p.grad = None
    fwd: list[tuple[float, float]] = []
    inputs, outputs = [], []
    state: tuple[torch.Tensor, ...] = (x,)
    for i, stage in enumerate(stages):
        w, c = time.perf_counter(), time.process_time()
        out = stage(*state)
        if i == len(stages) - 1:
            out = F.mse_loss(out, target)
        fwd.append((time.perf_counter() - w, time.process_time() - c))
        inputs.append(state)
        outputs.append(out)
        state = _received(out)
    spent = []
    grads: list[torch.Tensor] | None = None
    for i in reversed(range(len(stages))):
        w, c = time.perf_counter(), time.process_time()
        outs = [t for t in _tensors(outputs[i]) if t.requires_grad]
        torch.autograd.backward(outs, grads)
        grads = [t.grad for t in inputs[i] if t.requires_grad]
        spent.append((time.perf_counter() - w + fwd[i][0], time.process_time() - c + fwd[i][1]))
    return spent[::-1]


def measure(model: nn.Module, plans: Sequence[PipelinePlan], x: torch.Tensor, pairs: int) -> list[dict]:
    """Median (wall, cpu) per stage of each plan, interleaved; a plan equal to an earlier one is reused."""
    blocks = sequential_blocks(model)
    with torch.no_grad():
        target = torch.randn_like(model.eval()(x))  # regression to noise: the loss costs nothing here
    model.train()
    unique = list(dict.fromkeys(p.split_indices for p in plans))
    stages = {s: split_stages(blocks, s) for s in unique}
    runs: dict[tuple[int, ...], list[list[tuple[float, float]]]] = {s: [] for s in unique}
    for rep in range(pairs + 1):
        for s in unique:
            result = time_stages(stages[s], x, target)
            if rep:  # the first round warms up
                runs[s].append(result)
    out = []
    for plan in plans:
        per_run = runs[plan.split_indices]
        wall = [statistics.median(r[k][0] for r in per_run) for k in range(len(plan.stages))]
        cpu = [statistics.median(r[k][1] for r in per_run) for k in range(len(plan.stages))]
        slowest_wall = [max(r[k][0] for k in range(len(plan.stages))) for r in per_run]
        slowest_cpu = [max(r[k][1] for k in range(len(plan.stages))) for r in per_run]
        out.append({"wall": wall, "cpu": cpu, "slowest_wall": slowest_wall, "slowest_cpu": slowest_cpu})
    return out


def _blocks(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)})"


def _row(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    return " | ".join(fmt.format(v) for v in values)


def compare_plans(
    costs: Sequence, model: nn.Module, x: torch.Tensor, stages: int, args: argparse.Namespace
) -> dict:
    """Both plans for ``stages`` stages: printed, measured, and summarised."""
    m = args.micro_batches
    plans = [plan_from_costs(costs, stages, partition=p, micro_batches=m) for p in ("measured", "params")]
    print(
        f"-- {stages} stages (plans printed for {m} micro-batches; the measurement below runs the naive split):"
    )
    for plan in plans:
        print(format_plan(plan))
    results = measure(model, plans, x, args.pairs)
    print(
        f"{'plan':<9} {'blocks per stage':<40} {'params (M)':<18} {'predicted (s)':<20} measured (s), wall / cpu"
    )
    for plan, r in zip(plans, results, strict=True):
        print(
            f"{plan.method:<9} {' | '.join(_blocks(st.blocks) for st in plan.stages):<40} "
            f"{_row([st.params / 1e6 for st in plan.stages], '{:.1f}'):<18} "
            f"{_row([st.time_s for st in plan.stages]):<20} {_row(r['wall'])} / {_row(r['cpu'])}"
        )
    ratios = {
        kind: statistics.median(
            p / q for p, q in zip(results[1][f"slowest_{kind}"], results[0][f"slowest_{kind}"], strict=True)
        )
        for kind in ("wall", "cpu")
    }
    clock = args.clock  # compare the prediction with a measurement on the profile's own clock
    for plan, r in zip(plans, results, strict=True):
        slowest = statistics.median(r[f"slowest_{clock}"])
        piped = (sum(r[clock]) + (m - 1) * max(r[clock])) / m
        print(
            f"  {plan.method}: slowest stage predicted {plan.slowest_stage_s:.2f} s, measured {slowest:.2f} s {clock} "
            f"(x{slowest / plan.slowest_stage_s:.2f}); step at {m} micro-batches from measured stages {piped:.2f} s"
        )
    same = plans[0].split_indices == plans[1].split_indices
    print(
        f"  slowest stage, params plan / measured plan: {ratios['wall']:.2f} wall, {ratios['cpu']:.2f} cpu "
        f"(median of {args.pairs} per-pair ratios){'; the plans agree' if same else ''}"
    )
    return {
        "stages": stages,
        "plans": [
            {
                "method": p.method,
                "blocks": [list(st.blocks) for st in p.stages],
                "predicted_s": [st.time_s for st in p.stages],
                **r,
            }
            for p, r in zip(plans, results, strict=True)
        ],
        "ratio_params_over_measured": ratios,
    }


def compare(label: str, model: nn.Module, x: torch.Tensor, args: argparse.Namespace) -> dict:
    blocks = sequential_blocks(model)
    costs = profile_blocks(blocks, x, device="cpu", optimizer="sgd", repeats=args.repeats, clock=args.clock)
    print(
        f"\n== {label}: input {tuple(x.shape)}, 1 thread; profile ({args.clock} clock, median of {args.repeats}):"
    )
    for c in costs:
        print(f"   {c.name:<10} {c.forward_backward_s * 1e3:8.1f} ms  {c.params / 1e6:6.2f} M params")
    splits = [compare_plans(costs, model, x, int(k), args) for k in args.stages.split(",")]
    return {"model": label, "input": list(x.shape), "costs": [c.__dict__ for c in costs], "splits": splits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,deeplabv3plus")
    parser.add_argument("--size", type=int, default=224, help="ResNet-50 input side")
    parser.add_argument("--batch", type=int, default=8, help="ResNet-50 batch")
    parser.add_argument("--seg-size", type=int, default=224, help="DeepLabv3+ input side")
    parser.add_argument("--seg-batch", type=int, default=4, help="DeepLabv3+ batch")
    parser.add_argument("--stages", default="2", help="stage counts to compare, e.g. 2,3")
    parser.add_argument("--micro-batches", type=int, default=8, help="for the printed plans' step time")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="profile_blocks' clock")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved measured runs per plan")
    parser.add_argument("--repeats", type=int, default=3, help="profile repeats per block")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    started = time.perf_counter()
    report = []
    for name in args.models.split(","):
        if name == "resnet50":
            model, x = (
                build_model("resnet50", num_classes=1000),
                torch.rand(args.batch, 3, args.size, args.size),
            )
            label = "ResNet-50"
        elif name == "deeplabv3plus":
            model = build_model("deeplabv3plus", num_classes=21, backbone="resnet50")
            x, label = (
                torch.rand(args.seg_batch, 3, args.seg_size, args.seg_size),
                "DeepLabv3+ (ResNet-50, OS 16)",
            )
        else:
            raise SystemExit(f"--models: {name!r} is unknown; choose resnet50, deeplabv3plus")
        report.append(compare(label, model.train(), x, args))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
