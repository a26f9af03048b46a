"""Pictures of a run: ``curves.png`` (loss and the task's metric per epoch) and ``samples.png`` (predictions).

Written at the end of training (:class:`~gputrain.engine.callbacks.pictures.PicturesHook`) and by
``gputrain report RUN_DIR`` (:mod:`gputrain.tools.report`). Curves come from ``metrics.jsonl``: one record per epoch, the last
one kept where a resumed run logged an epoch again, so a run resumed any number of times draws one
continuous curve. Samples are validation images spread over the set, drawn by the task's ``draw``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from gputrain.extras import require
from gputrain.runs.records import read_metrics as read_metrics  # what report and the pictures hook read

METRICS = ("val/accuracy", "val/top5", "val/mIoU", "val/pixel_acc", "val/bbox_mAP", "val/segm_mAP")
"""Task metrics drawn beside the losses, where a run logged them."""
LOSSES = ("train/loss", "val/loss")

Picture = tuple[torch.Tensor, str]
"""A ``uint8 (3, H, W)`` picture and its caption."""


def epoch_curves(records: Sequence[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """``name -> (epochs, values)`` for the losses and task metrics; one point per epoch, the last logged wins."""
    by_epoch: dict[int, dict[str, Any]] = {}
    for r in records:
        if "time/epoch_s" in r:  # epoch records; step records carry no epoch timing
            by_epoch[int(r["epoch"])] = r
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for name in (*LOSSES, *METRICS):
        points = [(e, float(r[name])) for e, r in sorted(by_epoch.items()) if r.get(name) is not None]
        if points:
            curves[name] = ([e for e, _ in points], [v for _, v in points])
    return curves


def _pyplot(what: str) -> Any:
    require("matplotlib", what)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def membership_marks(records: Sequence[dict[str, Any]]) -> list[float]:
    """Where an elastic job's workers restarted, on the epoch axis: mid-way through the epoch it happened in."""
    from gputrain.runs.membership import changes

    return [int(r.get("epoch", 0)) + 0.5 for r in changes(list(records))]


def plot_curves(curves: dict[str, tuple[list[int], list[float]]], path: Path, title: str = "",
                marks: Sequence[float] = ()) -> Path:
    """``curves.png``: losses on the left, task metrics on the right (when there are any); ``marks``: the epochs
    where an elastic job's membership changed, as dashed lines."""
    plt = _pyplot("curves.png")
    fig = curves_figure(curves, title, marks)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def curves_figure(curves: dict[str, tuple[list[int], list[float]]], title: str = "", marks: Sequence[float] = ()) -> Any:
    """The matplotlib figure of :func:`plot_curves` (the caller closes it)."""
    plt = _pyplot("curves.png")
    from matplotlib.ticker import MaxNLocator

    metrics = [n for n in curves if n not in LOSSES]
    fig, axes = plt.subplots(1, 2 if metrics else 1, figsize=(9 if metrics else 5, 3.4), squeeze=False)
    for ax, names, label in ((axes[0][0], [n for n in LOSSES if n in curves], "loss"),
                             *([(axes[0][1], metrics, "metric")] if metrics else [])):
        for name in names:
            epochs, values = curves[name]
            ax.plot(epochs, values, "o-", markersize=3, label=name)
        values = [v for n in names for v in curves[n][1]]
        if label == "loss" and values and min(values) > 0 and max(values) > 20 * min(values):
            ax.set_yscale("log")  # a spike (or a fast first epoch) would flatten the rest to a line
        for i, x in enumerate(marks):  # an elastic job's restarts (runs/membership.py)
            ax.axvline(x, color="grey", linestyle="--", linewidth=1, label="nodes changed" if i == 0 else None)
        ax.set_xlabel("epoch")
        # Whole epochs only, also when one epoch leaves a single whole number in view (min_n_ticks=1).
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if names or marks:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _one(x: Any, i: int) -> Any:
    if isinstance(x, dict):
        return {k: _one(v, i) for k, v in x.items()}
    return x[i]


def sample_pictures(task: Any, model: nn.Module, val_data: Dataset, count: int, device: torch.device,
                    forward_context: Callable[[], Any] | None = None) -> list[Picture]:
    """``count`` validation samples spread evenly over the set, predicted by ``model`` (put in eval mode here) and drawn by the task.

    Every rank of a run may call it with the same arguments: it reads no random state.
    """
    collate = task.collate_fn() or default_collate
    model.eval()
    pictures = []
    n = len(val_data)  # type: ignore[arg-type]
    # Spread over the set (neighbours are often alike: frames of one video, one class folder).
    for i in sorted({k * n // count for k in range(count)}) if count > 0 else []:
        # One image a forward: validation images may differ in size, and eval mode makes it the same.
        inputs, targets = task.split_batch(collate([val_data[i]]))
        if not _is_image(inputs[0]):  # a vector, a sequence: nothing samples.png could draw
            return []
        with torch.no_grad(), (forward_context() if forward_context else contextlib.nullcontext()):
            outputs = model([x.to(device) for x in inputs]) if task.targets_to_model else model(inputs.to(device))
        pictures.append(task.draw(task.display(inputs[0]), task.prediction(_one(outputs, 0), _size(inputs[0])),
                                  _one(targets, 0)))
    return pictures


def _is_image(x: Any) -> bool:
    """An image the tasks draw: a (C, H, W) tensor of 1 to 4 channels."""
    return isinstance(x, torch.Tensor) and x.dim() == 3 and 1 <= int(x.shape[0]) <= 4


def _size(image: torch.Tensor) -> tuple[int, int]:
    return int(image.shape[-2]), int(image.shape[-1])


def samples_figure(pictures: Sequence[Picture]) -> Any:
    """A matplotlib figure of the pictures with their captions, four to a row."""
    plt = _pyplot("samples.png")
    columns = min(4, len(pictures))
    rows = -(-len(pictures) // columns)
    widest = max(p.shape[2] / p.shape[1] for p, _ in pictures)
    fig, axes = plt.subplots(rows, columns, figsize=(2.4 * columns * min(widest, 2.5), 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (picture, caption) in zip(axes.flat, pictures, strict=False):
        ax.imshow(picture.permute(1, 2, 0).numpy())
        ax.set_title(caption, fontsize=8)
    fig.tight_layout()
    return fig


def figure_array(fig: Any) -> Any:
    """The figure as an ``(H, W, 3)`` uint8 numpy array (what TensorBoard and W&B are given), closed after."""
    import numpy as np

    fig.canvas.draw()
    array = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    _pyplot("samples.png").close(fig)
    return array


def save_samples(pictures: Sequence[Picture], path: Path) -> Path:
    fig = samples_figure(pictures)
    fig.savefig(path, dpi=100)
    _pyplot("samples.png").close(fig)
    return path
