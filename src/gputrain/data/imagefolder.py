"""Unlabelled images from any nested folder (frames of a video, say), and a generator of sample frames."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torchvision.transforms.v2.functional as TF
from torch.utils.data import Dataset
from torchcodec.encoders import JpegEncoder, PngEncoder

from gputrain.data.images import DECODABLE_SUFFIXES, DataError, read_image_rgb, to_uint8, to_unit_float
from gputrain.data.images import image_size as header_size

IMAGE_SUFFIXES = DECODABLE_SUFFIXES  # what read_image_rgb can decode


def list_images(root: str | Path) -> list[Path]:
    """Every image file below ``root``, sorted, so that indices mean the same on every rank."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data.root={root} is not a folder; make one with `gputrain data make imagefolder --out {root}`")
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under data.root={root}")
    return files


def check_same_size(files: list[Path]) -> None:
    """Raise :class:`DataError` naming the first file whose size differs from the first file's.

    Batches stack images, so a folder read at the files' own size must hold one size; without
    this check the failure is ``stack expects each tensor to be equal size`` from a DataLoader,
    naming no file. Only headers are read (PIL opens lazily): 70 us a file measured on a busy
    2-core machine, so 0.07 s per thousand images, on every rank. Setting ``data.image_size``
    resizes instead and skips the check.
    """
    if not files:
        return
    expected = header_size(files[0])
    for path in files[1:]:
        size = header_size(path)
        if size != expected:
            raise DataError(
                f"image {path} is {size[1]}x{size[0]} but {files[0]} is {expected[1]}x{expected[0]} (width x height); "
                "images of one folder must share a size: set data.image_size=N to resize them all, or fix the file"
            )


class ImageFiles(Dataset[torch.Tensor]):
    """Images as float CHW tensors in [0, 1]; labels (sub-folders) are ignored.

    With ``image_size`` 0 the files' own size is kept, so they must all have one size (checked here). ``uint8``
    hands over ``uint8`` pixels before the division by 255 (data.normalize_on_device: the training device divides).
    """

    def __init__(self, files: list[Path], image_size: int = 0, *, uint8: bool = False) -> None:
        self.files = files
        self.image_size = image_size
        self.uint8 = uint8
        if not image_size:
            check_same_size(files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        image = read_image_rgb(self.files[index])
        if self.image_size:
            image = TF.resize(image, [self.image_size, self.image_size], antialias=True)
        return to_uint8(image) if self.uint8 else to_unit_float(image)


def make_frames(out: str | Path, *, count: int = 512, size: int = 80, videos: int = 4, seed: int = 0) -> Path:
    """Write ``count`` JPEG frames of moving shapes over gradients, in ``videos`` sub-folders.

    Frames of one video share a background and shapes that move smoothly, so an autoencoder
    has real structure to learn; they are real image files read by the same loader as user data.
    """
    out = Path(out)
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    per_video = math.ceil(count / videos)
    written = 0
    for v in range(videos):
        folder = out / f"video_{v:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        c0, c1 = torch.rand(3, 1, 1, generator=g), torch.rand(3, 1, 1, generator=g)
        background = c0 * xs + c1 * ys
        shapes = [(torch.rand(3, generator=g), torch.rand(2, generator=g), torch.rand(2, generator=g) * 0.04 - 0.02,
                   0.08 + 0.12 * float(torch.rand(1, generator=g))) for _ in range(3)]
        for f in range(min(per_video, count - written)):
            frame = background.clone()
            for colour, start, velocity, radius in shapes:
                cy, cx = ((start + velocity * f) % 1.0).tolist()
                inside = ((ys - cy) ** 2 + (xs - cx) ** 2) < radius**2
                frame = torch.where(inside, colour.view(3, 1, 1), frame)
            pixels = (frame.clamp(0, 1) * 255).round().to(torch.uint8)
            if f % 4:
                JpegEncoder(pixels).to_file(folder / f"frame_{f:04d}.jpg", quality=92)
            else:
                PngEncoder(pixels).to_file(folder / f"frame_{f:04d}.png")
            written += 1
    return out
