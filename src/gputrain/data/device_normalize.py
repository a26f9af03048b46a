"""``data.normalize_on_device``: loader workers hand over ``uint8`` training images; the device makes them float.

Why: a float32 batch of 256 images at 224x224 is 154 MB. Each one is written into shared memory by a worker,
read back by the training process, copied again into pinned memory by the loader's pin thread, then sent to
the GPU. On an H100 with 16 loader workers, ResNet-50 trained at 1,934 images/s on real JPEGs against 3,964
on device-resident batches (docs/benchmarks.md), although the workers' decoding alone could feed about 5,000;
the training process's copies of those bytes are the likely pace-setter (not yet measured on a GPU). The same batch
as ``uint8`` is 38.5 MB, a quarter of every copy; scaling to [0, 1] and normalizing then take one fused pass
on the GPU. timm's prefetching loader, DALI and FFCV move images the same way.

Every built-in task takes part. The device runs the very function its workers would have run, so a batch made
float on the device equals the worker's bit for bit (IEEE multiply, subtract and divide are correctly rounded on
a CPU and a GPU alike): torchvision's ``ToDtype(float32, scale=True)`` and ``Normalize`` for classification and
segmentation (whose masks stay as they were); ``x / 255`` (:func:`~gputrain.data.images.to_unit_float`) for the
autoencoder, whose targets are its inputs, and for detection, whose models normalize inside themselves
(torchvision's ``GeneralizedRCNNTransform``) and take a list of images of different sizes. Tested on a CPU; the
CUDA-marked tests check it where a GPU exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.data import default_collate

from gputrain.data.images import normalize_transform, to_unit_float

if TYPE_CHECKING:
    from gputrain.config import RunConfig

Pixels = Tensor | list[Tensor]
"""One stacked ``uint8`` batch, or a list of images of different sizes (detection)."""


def normalize_on_device(cfg: RunConfig) -> bool:
    """data.normalize_on_device with ``auto`` resolved (on when the run trains on a GPU); off where images are
    decoded on the device (``data.decode_on_device``), whose batches are made there anyway."""
    if cfg.data.decode_on_device and not cfg.data.synthetic:
        return False
    if cfg.data.normalize_on_device == "auto":
        return cfg.trainer.accelerator != "cpu" and torch.cuda.is_available()
    return bool(cfg.data.normalize_on_device)


class PixelBatch:
    """``uint8`` training images and how to make them float once on their device: normalized by ``mean`` and
    ``std`` (torchvision's ops), or, without them, divided by 255 (:func:`~gputrain.data.images.to_unit_float`)."""

    def __init__(self, pixels: Pixels, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> None:
        self.pixels = pixels
        self.mean = tuple(mean) if mean is not None else None
        self.std = tuple(std) if std is not None else None
        self._made: dict[str, Pixels] = {}

    def __len__(self) -> int:
        return len(self.pixels)

    def pin_memory(self) -> PixelBatch:
        """Called by the DataLoader's pin thread (``pin_memory=True``): pins the ``uint8`` pixels only."""
        pixels = self.pixels
        return PixelBatch(pixels.pin_memory() if isinstance(pixels, Tensor) else [p.pin_memory() for p in pixels],
                          self.mean, self.std)

    def to_device(self, device: torch.device, non_blocking: bool = False) -> Pixels:
        """The images on ``device`` as float32, made there. Made once per device: an autoencoder's batch is both
        its inputs and its targets, and the loop moves each, so the second gets the first's tensor (one copy and
        one conversion, as a CPU run shares the one tensor)."""
        key = str(device)
        if key not in self._made:
            make = _maker(self.mean, self.std)
            if isinstance(self.pixels, Tensor):
                self._made[key] = make(self.pixels.to(device, non_blocking=non_blocking))
            else:
                self._made[key] = [make(p.to(device, non_blocking=non_blocking)) for p in self.pixels]
        return self._made[key]


@functools.lru_cache(maxsize=8)
def _maker(mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> Callable[[Tensor], Tensor]:
    """The workers' own conversion (the same ops, so the same bits), built once rather than every step."""
    if mean is None or std is None:
        return to_unit_float
    return normalize_transform(mean, std)  # type: ignore[return-value]


class PixelCollate:
    """The DataLoader collate of samples whose image is ``uint8``: the batch with a :class:`PixelBatch` for images.

    A sample is ``(image, target)``, or an image alone (the autoencoder's, its own target); ``collate`` is the task's
    usual collate (torch's default, or detection's lists). Samples whose image is not ``uint8`` (the validation set,
    made float in the workers) collate as usual.
    """

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None, *,
                 collate: Callable[[list[Any]], Any] = default_collate) -> None:
        self.mean = tuple(mean) if mean is not None else None
        self.std = tuple(std) if std is not None else None
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate(samples)  # into shared memory, when called in a worker
        alone = bool(samples) and isinstance(samples[0], Tensor)
        image = samples[0] if alone else samples[0][0] if samples else None
        if not (isinstance(image, Tensor) and image.dtype == torch.uint8):
            return batch
        if alone:
            return PixelBatch(batch, self.mean, self.std)
        images, targets = batch
        return PixelBatch(images, self.mean, self.std), targets
