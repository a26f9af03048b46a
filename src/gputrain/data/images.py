"""Image and mask reading shared by every loader, plus the drawing helpers of the sample-data generators.

Every loader decodes through :func:`read_image_rgb` (TorchCodec), so a truncated or corrupt file fails the same
way everywhere: a :class:`DataError` that names the path and says what to do, instead of a C++ stack trace
from a DataLoader worker that hides which of a million files was bad. There is deliberately no fallback
to another decoder: a file one library half-decodes is a file that should be re-exported.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: Suffixes :func:`read_image_rgb` accepts. TorchCodec also decodes AVIF and HEIC (the latter only with a
#: system libheif); they are left out so that a folder loads the same files on every machine, as before.
DECODABLE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif")

#: EXIF orientations that turn the picture a quarter (transpose, rotate 90 or 270, transverse): the decoded
#: image is the stored one with height and width swapped.
_QUARTER_TURNS = (5, 6, 7, 8)
_EXIF_ORIENTATION = 0x0112

PathLike = str | os.PathLike[str]


class DataError(ValueError):
    """A data file or annotation is unusable; the message names it and says how to fix it."""


def _short(err: BaseException) -> str:
    # The C++ decoders prefix messages with "function, /build/path/file.cpp:123, " and libjpeg appends its
    # warnings on new lines; drop the prefix and keep one line, so the error stays one line naming the file.
    return " ".join(re.sub(r"^[\w:]+, \S+:\d+, ", "", str(err)).split())


def decode_rgb(data: bytes | Tensor, path: PathLike) -> Tensor:
    """Decode encoded image bytes into ``(3, H, W)`` pixels; :class:`DataError` naming ``path`` if they cannot be.

    The one decoding call of gputrain (the loaders' :func:`read_image_rgb` and ``data.decode_on_device``'s CPU
    path). ``output_dtype="auto"`` keeps a 16-bit PNG's ``uint16`` values, as torchvision's decoder gave them;
    loaders make them floats in ``[0, 1]`` (:func:`to_unit_float`, ``ToDtype(scale=True)``) or ``uint8``
    (:func:`to_uint8`), never dividing them by 255.
    """
    # Imported here: a process that decodes nothing (a model of the user's own on tensors) never imports TorchCodec.
    from torchcodec.decoders import decode_image

    try:
        return decode_image(data, mode="RGB", output_dtype="auto")
    except (RuntimeError, ValueError) as e:  # ValueError: TorchCodec does not recognise the format
        raise DataError(
            f"image {path} is unreadable, truncated or corrupt ({_short(e)}); remove the file or re-export it "
            f"as JPEG or PNG (supported: {', '.join(DECODABLE_SUFFIXES)})"
        ) from e


def read_image_rgb(path: PathLike) -> Tensor:
    """Decode a JPEG/PNG/WebP/GIF file into a ``uint8`` tensor of shape ``(3, H, W)`` (``uint16`` for 16-bit PNGs).

    Grey, palette, RGBA and CMYK images are converted to RGB; an EXIF orientation is applied (the picture as a
    viewer shows it, see docs/data.md). Raises :class:`DataError` naming ``path`` when the file is missing,
    empty, truncated, corrupt or of a format TorchCodec cannot decode.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DataError(
            f"cannot read image {p}: {e.strerror or e}; check that the file exists and is readable"
        ) from e
    if not data:
        raise DataError(f"image {p} is empty (0 bytes); remove the file or re-export it")
    return decode_rgb(data, p)


def read_mask(path: PathLike) -> Tensor:
    """Read a single-channel label PNG (mode ``L``, ``P``, ``I`` or ``I;16``) into an ``int64`` ``(H, W)`` tensor.

    PIL is used rather than TorchCodec because TorchCodec (like torchvision before it) expands palette PNGs to
    RGB even in mode ``UNCHANGED``, which would turn class indices into colours, and reads 1-bit PNGs as 0/255;
    PIL returns the indices themselves. Masks carry no EXIF orientation, so none is applied.
    """
    p = Path(path)
    try:
        with Image.open(p) as im:
            im.load()  # PIL opens lazily; force the decode here so truncation is caught here
            if im.mode not in ("L", "P", "I", "I;16", "1"):
                raise DataError(
                    f"mask {p} has mode {im.mode!r}; a mask must be one channel of class indices "
                    "(mode L, P or I); re-export it as a greyscale or palette PNG"
                )
            arr = np.array(im)
    except DataError:
        raise
    except FileNotFoundError as e:
        raise DataError(f"mask {p} does not exist; check the annotation folder") from e
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(
            f"mask {p} is unreadable, truncated or corrupt ({e}); remove the file or re-export it"
        ) from e
    return torch.from_numpy(arr.astype(np.int64))


