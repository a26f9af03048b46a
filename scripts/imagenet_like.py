"""Write an ImageNet-like class folder for GPU input-pipeline figures: 10 classes of 500x375 JPEGs (quality 90).

``D=/tmp/gpudata PER_CLASS=1000 python3 scripts/imagenet_like.py`` writes ``$D/imagenet-like/classNN/*.jpg``,
one process per class (the drawing and encoding are CPU-bound). Folder ``classNN`` holds only images of drawn
class NN, so training on it is learnable. With labels unrelated to the pixels (an earlier version of this
script), a ResNet-50 run at the recipe's learning rate ended with a NaN loss within 10 steps on an H100.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
from torchcodec.encoders import JpegEncoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gputrain.data.images import draw_class_image  # noqa: E402

WIDTH, HEIGHT = 500, 375


def one_class(index: int) -> None:
    folder = Path(os.environ["D"]) / "imagenet-like" / f"class{index:02d}"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(index)
    for i in range(int(os.environ.get("PER_CLASS", "1000"))):
        drawn = torch.from_numpy(draw_class_image(rng, index, WIDTH)).permute(2, 0, 1)
        JpegEncoder(drawn[:, :HEIGHT].contiguous()).to_file(folder / f"{i:05d}.jpg", quality=90)


if __name__ == "__main__":
    with Pool(min(os.cpu_count() or 1, 10)) as pool:
        pool.map(one_class, range(10))
