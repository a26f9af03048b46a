"""Cutting a batch into micro-batches and joining their outputs, for the strategies that split a model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def micro_batch_sizes(batch_size: int, micro_batches: int) -> list[int]:
    """The sizes a batch is cut into: chunks of :func:`split_size`, the last one holding the remainder."""
    size = split_size(batch_size, micro_batches)
    return [size] * (batch_size // size) + ([batch_size % size] if batch_size % size else [])


def split_size(batch_size: int, micro_batches: int) -> int:
    """Samples per micro-batch: ceil(batch / M), the tutorial's ``split_size``. A short batch gets fewer
    micro-batches of this size (and a shorter last one), so its micro-batches are the ones that one
    process with ``batch_size / M`` and ``accumulate_grad_batches = M`` would run."""
    return max(1, math.ceil(batch_size / micro_batches))


def batch_len(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        return batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return batch_len(batch[0])
    raise ValueError(f"cannot cut a batch of {type(batch).__name__} into micro-batches; give tensors")


def chunk_batch(batch: Any, size: int) -> list[Any]:
    """``batch`` cut along dim 0 into pieces of ``size`` (the last may be shorter); nested containers kept."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, dict):
        parts = {k: chunk_batch(v, size) for k, v in batch.items()}
        return [dict(zip(parts, values, strict=True)) for values in zip(*parts.values(), strict=True)]
    if isinstance(batch, (list, tuple)):
        columns = [chunk_batch(v, size) for v in batch]
        return [type(batch)(values) for values in zip(*columns, strict=True)]
    raise ValueError(f"cannot cut a batch of {type(batch).__name__} into micro-batches; give tensors")


def equal_runs(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[4, 4, 4, 1]`` -> ``[(0, 3), (3, 4)]``: runs of consecutive equal sizes, as (start, stop)."""
    runs: list[tuple[int, int]] = []
    for i, size in enumerate(sizes):
        if runs and sizes[runs[-1][0]] == size:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def cat_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0 (tensors, or tuples of tensors)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    if isinstance(first, tuple):
        return tuple(torch.cat([o[i] for o in outputs]) for i in range(len(first)))
    raise ValueError(f"the model's last stage returned {type(first).__name__}; split models must return tensors")