def image_size(path: PathLike) -> tuple[int, int]:
    """``(height, width)`` of an image as :func:`read_image_rgb` returns it, from its header only (no pixel decode).

    For cheap validation: the EXIF orientation is read too, since TorchCodec applies it, so a quarter turn
    swaps the stored height and width.
    """
    p = Path(path)
    try:
        with Image.open(p) as im:
            w, h = im.size
            turned = im.getexif().get(_EXIF_ORIENTATION) in _QUARTER_TURNS
    except (OSError, SyntaxError) as e:
        raise DataError(f"cannot read the header of {p} ({e}); remove the file or re-export it") from e
    return (w, h) if turned else (h, w)


def normalize_transform(mean: tuple[float, ...], std: tuple[float, ...]) -> Callable[..., object]:
    """``uint8`` image → ``float32`` in ``[0, 1]`` → normalized by ``mean``/``std`` (masks pass through).

    A 16-bit PNG's ``uint16`` becomes ``x / 65535`` (``ToDtype(scale=True)``), as in :func:`to_unit_float`.
    """
    # Imported here: torchvision's import (about 1 s of CPU: its models, its ops and torch._dynamo) only where used.
    from torchvision.transforms import v2

    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std))])


def to_unit_float(pixels: Tensor) -> Tensor:
    """Decoded pixels as float32 in ``[0, 1]``: ``uint8`` ``x / 255``, a 16-bit PNG's ``uint16`` ``x / 65535``.

    What image folders (the autoencoder) and COCO images feed a model. The divisor is a tensor on the pixels' own
    device because CUDA divides by a Python number as a multiplication by its reciprocal, which differs from the
    CPU's true division in the last bit of some values; so pixels made float on a GPU (``data.normalize_on_device``)
    are the worker's bit for bit. (torchvision's ``ToDtype(scale=True)`` multiplies by 1/255, which differs from
    ``x / 255`` in 126 of the 256 values: not used here, so that these loaders keep the values they always gave.)
    """
    top = 65535.0 if pixels.dtype == torch.uint16 else 255.0
    return pixels.to(torch.float32).div_(torch.full((), top, device=pixels.device))


def to_uint8(pixels: Tensor) -> Tensor:
    """Decoded pixels as ``uint8``: 8-bit ones as they are, a 16-bit PNG's ``uint16`` rounded to ``x / 257``.

    What loaders hand over where the device makes images float (``data.normalize_on_device``), so a 16-bit image
    becomes there what its float path gives within 1/255. Rounding, not torchvision's ``to_dtype(uint8, scale=True)``,
    which shifts right by 8 (``x // 256``): one lower in 16,256 of the 65,536 values, up to 0.99/255 off, not 0.5/255.
    """
    if pixels.dtype != torch.uint16:
        return pixels
    return pixels.to(torch.int32).add_(128).div_(257, rounding_mode="floor").to(torch.uint8)


def seeded_split(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``range(n)`` into sorted, disjoint ``(train_idx, val_idx)``; depends on ``(n, val_fraction, seed)`` only.

    The validation part has ``round(n * val_fraction)`` items, at least one when ``val_fraction > 0``.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1); use e.g. 0.2 for an 8:2 split")
    n_val = round(n * val_fraction)
    if val_fraction > 0:
        n_val = max(n_val, 1)
    if n_val >= n and n > 0:
        raise ValueError(
            f"val_fraction={val_fraction} of {n} items leaves nothing to train on; lower it or add data"
        )
    g = torch.Generator()
    g.manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


# ---- drawing helpers for the sample-data generators -------------------------------------------------------

#: Shapes the generators draw; class ``i`` of a generated set draws ``SHAPES[i % len(SHAPES)]``.
SHAPES = ("square", "circle", "triangle", "cross", "ring", "diamond", "hstripes", "vstripes", "checker", "x")


