"""``gputrain predict``: run a checkpoint on image files, with its own config and evaluation preprocessing.

Inputs are shared out by the strategy's evaluation sampler (every image on exactly one rank),
each rank keeps a compact result per image (top-5, a label map, detections, a reconstruction),
and rank 0 gathers them and the task writes its files (``Task.write_predictions``). The model
runs as in ``gputrain eval``: eval mode, the checkpoint's precision, the same preprocessing
function the task's validation data uses, so predictions of a validation set score exactly as
``gputrain eval`` does.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gputrain.config import RunConfig
from gputrain.data.images import DECODABLE_SUFFIXES, DataError, image_size, read_image_rgb

OUTPUTS = ("predictions.csv", "predictions.json", "masks", "overlays", "reconstructions", "inputs.csv")
"""What predict writes into --out (and what --overwrite removes first)."""


@dataclasses.dataclass(frozen=True)
class InputImage:
    path: Path
    """The file, as given or as found under a given folder (the ``file`` column)."""
    stem: str
    """Its output name: the file's stem, made unique with ``_2``, ``_3``... where stems repeat."""


def list_inputs(paths: Sequence[str]) -> list[InputImage]:
    """Every image named or found (sorted) under the folders named, in the order given; one line per problem."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DECODABLE_SUFFIXES)
            if not found:
                raise DataError(f"--input {path} holds no images ({', '.join(DECODABLE_SUFFIXES)}); name image "
                                "files or a folder that has some")
            files += found
        elif path.is_file():
            if path.suffix.lower() not in DECODABLE_SUFFIXES:
                raise DataError(f"--input {path} is not an image gputrain can read ({', '.join(DECODABLE_SUFFIXES)})")
            files.append(path)
        else:
            raise FileNotFoundError(f"--input {path} does not exist; name image files or folders of images")
    taken: set[str] = set()
    inputs = []
    for f in files:
        stem, n = f.stem, 1
        while stem in taken:  # a/x, b/x, c/x_2: x, x_2, x_2_2 (not a second x_2, whose files would overwrite)
            n += 1
            stem = f"{f.stem}_{n}"
        taken.add(stem)
        inputs.append(InputImage(f, stem))
    return inputs


def write_renamed(inputs: Sequence[InputImage], out: Path) -> None:
    """Where file names repeat (``video_00/frame_0000.png``, ``video_01/frame_0000.png``), the outputs are named
    ``frame_0000``, ``frame_0000_2``...: ``inputs.csv`` maps every output name to its file, and one line says so."""
    renamed = [item for item in inputs if item.stem != item.path.stem]
    if not renamed:
        return
    with (out / "inputs.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["name", "file"])
        writer.writerows([item.stem, str(item.path)] for item in inputs)
    print(f"gputrain: {len(renamed)} input(s) share a file name with another, so their outputs are named "
          f"{renamed[0].stem} and the like; {out / 'inputs.csv'} names the file of each output", flush=True)


def check_readable(inputs: Sequence[InputImage]) -> None:
    """Read every header before workers start: an unreadable file is one line naming it (bodies fail later)."""
    for item in inputs:
        image_size(item.path)


class InputImages(Dataset[tuple[int, torch.Tensor, tuple[int, int]]]):
    """``(index, preprocessed image, (H, W) of the file)``; decoding errors name the file."""

    def __init__(self, inputs: Sequence[InputImage], preprocess: Callable[[torch.Tensor], Any]) -> None:
        self.inputs, self.preprocess = list(inputs), preprocess

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, tuple[int, int]]:
        image = read_image_rgb(self.inputs[index].path)
        return index, self.preprocess(image), (int(image.shape[1]), int(image.shape[2]))


def _per_image(outputs: Any, n: int) -> list[Any]:
    """A batch's outputs split into one per image (a list, a dict of batched tensors, or a tensor)."""
    if isinstance(outputs, list):
        return outputs
    if isinstance(outputs, dict):
        return [{k: v[i] for k, v in outputs.items()} for i in range(n)]
    return [outputs[i] for i in range(n)]


def forward_images(task: Any, model: nn.Module, images: list[torch.Tensor], device: torch.device, *,
                   channels_last: bool = False) -> list[Any]:
    """The model's output for each image: a list for detection models, a stacked batch where shapes agree.

    ``channels_last``: batches in the layout the model was put in (the run's ``trainer.channels_last``).
    """
    from gputrain.engine.fast import to_memory_format

    if task.targets_to_model:  # detection models take a list of images of any sizes
        return model([im.to(device) for im in images])
    if len({tuple(im.shape) for im in images}) == 1:
        return _per_image(model(to_memory_format(torch.stack(images).to(device), channels_last)), len(images))
    return [_per_image(model(to_memory_format(im[None].to(device), channels_last)), 1)[0] for im in images]


def predict_from_config(cfg: RunConfig, checkpoint: str | Path, state: dict[str, Any], paths: Sequence[str],
                        out: str | Path, *, annotations: str = "") -> int:
    """Predict every input on this process's share; rank 0 writes into ``out``. Returns the images predicted."""
    from gputrain.dist import comm, init_distributed, teardown
    from gputrain.engine.setup import build_runtime
    from gputrain.tasks import prediction_task
    from gputrain.tools.from_checkpoint import build_fitting_model

    dist = init_distributed(cfg.trainer.accelerator, timeout_s=cfg.trainer.timeout_s)
    try:
        inputs = list_inputs(paths)
        task, preprocess = prediction_task(cfg, annotations=annotations)
        # The run resolved as `gputrain eval` resolves it (the checkpoint's config: channels-last where it trained so).
        loop = build_runtime(cfg, dist, task, build_fitting_model(cfg, state, checkpoint))
        strategy = loop.strategy
        model = strategy.eval_module(strategy.setup_module(loop.module))
        model.eval()
        data = InputImages(inputs, preprocess)
        loader = DataLoader(data, batch_size=cfg.trainer.eval_batch_size or cfg.trainer.batch_size,
                            sampler=strategy.eval_sampler(len(data)), collate_fn=list,
                            num_workers=int(loop.cfg.data.num_workers))
        results: dict[int, Any] = {}
        with torch.no_grad():
            for batch in loader:
                with loop.precision.forward_context():
                    outputs = forward_images(task, model, [b[1] for b in batch], strategy.root_device,
                                             channels_last=loop.fast.channels_last)
                for (index, _, size), output in zip(batch, outputs, strict=True):
                    results[index] = task.prediction(output, size)  # small and on the CPU: it is gathered
        gathered = comm.gather_objects(results)
        if gathered is not None and dist.is_main:
            merged = {k: v for part in gathered for k, v in part.items()}
            Path(out).mkdir(parents=True, exist_ok=True)
            written = task.write_predictions(inputs, [merged[i] for i in range(len(inputs))], Path(out))
            print(f"gputrain: predicted {len(inputs)} image(s); wrote {written}", flush=True)
            write_renamed(inputs, Path(out))
        comm.barrier()
        return len(inputs)
    finally:
        teardown()
