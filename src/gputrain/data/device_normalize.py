"""``data.normalize_on_device``: loader workers hand over ``uint8`` training images; the device makes them float.

Why: a float32 batch of 256 images at 224x224 is 154 MB. Each one is written into shared memory by a worker,
read back by the training process, copied again into pinned memory by the loader's pin thread, then sent to
the GPU. On an H100 with 16 loader workers, ResNet-50 trained at 1,934 images/s on real JPEGs against 3,964
on device-resident batches (docs/benchmarks.md), although the workers' decoding alone could feed about 5,000;
the training process's copies of those bytes are the likely pace-setter (not yet measured on a GPU). The same batch
as ``uint8`` is 38.5 MB, a quarter of every copy; scaling to [0, 1] and normalizing then take one fused pass
on the GPU. timm's prefetching loader, DALI and FFCV move images the same way.

The arithmetic is torchvision's ``ToDtype(float32, scale=True)`` and ``Normalize`` on the same values, so a
batch normalized on the device should equal the one normalized in a worker bit for bit (IEEE multiply,
subtract and divide are correctly rounded on a CPU and a GPU alike): tested on a CPU; a CUDA-marked test
checks it where a GPU exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.data import default_collate

from gputrain.data.images import normalize_transform


class PixelBatch:
    """A stacked ``uint8`` image batch and the normalization to apply once it is on its device."""

    def __init__(self, pixels: Tensor, mean: Sequence[float], std: Sequence[float]) -> None:
        self.pixels, self.mean, self.std = pixels, tuple(mean), tuple(std)

    def __len__(self) -> int:
        return len(self.pixels)

    def pin_memory(self) -> PixelBatch:
        """Called by the DataLoader's pin thread (``pin_memory=True``): pins the ``uint8`` pixels only."""
        return PixelBatch(self.pixels.pin_memory(), self.mean, self.std)

    def to_device(self, device: torch.device, non_blocking: bool = False) -> Tensor:
        """The batch on ``device`` as float32, scaled to [0, 1] and normalized there."""
        moved = self.pixels.to(device, non_blocking=non_blocking)
        return cast(Tensor, _normalizer(self.mean, self.std)(moved))


@functools.lru_cache(maxsize=8)
def _normalizer(mean: tuple[float, ...], std: tuple[float, ...]) -> Callable[..., object]:
    """The workers' own normalization (the same ops, so the same bits), built once rather than every step."""
    return normalize_transform(mean, std)


class PixelCollate:
    """The DataLoader collate of ``(uint8 image, target)`` samples: a :class:`PixelBatch` and the targets.

    Samples whose image is not ``uint8`` (the validation set, normalized in the workers) collate as usual.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, samples: list[Any]) -> Any:
        if not samples or not (isinstance(samples[0][0], Tensor) and samples[0][0].dtype == torch.uint8):
            return default_collate(samples)
        pixels = default_collate([s[0] for s in samples])  # into shared memory, when called in a worker
        return PixelBatch(pixels, self.mean, self.std), default_collate([s[1] for s in samples])
