"""What a task is: a model, how a batch feeds it, a loss and an evaluator. No parallelism here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gputrain.metrics.base import Evaluator, MeanLoss


class Task:
    """Default behaviour: ``batch = (inputs, targets)``, ``loss = criterion(model(inputs), targets)``.

    Subclasses override only what differs (an autoencoder's target is its input; Mask R-CNN
    takes targets in forward and returns its losses).
    """

    targets_to_model: bool = False
    """True when the model itself consumes the targets (they then go to the input device)."""
    fixed_shapes: bool = True
    """Every batch is one tensor of one shape: the channels-last format and cuDNN's autotuner pay off (detection,
    whose model batches images of different sizes itself, sets False)."""

    def __init__(self, criterion: Callable[..., torch.Tensor] | None = None) -> None:
        self.criterion = criterion

    train_collate: Callable[[list[Any]], Any] | None = None
    """Set where training images are made on the device: decoded there (data.decode_on_device: collates their
    bytes) or made float there (data.normalize_on_device: collates ``uint8`` pixels)."""

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """The DataLoader collate function; None means torch's default."""
        return self.train_collate

    @property
    def normalizes_on_device(self) -> bool:
        """The training batches cross from the loader's workers as ``uint8`` (data.normalize_on_device)."""
        from gputrain.data.device_normalize import PixelCollate

        return isinstance(self.train_collate, PixelCollate)

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        inputs, targets = batch[0], batch[1]
        return inputs, targets

    def batch_size(self, inputs: Any) -> int:
        return len(inputs)

    def forward(self, model: nn.Module, inputs: Any, targets: Any) -> Any:
        return model(inputs)

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        if self.criterion is None:
            raise ValueError("no loss given: pass loss=... to Trainer.fit or set it in the task")
        try:
            return self.criterion(outputs, targets)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError) as err:  # a loss that does not fit the model
            name = getattr(self.criterion, "__qualname__", None) or type(self.criterion).__name__
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise ValueError(f"the loss {name} failed on model outputs {describe(outputs)} and targets "
                             f"{describe(targets)}: {first}; give a loss that takes these (class ids: "
                             "cross_entropy; values of the outputs' shape: mse_loss)") from err

    def evaluate_batch(self, model: nn.Module, inputs: Any, targets: Any) -> tuple[Any, torch.Tensor | None]:
        """Eval-mode outputs and the batch loss (None where the task has no eval loss)."""
        outputs = model(inputs)
        return outputs, self.loss(outputs, targets)

    def evaluator(self) -> Evaluator:
        return MeanLoss()

    # -- pictures (gputrain predict, samples.png): rank 0 alone, after evaluation --------------
    class_names: list[str] | None = None
    """Names of the model's classes by index, where the task has classes (None: show indices)."""

    def display(self, inputs: torch.Tensor) -> torch.Tensor:
        """One model input ``(3, H, W)`` as a ``uint8`` picture; the default takes it as floats in [0, 1]."""
        return (inputs.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)

    def prediction(self, output: Any, size: tuple[int, int]) -> Any:
        """What ``gputrain predict`` keeps of one image's eval output (the image is ``size`` = (H, W)):
        on the CPU and small, since it is gathered to rank 0; :meth:`draw` must accept it too."""
        return output.detach().cpu() if isinstance(output, torch.Tensor) else output

    def draw(self, image: torch.Tensor, output: Any, target: Any = None) -> tuple[torch.Tensor, str]:
        """One prediction drawn on its ``uint8 (3, H, W)`` image, and a caption (what a grid cell shows).

        ``output`` is the model's output for this one image (eval mode), ``target`` its label or None.
        The default shows the image alone; each built-in task draws its own kind of prediction.
        """
        return image, ""

    def write_predictions(self, inputs: Sequence[Any], results: Sequence[Any], out: Path) -> str:
        """Write what ``gputrain predict`` keeps of ``results`` (``results[i]`` is the prediction of ``inputs[i]``,
        an image file with ``.path`` and ``.stem``) into ``out``; returns what was written, for predict's one line.

        The default (the autoencoder, any task of your own) draws each prediction beside its image:
        ``reconstructions/<stem>.png``.
        """
        from gputrain.tasks.draw import write_pictures

        return write_pictures(self, inputs, results, out, "reconstructions", ".png")


def describe(value: Any) -> str:
    """A batch's shape as an error names it: ``(8, 10) float32``, a tuple or dict of those."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "") + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in list(value.items())[:4]) + "}"
    return type(value).__name__

