"""What ``gputrain predict`` writes (rank 0), one function per kind of task.

- classification: ``predictions.csv`` (``file,label,class,score`` and the top 5 as space-separated lists);
- segmentation: ``masks/<stem>.png`` in ADE20K's encoding (class ``k`` stored as ``k + 1``, 0 unlabeled)
  at the image's size, and ``overlays/<stem>.jpg``;
- detection: ``predictions.json`` in COCO results format (ids of the annotation file where the image is
  in it) and ``overlays/<stem>.jpg``;
- autoencoder (any other task): ``reconstructions/<stem>.png``, input and output side by side.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torchvision.io import write_jpeg, write_png

from gputrain.data.images import read_image_rgb
from gputrain.tasks.draw import name_of
from gputrain.tools.predict import InputImage


def write_predictions(task: Any, inputs: Sequence[InputImage], results: dict[int, Any], out: Path) -> None:
    """Write every result (``results[i]`` belongs to ``inputs[i]``) in the task's format, and say where."""
    from gputrain.tasks.classification import ClassificationTask
    from gputrain.tasks.detection import DetectionTask
    from gputrain.tasks.segmentation import SegmentationTask

    out.mkdir(parents=True, exist_ok=True)
    ordered = [results[i] for i in range(len(inputs))]
    if isinstance(task, ClassificationTask):
        written = _classification(task, inputs, ordered, out)
    elif isinstance(task, SegmentationTask):
        written = _segmentation(task, inputs, ordered, out)
    elif isinstance(task, DetectionTask):
        written = _detection(task, inputs, ordered, out)
    else:
        written = _pictures(task, inputs, ordered, out, "reconstructions", ".png")
    print(f"gputrain: predicted {len(inputs)} image(s); wrote {written}", flush=True)


def _classification(task: Any, inputs: Sequence[InputImage], results: list[Any], out: Path) -> str:
    path = out / "predictions.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["file", "label", "class", "score", "top5_labels", "top5_classes", "top5_scores"])
        for item, r in zip(inputs, results, strict=True):
            labels, scores = r["labels"].tolist(), r["scores"].tolist()
            writer.writerow([str(item.path), labels[0], name_of(task.class_names, labels[0]), f"{scores[0]:.6f}",
                             " ".join(map(str, labels)), " ".join(name_of(task.class_names, k) for k in labels),
                             " ".join(f"{s:.6f}" for s in scores)])
    return str(path)


def _segmentation(task: Any, inputs: Sequence[InputImage], results: list[Any], out: Path) -> str:
    (out / "masks").mkdir(exist_ok=True)
    for item, labels in zip(inputs, results, strict=True):
        # ADE20K's encoding: stored value k + 1 for class k (0 is "other", never predicted).
        write_png((labels.to(torch.int16) + 1).to(torch.uint8)[None], str(out / "masks" / f"{item.stem}.png"))
    _pictures(task, inputs, results, out, "overlays", ".jpg")
    return f"{out / 'masks'} and {out / 'overlays'}"


def _detection(task: Any, inputs: Sequence[InputImage], results: list[Any], out: Path) -> str:
    from gputrain.metrics.detection import detections_to_coco

    by_name: dict[str, list[int]] = {}
    for file_name, image_id in task.image_ids.items():
        by_name.setdefault(Path(file_name).name, []).append(image_id)
    next_id = max(task.image_ids.values(), default=0) + 1
    entries: list[tuple[int, list[dict[str, Any]]]] = []
    for item, r in zip(inputs, results, strict=True):
        ids = by_name.get(item.path.name, [])
        if len(ids) == 1:
            image_id = ids[0]
        else:  # not in the annotation file (or ambiguous): a new id past the file's
            image_id, next_id = next_id, next_id + 1
        output = {**r, "masks": r["masks"].float()} if "masks" in r else r
        entries.append((image_id, detections_to_coco(output, image_id, task.label_to_category,
                                                     with_masks="masks" in r)))
    # Sorted by image id, each image's detections in model order: the list gputrain eval scores.
    detections = [d for _, ds in sorted(entries, key=lambda e: e[0]) for d in ds]
    (out / "predictions.json").write_text(json.dumps(detections))
    _pictures(task, inputs, results, out, "overlays", ".jpg")
    return f"{out / 'predictions.json'} and {out / 'overlays'}"


def _pictures(task: Any, inputs: Sequence[InputImage], results: list[Any], out: Path, folder: str,
              suffix: str) -> str:
    """Each prediction drawn by its task on the original image (JPEG for overlays, PNG for reconstructions)."""
    (out / folder).mkdir(exist_ok=True)
    for item, r in zip(inputs, results, strict=True):
        picture, _ = task.draw(read_image_rgb(item.path), r)
        path = str(out / folder / f"{item.stem}{suffix}")
        write_jpeg(picture, path, quality=90) if suffix == ".jpg" else write_png(picture, path)
    return str(out / folder)
