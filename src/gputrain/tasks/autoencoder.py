"""Reconstruction: a conv autoencoder learns to reproduce its input under MSE."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF

from gputrain.config import RunConfig
from gputrain.data.device_normalize import PixelCollate, normalize_on_device
from gputrain.data.imagefolder import ImageFiles, list_images
from gputrain.data.images import seeded_split, to_unit_float
from gputrain.models import build_configured_model
from gputrain.tasks.base import Task
from gputrain.tasks.draw import side_by_side
from gputrain.tasks.spec import TaskSpec


class ReconstructionTask(Task):
    """The target is the input itself."""

    def __init__(self) -> None:
        super().__init__(F.mse_loss)

    def split_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch, batch

    def prediction(self, output: Any, size: tuple[int, int]) -> torch.Tensor:
        """The reconstruction as a ``uint8`` picture."""
        return self.display(output)

    def draw(self, image: torch.Tensor, output: Any, target: Any = None) -> tuple[torch.Tensor, str]:
        picture = output if output.dtype == torch.uint8 else self.display(output)
        if picture.shape[-2:] != image.shape[-2:]:  # data.image_size resized the input
            image = TF.resize(image, list(picture.shape[-2:]), antialias=True)
        return side_by_side(image, picture), "input | reconstruction"


def eval_preprocess(cfg: RunConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``uint8`` image as the model reads it (what :class:`~gputrain.data.imagefolder.ImageFiles` does)."""
    size = cfg.data.image_size

    def preprocess(image: torch.Tensor) -> torch.Tensor:
        if size:
            image = TF.resize(image, [size, size], antialias=True)
        return to_unit_float(image)
    return preprocess


def for_prediction(cfg: RunConfig, *, annotations: str = "") -> tuple[Task, Callable[[torch.Tensor], Any]]:
    """The task and input preprocessing ``gputrain predict`` uses."""
    return ReconstructionTask(), eval_preprocess(cfg)


def build(cfg: RunConfig) -> TaskSpec:
    files = list_images(cfg.data.root)
    if cfg.data.val_root:
        train_files, val_files = files, list_images(cfg.data.val_root)
    else:
        train_idx, val_idx = seeded_split(len(files), cfg.data.val_fraction, cfg.data.split_seed)
        train_files, val_files = [files[i] for i in train_idx], [files[i] for i in val_idx]
    size = cfg.data.image_size
    model = build_configured_model(cfg.model, "conv_autoencoder")
    task, on_device = ReconstructionTask(), normalize_on_device(cfg)
    if on_device:  # one uint8 batch, made float once on the device: the inputs and the targets
        task.train_collate = PixelCollate()
    return TaskSpec(
        task=task, model=model, train_data=ImageFiles(train_files, size, uint8=on_device),
        val_data=ImageFiles(val_files, size) if val_files else None,
        example_input=ImageFiles(train_files[:1], size)[0].unsqueeze(0),
    )
