"""``gputrain report RUN_DIR``: redraw ``curves.png`` and ``samples.png`` of a run (:mod:`gputrain.runs.pictures`)."""

from __future__ import annotations

from pathlib import Path

import torch

from gputrain.extras import require
from gputrain.runs.pictures import (
    epoch_curves,
    membership_marks,
    plot_curves,
    read_metrics,
    sample_pictures,
    save_samples,
)


def report_run(run_dir: str | Path, *, samples: int = 8) -> list[Path]:
    """``gputrain report``: curves.png from metrics.jsonl, samples.png from checkpoints/last.pt (one process)."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{run} has no metrics.jsonl; give the folder of a gputrain run (e.g. runs/latest)")
    require("matplotlib", "gputrain report")
    records = read_metrics(metrics)
    curves = epoch_curves(records)
    if not curves:
        raise ValueError(f"{metrics} has no epoch records yet; report a run that finished at least one epoch")
    written = [plot_curves(curves, run / "curves.png", title=run.resolve().name, marks=membership_marks(records))]
    checkpoint = run / "checkpoints" / "last.pt"
    drawn = _samples_of_checkpoint(checkpoint, run, samples) if samples > 0 and checkpoint.is_file() else None
    written += [drawn] if drawn is not None else []
    for path in written:
        print(f"gputrain: wrote {path}", flush=True)
    return written


def _samples_of_checkpoint(checkpoint: Path, run: Path, count: int) -> Path | None:
    from gputrain.tasks import build_task
    from gputrain.tools.from_checkpoint import (
        PYTHON_TASK,
        config_from_checkpoint,
        load_fitting,
        load_for_eval,
        saved_config,
    )

    state = load_for_eval(checkpoint)
    if (saved_config(state) or {}).get("task") in (PYTHON_TASK, None):
        print(f"gputrain: {checkpoint} was trained from Python (or holds no config), so only its code can build the "
              "model: samples.png is written at the end of such a run, not by gputrain report", flush=True)
        return None
    cfg, _ = config_from_checkpoint(state, checkpoint, recipe=None, overrides=[], command="report")
    cfg.trainer.out = str(run)  # a task that writes its split (detection) finds it in the run again
    spec = build_task(cfg)
    if spec.val_data is None:
        raise ValueError(f"the run in {run} has no validation data to draw; set data.val_root or data.val_fraction")
    model = load_fitting(spec.model, state["model"], path=checkpoint, cfg=cfg, saved=saved_config(state))
    return save_samples(sample_pictures(spec.task, model, spec.val_data, count, torch.device("cpu")),
                        run / "samples.png")
