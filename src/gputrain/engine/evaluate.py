"""Exact evaluation: every validation sample once, on every rank's shard, metrics from reduced statistics."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gputrain.dist import comm
from gputrain.engine.fast import to_memory_format
from gputrain.engine.step import empty_like_batch, first_sample_batch
from gputrain.runs.records import strict_json
from gputrain.strategies.base import move_to_device

if TYPE_CHECKING:
    from gputrain.engine.setup import Loop


@torch.no_grad()
def evaluate_batches(loop: Loop, out: Path | None, epoch: int,
                     after_batch: Callable[[int, int], Any]) -> dict[str, float]:
    """Run the validation loader through the model and reduce the task's evaluator over ranks; ``out``: where an
    evaluator writes its predictions (detection's), None for none."""
    strategy, task = loop.strategy, loop.task
    assert loop.val_loader is not None
    model = strategy.eval_module(loop.module)
    model.eval()
    evaluator = task.evaluator()
    done, last_inputs, total = 0, None, len(loop.val_loader)
    most = total
    if strategy.eval_in_lockstep:
        # Forward issues collectives (FSDP gathers parameters), so every rank must run as many forwards:
        # agree on the count first (after the loop a rank would wait while another is still in a forward).
        most = int(comm.all_reduce(torch.tensor([total], device=strategy.root_device), op="max"))
    for batch in loop.val_loader:
        inputs, targets = task.split_batch(batch)
        inputs = to_memory_format(move_to_device(inputs, strategy.root_device, non_blocking=True),
                                  loop.fast.channels_last)
        targets = move_to_device(targets, loop.target_device, non_blocking=True)
        with loop.precision.forward_context():
            outputs, loss = task.evaluate_batch(model, inputs, targets)
        if strategy.computes_loss:
            evaluator.update(outputs, targets, loss, task.batch_size(inputs))
        done, last_inputs = done + 1, inputs
        after_batch(done, total)
    # A rank with a shorter shard runs empty forwards until it has run as many as the others;
    # nothing it computes reaches a metric.
    for _ in range(most - done):
        if last_inputs is None:  # this rank's shard is empty: shape an empty input from the first sample
            first = task.split_batch(first_sample_batch(loop.val_loader, 0))[0]
            last_inputs = move_to_device(first, strategy.root_device)
        with loop.precision.forward_context():
            model(empty_like_batch(last_inputs))
    metrics = evaluator.compute(strategy.root_device, out)
    warn_non_finite(metrics, epoch, is_main=loop.dist.is_main)
    return metrics


def warn_non_finite(metrics: dict[str, float], epoch: int, *, is_main: bool) -> None:
    """One warning line per validation metric that is inf or NaN (JSON writes it as null), on rank 0.

    Such a value is usually real, not a bug: e.g. an untrained ResNet-50 whose BatchNorm running
    statistics come from a few 2-sample micro-batches overflows in eval mode (issue 15).
    """
    bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad or not is_main:
        return
    when = f"after epoch {epoch}" if epoch else "in evaluation"
    for name, value in bad.items():
        print(f"gputrain: warning: val/{name}={value} {when} is not finite: the model's eval-mode outputs overflow "
              "(BatchNorm running statistics from too few or too small batches?); train longer, use larger "
              "batches or a lower learning rate", file=sys.stderr, flush=True)


def evaluate_only(loop: Loop, out: Path, after_batch: Callable[[int, int], Any]) -> dict[str, float]:
    """``gputrain eval``: the metrics of the model as it is; rank 0 prints them and writes ``out/eval.json``."""
    if loop.dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    metrics = {f"val/{k}": v for k, v in evaluate_batches(loop, out, 0, after_batch).items()}
    metrics["time/val_s"] = time.perf_counter() - start
    metrics["world_size"] = loop.dist.world_size
    if loop.dist.is_main:
        (out / "eval.json").write_text(strict_json(metrics, indent=2))
        print(strict_json(metrics, indent=2), flush=True)
        print(f"gputrain: wrote {out / 'eval.json'}", flush=True)
    return metrics
