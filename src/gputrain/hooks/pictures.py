"""``curves.png`` and ``samples.png`` at the end of training, and the sample grid the image loggers receive.

Every rank runs the same sample forwards (a strategy whose forward issues collectives needs all of
them), in eval mode and without touching random state, so drawing never changes what is trained;
rank 0 draws and writes. A task draws only if it defines ``draw`` (a model trained from Python on
arbitrary inputs gets curves alone), and a strategy whose rank 0 sees no outputs (a pipeline) gets
curves alone too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gputrain.hooks.base import Hook
from gputrain.preflight import MissingExtra, installed
from gputrain.tasks.base import Task

if TYPE_CHECKING:
    from gputrain.loop import Trainer

MISSING = "gputrain: curves.png and samples.png need matplotlib: pip install 'gputrain[plot]'"


def run_pictures(trainer: Trainer) -> list[Any] | None:
    """The sample pictures of the current model (rank 0; None elsewhere, or when this run cannot draw them)."""
    from gputrain.tools.report import sample_pictures

    count, task = trainer.cfg.trainer.pictures, trainer.task
    val = getattr(trainer.val_loader, "dataset", None)
    strategy = trainer.strategy
    if not count or val is None or type(task).draw is Task.draw:
        return None
    if not strategy.broadcast_object(strategy.computes_loss):  # rank 0 of a pipeline holds the first stage only
        return None
    module = strategy.eval_module(trainer.module)
    pictures = sample_pictures(task, module, val, count, strategy.root_device, trainer.precision.forward_context)
    trainer.module.train()
    return pictures if trainer.dist.is_main else None


def samples_image(trainer: Trainer) -> Any:
    """The samples grid as an ``(H, W, 3)`` uint8 array, for TensorBoard and W&B (rank 0; None elsewhere)."""
    if not installed("matplotlib"):  # the same answer on every rank: all skip the forwards together
        return None
    pictures = run_pictures(trainer)
    if not pictures:
        return None
    from gputrain.tools.report import figure_array, samples_figure

    return figure_array(samples_figure(pictures))


class PicturesHook(Hook):
    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if not trainer.cfg.trainer.pictures:
            return
        if not installed("matplotlib"):
            if trainer.dist.is_main:
                print(MISSING, flush=True)
            return
        from gputrain.tools.report import epoch_curves, plot_curves, read_metrics, save_samples

        pictures = run_pictures(trainer)
        if not trainer.dist.is_main:
            return
        try:
            curves = epoch_curves(read_metrics(trainer.out / "metrics.jsonl"))
            if curves:
                plot_curves(curves, trainer.out / "curves.png", title=trainer.out.resolve().name)
            if pictures:
                save_samples(pictures, trainer.out / "samples.png")
        except MissingExtra:
            print(MISSING, flush=True)
