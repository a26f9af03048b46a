"""``curves.png`` and ``samples.png`` at the end of training, and the sample grid the image loggers receive.

Every rank runs the same sample forwards (a strategy whose forward issues collectives needs all of them), in eval
mode and without touching random state, so drawing never changes what is trained; rank 0 draws and writes. A
task draws only if it defines ``draw`` (a model trained from Python on arbitrary inputs gets curves alone), and a
strategy whose rank 0 sees no outputs (a pipeline) gets curves alone too.
"""

from __future__ import annotations

from typing import Any

from gputrain.engine.hooks import Hook, RunContext
from gputrain.errors import MissingExtra
from gputrain.extras import installed

MISSING = "gputrain: curves.png and samples.png need matplotlib: pip install 'gputrain[plot]'"


def samples_image(ctx: RunContext) -> Any:
    """The samples grid as an ``(H, W, 3)`` uint8 array, for TensorBoard and W&B (rank 0; None elsewhere)."""
    if not installed("matplotlib"):  # the same answer on every rank: all skip the forwards together
        return None
    pictures = ctx.sample_pictures(ctx.cfg.trainer.pictures)
    if not pictures:
        return None
    from gputrain.runs.pictures import figure_array, samples_figure

    return figure_array(samples_figure(pictures))


class PicturesHook(Hook):
    def after_fit(self, ctx: RunContext, summary: dict[str, Any]) -> None:
        if not ctx.cfg.trainer.pictures:
            return
        if not installed("matplotlib"):
            if ctx.dist.is_main:
                print(MISSING, flush=True)
            return
        from gputrain.runs.pictures import (
            epoch_curves,
            membership_marks,
            plot_curves,
            read_metrics,
            save_samples,
        )

        pictures = ctx.sample_pictures(ctx.cfg.trainer.pictures)
        if not ctx.dist.is_main:
            return
        try:
            records = read_metrics(ctx.out / "metrics.jsonl")
            curves = epoch_curves(records)
            if curves:
                plot_curves(curves, ctx.out / "curves.png", title=ctx.out.resolve().name,
                            marks=membership_marks(records))
            if pictures:
                save_samples(pictures, ctx.out / "samples.png")
        except MissingExtra:
            print(MISSING, flush=True)