def class_colour(i: int) -> tuple[int, int, int]:
    """A bright RGB colour for class ``i``; hues are spread by the golden ratio so neighbours differ."""
    hue = (i * 0.618033988749895) % 1.0
    value = 1.0 if (i // 10) % 2 == 0 else 0.7  # a second brightness band keeps classes >= 10 apart
    rgb = []
    for shift in (0.0, 2.0 / 3.0, 1.0 / 3.0):
        x = abs(((hue + shift) % 1.0) * 6.0 - 3.0) - 1.0
        rgb.append(round(255 * value * min(max(x, 0.0), 1.0)))
    return rgb[0], rgb[1], rgb[2]


def shape_mask(kind: str, height: int, width: int, cy: float, cx: float, r: float) -> np.ndarray:
    """Boolean ``(height, width)`` mask of a shape of half-size ``r`` centred at ``(cy, cx)``."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    dy, dx = yy - cy, xx - cx
    box = (np.abs(dx) <= r) & (np.abs(dy) <= r)
    dist = np.sqrt(dx * dx + dy * dy)
    period = max(2, round(r / 3))
    masks = {
        "square": lambda: box,
        "circle": lambda: dist <= r,
        "triangle": lambda: (np.abs(dy) <= r) & (np.abs(dx) <= (dy + r) / 2),
        "cross": lambda: box & ((np.abs(dx) <= r / 3) | (np.abs(dy) <= r / 3)),
        "ring": lambda: (dist <= r) & (dist >= r / 2),
        "diamond": lambda: np.abs(dx) + np.abs(dy) <= r,
        "hstripes": lambda: box & ((yy // period) % 2 == 0),
        "vstripes": lambda: box & ((xx // period) % 2 == 0),
        "checker": lambda: box & (((xx // period) + (yy // period)) % 2 == 0),
        "x": lambda: box & (np.abs(np.abs(dx) - np.abs(dy)) <= max(1.0, r / 4)),
    }
    if kind not in masks:
        raise ValueError(f"unknown shape {kind!r}; use one of {SHAPES}")
    return masks[kind]()


#: Filled polygons of the COCO generator (polygons, so its annotations are exact): name, corners,
#: rotation in degrees, and inner radius (below 1 for stars, whose corners alternate two radii).
POLYGON_SHAPES = (
    "square",
    "triangle",
    "circle",
    "star",
    "hexagon",
    "diamond",
    "pentagon",
    "cross",
    "octagon",
    "kite",
)
_CORNERS = (4, 3, 24, 10, 6, 4, 5, 12, 8, 4)
_ROTATION = (45.0, -90.0, 0.0, -90.0, 0.0, 0.0, -90.0, 0.0, 22.5, 90.0)
_INNER = (1.0, 1.0, 1.0, 0.45, 1.0, 1.0, 1.0, 0.5, 1.0, 0.6)


def polygon_points(kind: int, cx: float, cy: float, r: float) -> list[float]:
    """COCO polygon ``[x0, y0, x1, y1, ...]`` of ``POLYGON_SHAPES[kind]`` with radius ``r`` centred at ``(cx, cy)``."""
    points: list[float] = []
    for k in range(_CORNERS[kind]):
        radius = r * (_INNER[kind] if k % 2 else 1.0)
        angle = math.radians(_ROTATION[kind] + 360.0 * k / _CORNERS[kind])
        points += [round(cx + radius * math.cos(angle), 2), round(cy + radius * math.sin(angle), 2)]
    return points


def noisy_background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A dim, noisy ``uint8`` ``(H, W, 3)`` background of random tint, so colour alone is not the background."""
    tint = rng.integers(0, 90, size=3)
    noise = rng.normal(0, 18, size=(height, width, 3))
    return np.clip(tint + noise, 0, 255).astype(np.uint8)


def paint(
    canvas: np.ndarray, mask: np.ndarray, colour: tuple[int, int, int], rng: np.random.Generator
) -> None:
    """Fill ``mask`` of ``canvas`` (``H, W, 3``, in place) with ``colour`` plus mild noise."""
    noise = rng.normal(0, 12, size=(int(mask.sum()), 3))
    canvas[mask] = np.clip(np.asarray(colour, dtype=np.float64) + noise, 0, 255).astype(np.uint8)


def draw_class_image(rng: np.random.Generator, cls: int, size: int) -> np.ndarray:
    """A ``uint8`` ``(size, size, 3)`` image of class ``cls``: its shape in its colour, randomly placed and sized."""
    canvas = noisy_background(rng, size, size)
    r = rng.uniform(0.22, 0.36) * size
    margin = math.ceil(r)
    cy, cx = rng.uniform(margin, size - margin, size=2) if size > 2 * margin else (size / 2, size / 2)
    mask = shape_mask(SHAPES[cls % len(SHAPES)], size, size, float(cy), float(cx), r)
    paint(canvas, mask, class_colour(cls), rng)
    return canvas
