"""Pictures of a run: curves.png from metrics.jsonl (one point per epoch across resumes), samples.png, TensorBoard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from gputrain import Trainer
from gputrain.cli import main
from gputrain.config import OptimConfig, RunConfig, load_config
from gputrain.data.imagefolder import make_frames
from gputrain.models.vision import ConvAutoencoder
from gputrain.tasks.autoencoder import ReconstructionTask
from gputrain.tools.report import epoch_curves, read_metrics
from gputrain.tools.train import train_from_config

torch.set_num_threads(1)


class _Images(torch.utils.data.Dataset):
    def __init__(self, n: int = 12) -> None:
        self.x = torch.rand(n, 3, 20, 20, generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def _fit(out: Path, epochs: int, resume: str = "", loggers: tuple[str, ...] = ()) -> None:
    torch.manual_seed(0)
    Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.1)), accelerator="cpu", batch_size=4, epochs=epochs,
            out=str(out), progress_bar=False, loggers=list(loggers), resume=resume, pictures=4).fit(
        ConvAutoencoder(), _Images(), _Images(8), task=ReconstructionTask())


def _png_size(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    with Image.open(path) as im:
        return im.size


def test_curves_have_one_point_per_epoch_across_a_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fit(out, epochs=2)
    _fit(out, epochs=4, resume="auto")
    curves = epoch_curves(read_metrics(out / "metrics.jsonl"))
    assert curves["train/loss"][0] == [1, 2, 3, 4]
    assert curves["val/loss"][0] == [1, 2, 3, 4]
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in epochs if "time/epoch_s" in r][-1]
    assert curves["val/loss"][1][-1] == last["val/loss"]
    width, height = _png_size(out / "curves.png")
    assert 300 <= width <= 2000 and 200 <= height <= 1200
    width, height = _png_size(out / "samples.png")  # 4 pictures of input | reconstruction
    assert 300 <= width <= 3000 and 100 <= height <= 1500


def test_an_epoch_logged_again_after_a_resume_counts_once() -> None:
    records = [{"epoch": 1, "step": 3, "train/loss": 9.0},  # a step record: not a point
               {"epoch": 1, "time/epoch_s": 1, "train/loss": 2.0, "val/loss": 2.5},
               {"epoch": 2, "time/epoch_s": 1, "train/loss": 1.5, "val/loss": 2.0},
               {"epoch": 2, "time/epoch_s": 1, "train/loss": 1.4, "val/loss": 1.9, "val/accuracy": 0.5}]
    curves = epoch_curves(records)
    assert curves["train/loss"] == ([1, 2], [2.0, 1.4])
    assert curves["val/accuracy"] == ([2], [0.5])


def test_tensorboard_receives_the_sample_grid_at_each_evaluation(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _fit(tmp_path / "run", epochs=2, loggers=("tensorboard",))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert "val/samples" in events.Tags()["images"]
    images = events.Images("val/samples")
    assert len(images) == 2 and images[0].width > 100 and images[0].height > 50


def test_wandb_receives_the_sample_grid_at_each_evaluation(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fit(tmp_path / "run", epochs=2, loggers=("wandb",))
    media = list((tmp_path / "run" / "wandb").glob("wandb/offline-run-*/files/media/images/val/samples_*.png"))
    assert len(media) == 2 and all(_png_size(m)[0] > 100 for m in media)


def test_report_command_redraws_a_recipe_run(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    make_frames(tmp_path / "frames", count=12, size=20, videos=2)
    cfg = load_config("autoencoder", ["data.root=frames", "trainer.out=run", "trainer.epochs=2",
                                      "trainer.batch_size=4", "trainer.accelerator=cpu", "trainer.progress_bar=false",
                                      "trainer.loggers=[]", "trainer.pictures=0"])
    train_from_config(cfg)
    assert not (tmp_path / "run" / "curves.png").exists()  # trainer.pictures=0 draws nothing
    assert main(["report", "run", "--samples", "3"]) == 0
    assert _png_size(tmp_path / "run" / "curves.png")[0] >= 300
    assert _png_size(tmp_path / "run" / "samples.png")[0] >= 300
    assert main(["report", "nothing-here"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing-here has no metrics.jsonl" in err[0]


@pytest.mark.parametrize("epochs", [[1], [1, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]])
def test_the_epoch_axis_has_whole_epochs_only(epochs) -> None:
    """issue 28 item 10: a run of one epoch was drawn with ticks at 0.96, 0.98, 1.00, ... Planted fault: the integer
    locator gives up (and falls back to fractions) when one whole number is in view."""
    import matplotlib.pyplot as plt

    from gputrain.runs.pictures import curves_figure

    fig = curves_figure({"train/loss": (epochs, [1.0 / e for e in epochs]), "val/accuracy": (epochs, [0.5] * len(epochs))})
    fig.canvas.draw()
    for ax in fig.axes:
        low, high = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if low <= t <= high]
        assert shown and all(float(t).is_integer() for t in shown), shown
    plt.close(fig)


# -- curves from metrics.jsonl, known answers (issue 28 item 11) ---------------------------------------------------
def test_a_line_cut_short_by_a_crash_is_skipped_and_the_resumed_records_after_it_are_read(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"epoch": 1, "step": 2, "time/epoch_s": 1.0, "train/loss": 3.0, "val/loss": 3.5}\n'
        '{"epoch": 2, "step": 4, "time/epoch_s": 1.0, "train/lo\n'  # the crash cut this line; the resume appended on
        '{"epoch": 2, "step": 4, "time/epoch_s": 1.0, "train/loss": 2.0, "val/loss": 2.5}\n'
        '{"epoch": 3, "step": 6, "time/epoch_s": 1.0, "train/loss": 1.0, "val/loss": 1.5}\n',
        encoding="utf-8")
    assert [r["epoch"] for r in read_metrics(metrics)] == [1, 2, 3]
    assert epoch_curves(read_metrics(metrics)) == {"train/loss": ([1, 2, 3], [3.0, 2.0, 1.0]),
                                                   "val/loss": ([1, 2, 3], [3.5, 2.5, 1.5])}


def test_an_unfinished_epoch_and_a_non_finite_value_draw_no_point() -> None:
    records = [{"epoch": 1, "step": 2, "time/epoch_s": 1.0, "train/loss": 2.0, "val/loss": None,  # NaN, as logged
                "val/mIoU": 0.25},
               {"epoch": 2, "step": 3, "train/loss": 1.5},  # step records of an epoch the run never finished
               {"epoch": 2, "step": 4, "train/loss": 1.25}]
    assert epoch_curves(records) == {"train/loss": ([1], [2.0]), "val/mIoU": ([1], [0.25])}


def _svg_panels(curves: dict, tmp_path: Path) -> list[str]:
    """The text matplotlib writes for each panel (axes) of ``plot_curves`` as SVG: legend names and tick labels."""
    import re

    from gputrain.tools.report import plot_curves

    svg = plot_curves(curves, tmp_path / "curves.svg").read_text(encoding="utf-8")
    panels = re.split(r'<g id="axes_\d+">', svg)[1:]
    return [" | ".join(re.findall(r"<!-- (.*?) -->", p)) for p in panels]


def test_losses_are_drawn_left_and_the_task_metric_right_and_a_spike_puts_the_losses_on_a_log_axis(tmp_path) -> None:
    epochs = [1, 2, 3, 4, 5]
    (losses, metric) = _svg_panels({"train/loss": (epochs, [5.0, 4.0, 3.0, 2.0, 1.0]),
                                    "val/loss": (epochs, [5.5, 4.5, 3.5, 2.5, 1.5]),
                                    "val/accuracy": (epochs, [0.01, 0.1, 0.2, 0.4, 0.5])}, tmp_path)
    assert "train/loss" in losses and "val/loss" in losses and "val/accuracy" not in losses
    assert "val/accuracy" in metric and "loss" not in metric
    assert "10^" not in losses and "10^" not in metric  # 5x between the ends: linear axes
    (spiked,) = _svg_panels({"train/loss": (epochs, [100.0, 2.0, 1.5, 1.2, 1.0])}, tmp_path)
    assert "10^{0}" in spiked and "10^{2}" in spiked  # 100x: a log axis, so the epochs after the spike show


def test_a_run_whose_inputs_are_no_images_ends_with_curves_and_no_samples_picture(tmp_path: Path) -> None:
    """A Python-API run on vectors (a TensorDataset) once ended in a traceback from the samples picture."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from gputrain import Trainer
    from gputrain.tasks.classification import ClassificationTask

    x = torch.randn(40, 12, generator=torch.Generator().manual_seed(0))
    y = (x.sum(1) > 0).long()
    # docs/recipes.md's task of your own: the classification task, which draws its samples, on vectors.
    Trainer(out=str(tmp_path / "run"), accelerator="cpu", epochs=1, batch_size=8, progress_bar=False).fit(
        nn.Linear(12, 2), TensorDataset(x[:30], y[:30]), TensorDataset(x[30:], y[30:]),
        task=ClassificationTask(num_classes=2))
    assert (tmp_path / "run" / "curves.png").is_file() and not (tmp_path / "run" / "samples.png").exists()
