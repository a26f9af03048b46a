"""Reconstruction: a conv autoencoder learns to reproduce its input under MSE."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gputrain.config import RunConfig
from gputrain.data.imagefolder import ImageFiles, list_images
from gputrain.data.images import seeded_split
from gputrain.models import build_configured_model
from gputrain.tasks.base import Task
from gputrain.tasks.spec import TaskSpec


class ReconstructionTask(Task):
    """The target is the input itself."""

    def __init__(self) -> None:
        super().__init__(F.mse_loss)

    def split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch, batch


def build(cfg: RunConfig) -> TaskSpec:
    files = list_images(cfg.data.root)
    if cfg.data.val_root:
        train_files, val_files = files, list_images(cfg.data.val_root)
    else:
        train_idx, val_idx = seeded_split(len(files), cfg.data.val_fraction, cfg.data.split_seed)
        train_files, val_files = [files[i] for i in train_idx], [files[i] for i in val_idx]
    size = cfg.data.image_size
    model = build_configured_model(cfg.model, "conv_autoencoder")
    return TaskSpec(
        task=ReconstructionTask(), model=model, train_data=ImageFiles(train_files, size),
        val_data=ImageFiles(val_files, size) if val_files else None,
        example_input=ImageFiles(train_files[:1], size)[0].unsqueeze(0),
    )
