"""``data.decode_on_device=true``: loader workers only read the files; images are decoded on the training device.

On CUDA a batch of JPEGs is decoded in one call by nvJPEG (TorchCodec's ``decode_jpeg([...], device="cuda")``)
and augmented there, which frees the CPU cores that decoding takes (about 360 images/s per core on 500x375
JPEGs: a GPU training ResNet-50 at 3,000 images/s would need 8-9 of them). It pays where a machine has few
cores per GPU; ``gputrain bench throughput`` measures the input-bound ratio with and without it.

Random augmentation stays a function of the sample: a worker records the seed that
:class:`~gputrain.data.samplers.SeededSamples` gave the sample (``torch.initial_seed()``), and the transform
runs under that seed on the device. On a CPU the images decode with the same decoder as in the workers
(:func:`~gputrain.data.images.decode_rgb`), so training is bit-for-bit the run that decodes in workers (tested);
on CUDA nvJPEG and libjpeg may differ by a grey level or so in some pixels. Both apply the EXIF orientation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.data import default_collate
from torchcodec.decoders import decode_jpeg

from gputrain.data.images import DataError, _short, decode_rgb

JPEG_MAGIC = b"\xff\xd8"


@dataclass
class EncodedImage:
    """A file's bytes, its path (for errors) and the seed its augmentation draws from.

    Plain ``bytes``, not a tensor: they cross from the worker through the pipe (a tensor would be shared by
    file descriptor, one per image, which is both slower for small buffers and fragile).
    """

    data: bytes
    path: str
    seed: int

    def tensor(self) -> Tensor:
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8)


def read_encoded(path: str) -> EncodedImage:
    """The loader of a folder dataset whose images are decoded on the device: the file's bytes, not its pixels."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"cannot read image {path}: {e.strerror}; check that the file exists and is readable") from e
    if not data:
        raise DataError(f"image {path} is empty (0 bytes); remove the file or re-export it")
    return EncodedImage(data, str(path), torch.initial_seed())


def _decode_one(image: EncodedImage, device: torch.device) -> Tensor:
    if device.type == "cuda" and image.data[:2] == JPEG_MAGIC:
        try:
            return cast(Tensor, decode_jpeg(image.tensor(), mode="RGB", device=device))  # one source: one tensor
        except (RuntimeError, ValueError) as e:
            raise DataError(f"image {image.path} is unreadable, truncated or corrupt ({_short(e)}); remove the file "
                            "or re-export it as JPEG or PNG") from e
    return decode_rgb(image.data, image.path).to(device)


def decode_batch(images: list[EncodedImage], device: torch.device) -> list[Tensor]:
    """``uint8 (3, H, W)`` images on ``device``: on CUDA the JPEGs in one nvJPEG call, the rest (PNG...) on the CPU."""
    decoded: list[Tensor | None] = [None] * len(images)
    jpegs = [i for i, im in enumerate(images) if im.data[:2] == JPEG_MAGIC]
    if device.type == "cuda" and jpegs:
        try:
            out = decode_jpeg([images[i].tensor() for i in jpegs], mode="RGB", device=device)
            for i, tensor in zip(jpegs, out, strict=True):
                decoded[i] = tensor
        except (RuntimeError, ValueError):
            pass  # one bad file fails the whole call: decode one by one below, which names it
    return [d if d is not None else _decode_one(images[i], device) for i, d in enumerate(decoded)]


class EncodedBatch:
    """Images still encoded, and the transform to run on each once decoded; the loop moves it with ``to_device``."""

    def __init__(self, images: list[EncodedImage], transform: Callable[[Tensor], Tensor] | None) -> None:
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return len(self.images)

    def to_device(self, device: torch.device, non_blocking: bool = False) -> Tensor:
        """Decode on ``device``, augment each image under its own sample's seed, stack into one batch."""
        decoded = decode_batch(self.images, device)
        if self.transform is None:
            return torch.stack(decoded)
        saved = torch.get_rng_state()
        try:
            out = []
            for image, pixels in zip(self.images, decoded, strict=True):
                torch.default_generator.manual_seed(image.seed)
                out.append(self.transform(pixels))
        finally:
            torch.set_rng_state(saved)
        return torch.stack(out)


class EncodedCollate:
    """The DataLoader collate of ``(EncodedImage, target)`` samples: an :class:`EncodedBatch` and the targets.

    Samples that are already tensors (the validation set, decoded in the workers) collate as usual.
    """

    def __init__(self, transform: Callable[[Tensor], Tensor] | None) -> None:
        self.transform = transform

    def __call__(self, samples: list[Any]) -> Any:
        if not samples or not isinstance(samples[0][0], EncodedImage):
            return default_collate(samples)
        return EncodedBatch([s[0] for s in samples], self.transform), default_collate([s[1] for s in samples])

