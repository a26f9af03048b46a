"""What building a task from a recipe yields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the launcher's data check imports this package without torch
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from gputrain.tasks.base import Task


@dataclass
class TaskSpec:
    task: Task
    model: nn.Module
    train_data: Dataset
    val_data: Dataset | None
    example_input: torch.Tensor | None = None
    """One input batch, for export and shape checks."""
