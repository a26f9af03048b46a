"""Write an ImageNet-like class folder for GPU input-pipeline figures: 10 classes of 500x375 JPEGs (quality 90).

``D=/tmp/gpudata PER_CLASS=1000 python3 scripts/imagenet_like.py`` writes ``$D/imagenet-like/classNN/*.jpg``,
in chunks of 50 over every core (the drawing and encoding are CPU-bound). Folder ``classNN`` holds only images of drawn
class NN, so training on it is learnable. With labels unrelated to the pixels (an earlier version of this
script), a ResNet-50 run at the recipe's learning rate ended with a NaN loss within 10 steps on an H100.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
from torchcodec.encoders import JpegEncoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gputrain.data.images import draw_class_image  # noqa: E402

WIDTH, HEIGHT = 500, 375


CHUNK = 50
"""Images drawn by one task: every core works, where one process per class used 10 of a lent machine's 16."""


def one_chunk(job: tuple[int, int]) -> None:
    index, start = job
    folder = Path(os.environ["D"]) / "imagenet-like" / f"class{index:02d}"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng((index, start))
    for i in range(start, min(start + CHUNK, int(os.environ.get("PER_CLASS", "1000")))):
        drawn = torch.from_numpy(draw_class_image(rng, index, WIDTH)).permute(2, 0, 1)
        JpegEncoder(drawn[:, :HEIGHT].contiguous()).to_file(folder / f"{i:05d}.jpg", quality=90)


if __name__ == "__main__":
    started = time.perf_counter()
    per_class = int(os.environ.get("PER_CLASS", "1000"))
    jobs = [(index, start) for index in range(10) for start in range(0, per_class, CHUNK)]
    # One thread per process: a pool of processes each with torch's default of one thread per core would
    # oversubscribe the machine.
    with Pool(os.cpu_count() or 1, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        pool.map(one_chunk, jobs, chunksize=1)
    print(f"imagenet_like.py: {10 * per_class} JPEGs of {WIDTH}x{HEIGHT} in {time.perf_counter() - started:.1f} s "
          f"on {os.cpu_count()} cores", flush=True)
