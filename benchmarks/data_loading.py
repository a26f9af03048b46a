"""Decode + augment throughput of one data-loading worker: torchvision.io, PIL and TorchCodec.

Generates JPEGs into a temporary folder, then times full passes of a ``num_workers=0`` DataLoader
(so the main process is the one worker) over three variants, interleaved A B C A B C so that drift in a
shared machine's load hits all alike. One intra-op thread, as in a DataLoader worker.

    A  torchvision.io.decode_image (RGB) -> v2 RandomResizedCrop + flip on the uint8 tensor -> float, normalize
       (gputrain's decoder before issue 31, deprecated by torchvision 0.29)
    B  PIL Image.open().convert("RGB") -> the same v2 ops on the PIL image (torchvision's classic pipeline)
    C  TorchCodec (gputrain.data.images.read_image_rgb since issue 31) -> the same v2 ops as A

Usage: ``python benchmarks/data_loading.py [--images 256] [--size 128] [--pairs 7] [--json out.json]``

The figure that says how many workers a GPU needs (issue 16): ImageNet-like 500x375 JPEGs cropped to 224,
``python benchmarks/data_loading.py --images 128 --size 500x375 --crop 224 --pairs 5``; images/s of one
worker, and the workers a GPU training at a given rate needs (rate / images per second per worker).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
import torchcodec
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchcodec.encoders import JpegEncoder
from torchvision.transforms import v2

from gputrain.data.images import IMAGENET_MEAN, IMAGENET_STD, draw_class_image, read_image_rgb

CROP = 112


def augment(pil: bool, crop: int = CROP) -> v2.Compose:
    """The same training augmentation; on PIL input v2 runs the geometric ops with PIL."""
    to_tensor: list[Any] = [v2.PILToTensor()] if pil else []
    return v2.Compose(
        [
            v2.RandomResizedCrop(crop, antialias=True),
            v2.RandomHorizontalFlip(),
            *to_tensor,
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD)),
        ]
    )


class Files(Dataset[torch.Tensor]):
    def __init__(
        self, files: list[Path], decode: Callable[[Path], Any], transform: Callable[[Any], torch.Tensor]
    ):
        self.files, self.decode, self.transform = files, decode, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(self.decode(self.files[index]))


def torchvision_rgb(path: Path) -> torch.Tensor:
    # Deprecated since torchvision 0.29: the baseline measured here, imported only for it.
    from torchvision.io import ImageReadMode, decode_image, read_file

    return decode_image(read_file(str(path)), mode=ImageReadMode.RGB)


def pil_rgb(path: Path) -> Image.Image:
    with Image.open(path) as im:
        return im.convert("RGB")


def make_jpegs(folder: Path, count: int, size: int, seed: int = 0, height: int = 0) -> list[Path]:
    """``count`` JPEGs ``size`` wide and ``height`` (default: ``size``) high, at quality 90."""
    rng = np.random.default_rng(seed)
    files = []
    for i in range(count):
        drawn = torch.from_numpy(draw_class_image(rng, i % 10, size)).permute(2, 0, 1)
        pixels = drawn[:, : height or size].contiguous()
        files.append(folder / f"{i:05d}.jpg")
        JpegEncoder(pixels).to_file(files[-1], quality=90)  # the bytes torchvision.io.write_jpeg wrote
    return files


def images_per_second(dataset: Dataset[torch.Tensor], batch_size: int) -> float:
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=0, shuffle=False)
    start = time.perf_counter()
    seen = sum(len(batch) for batch in loader)
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", default="128", help="side, or WIDTHxHEIGHT (500x375: ImageNet-like)")
    parser.add_argument("--crop", type=int, default=CROP, help="RandomResizedCrop side (224 for ImageNet models)")
    parser.add_argument("--pairs", type=int, default=7, help="A/B/C rounds to time (at least 5)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.pairs < 5:
        parser.error("--pairs must be at least 5 for a meaningful median")
    torch.set_num_threads(1)
    # Variant A is torchvision.io, deprecated since 0.29 in favour of TorchCodec: the baseline, warned about once.
    warnings.filterwarnings("ignore", message="The image decoding", category=DeprecationWarning)
    torch.manual_seed(0)
    width, _, height = args.size.partition("x")
    with tempfile.TemporaryDirectory() as tmp:
        files = make_jpegs(Path(tmp), args.images, int(width), height=int(height or width))
        variants = {
            "A torchvision.io": Files(files, torchvision_rgb, augment(pil=False, crop=args.crop)),
            "B PIL": Files(files, pil_rgb, augment(pil=True, crop=args.crop)),
            "C TorchCodec": Files(files, read_image_rgb, augment(pil=False, crop=args.crop)),
        }
        for dataset in variants.values():  # warm-up: page cache, allocator, lazy imports
            images_per_second(dataset, args.batch_size)
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.pairs):
            for name, dataset in variants.items():
                rates[name].append(images_per_second(dataset, args.batch_size))
    a, b, c = rates.values()
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    codec_ratios = [z / x for z, x in zip(c, a, strict=True)]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores visible, {platform.python_version()}",
        "versions": {
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "torchcodec": torchcodec.__version__,
            "pillow": PIL.__version__,
        },
        "setup": {"images": args.images, "size": args.size, "crop": args.crop, "pairs": args.pairs, "threads": 1},
        "images_per_second": rates,
        "median_images_per_second": {name: statistics.median(r) for name, r in rates.items()},
        "median_pair_ratio_A_over_B": statistics.median(ratios),
        "median_pair_ratio_C_over_A": statistics.median(codec_ratios),
    }
    print(
        f"Decode + augment, 1 worker, 1 thread; {args.images} JPEGs {width}x{height or width} -> crop {args.crop}; "
        f"{args.pairs} interleaved rounds; {result['date']}; {result['machine']}"
    )
    print("\n| variant | median images/s | min | max |\n|---|---:|---:|---:|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.0f} | {min(r):.0f} | {max(r):.0f} |")
    print(
        f"| median per-pair ratio A/B | {result['median_pair_ratio_A_over_B']:.2f}x | {min(ratios):.2f}x | "
        f"{max(ratios):.2f}x |"
    )
    print(
        f"| median per-round ratio C/A | {result['median_pair_ratio_C_over_A']:.2f}x | {min(codec_ratios):.2f}x | "
        f"{max(codec_ratios):.2f}x |"
    )
    per_worker = statistics.median(c)  # what gputrain's loaders decode with
    print("\n| GPU trains (images/s) | workers of this speed it needs |\n|---:|---:|")
    for rate in (500, 1000, 3000):
        print(f"| {rate} | {-(-rate // per_worker):.0f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
