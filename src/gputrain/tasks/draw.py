"""Drawing one prediction on its image, with torchvision.utils; shared by the tasks' ``draw`` methods.

Every function takes and returns ``uint8 (3, H, W)`` tensors on the CPU. Class ``k`` is drawn in
:func:`~gputrain.data.images.class_colour` ``(k)``, the colour the sample-data generators paint it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torchcodec.encoders import JpegEncoder, PngEncoder
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

from gputrain.data.images import class_colour, read_image_rgb, to_uint8

SCORE_THRESHOLD = 0.5
"""Detections drawn on overlays score at least this (predictions.json keeps them all)."""


def denormalize(inputs: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """A normalized float image back to ``uint8``."""
    x = inputs.detach().float().cpu() * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


def name_of(names: Sequence[str] | None, k: int) -> str:
    return names[k] if names is not None and 0 <= k < len(names) else str(k)


def overlay_labels(image: torch.Tensor, labels: torch.Tensor, num_classes: int, alpha: float = 0.5) -> torch.Tensor:
    """``labels (H, W)`` (class indices; others, e.g. 255, left clear) blended over ``image``."""
    present = [k for k in labels.unique().tolist() if 0 <= k < num_classes]
    if not present:
        return image
    masks = torch.stack([labels == k for k in present])
    return draw_segmentation_masks(image, masks, alpha=alpha, colors=[class_colour(k) for k in present])


def draw_detections(image: torch.Tensor, output: Mapping[str, Any], names: Sequence[str] | None,
                    threshold: float = SCORE_THRESHOLD) -> torch.Tensor:
    """Boxes, masks, class names and scores of one detection output (scores >= ``threshold``)."""
    keep = output["scores"].detach().cpu() >= threshold
    boxes, labels = output["boxes"].detach().cpu()[keep], output["labels"].detach().cpu()[keep].tolist()
    if not labels:
        return image
    colours = [class_colour(int(k) - 1) for k in labels]  # label 0 is the background
    if "masks" in output:
        masks = output["masks"].detach().cpu()[keep][:, 0].float() > 0.5  # probabilities or booleans
        image = draw_segmentation_masks(image, masks, alpha=0.45, colors=colours)
    captions = [f"{name_of(names, int(k))} {s:.2f}" for k, s in
                zip(labels, output["scores"].detach().cpu()[keep].tolist(), strict=True)]
    # Black text on a box-coloured tag: text in the class colour would vanish over the object it names.
    return draw_bounding_boxes(image, boxes, labels=captions, colors=colours, width=2, label_colors="black",
                               fill_labels=True)


def side_by_side(*images: torch.Tensor, gap: int = 2) -> torch.Tensor:
    """Images of one height next to each other, with a white gap."""
    height = images[0].shape[1]
    spacer = torch.full((3, height, gap), 255, dtype=torch.uint8)
    parts: list[torch.Tensor] = []
    for i, im in enumerate(images):
        parts += [spacer, im] if i else [im]
    return torch.cat(parts, dim=2)


def write_pictures(task: Any, inputs: Sequence[Any], results: Sequence[Any], out: Path, folder: str, suffix: str) -> str:
    """Each prediction drawn by its task on the original image (JPEG for overlays, PNG for reconstructions), in
    ``out/folder/<stem><suffix>``; ``inputs[i]`` (with ``.path`` and ``.stem``) is ``results[i]``'s image. Returns the folder."""
    (out / folder).mkdir(exist_ok=True)
    for item, r in zip(inputs, results, strict=True):
        picture, _ = task.draw(to_uint8(read_image_rgb(item.path)), r)
        path = out / folder / f"{item.stem}{suffix}"
        if suffix == ".jpg":
            JpegEncoder(picture).to_file(path, quality=90)
        else:
            PngEncoder(picture).to_file(path)
    return str(out / folder)
