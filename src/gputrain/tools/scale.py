"""``gputrain bench scale``: train a recipe at several device counts and batch sizes; print an honest table.

Each combination is a separate ``gputrain train`` job, so start-up (imports, torchrun) is
measured and reported apart from training. Throughput comes from the epochs after the first
(warm-up excluded when there is more than one), speedup is against 1 device at the same
per-device batch, and efficiency is speedup divided by the device count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class ScaleRow:
    devices: int
    batch_size: int
    iters_per_epoch: int
    """Train plus validation iterations of one epoch, per process."""
    train_time_s: float
    """Training and validation time of all epochs (the fit), start-up excluded."""
    startup_s: float
    """Process start, imports, launcher and setup: job wall time minus the fit."""
    images_per_s: float
    """Training images per second over all ranks, epochs after the first."""
    speedup: float = float("nan")
    efficiency: float = float("nan")
    caution: str = ""
    """Set when the figures cannot be right (efficiency above 1): the machine was busy during a run."""


def steady_throughput(metrics_path: Path) -> float:
    """Images/s over epoch records after the first (all of them if there is only one)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    epochs = [r for r in records if "time/train_s" in r]
    if not epochs:
        raise ValueError(f"{metrics_path} has no epoch records; did the run finish?")
    steady = epochs[1:] or epochs
    return sum(r["train/samples"] for r in steady) / sum(r["time/train_s"] for r in steady)


def add_speedup(rows: list[ScaleRow]) -> None:
    """Fill speedup and efficiency against the 1-device row of the same batch size, with a caution where impossible.

    N devices cannot do more than N times the work of one; a speedup above the device count
    means the 1-device run was slowed (or the N-device run sped up) by something else on the
    machine, so the row is marked instead of reported as super-linear scaling.
    """
    base = {r.batch_size: r.images_per_s for r in rows if r.devices == 1}
    for r in rows:
        if r.batch_size in base and base[r.batch_size] > 0:
            r.speedup = r.images_per_s / base[r.batch_size]
            r.efficiency = r.speedup / r.devices
            if r.efficiency > 1.0 + 1e-9:
                r.caution = (f"speedup {r.speedup:.2f} is above the {r.devices} devices (efficiency {r.efficiency:.2f} > 1): "
                             "the machine was busy during one of the runs; rerun on a quiet machine")


def mark(row: ScaleRow) -> str:
    return " (!)" if row.caution else ""


def markdown_table(rows: list[ScaleRow]) -> str:
    lines = [
        "| devices | batch size (per device) | iters per epoch (train + val) | total training time | start-up "
        "| images/s | speedup | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.devices} | {r.batch_size} | {r.iters_per_epoch} | {r.train_time_s:.1f} s | {r.startup_s:.1f} s "
            f"| {r.images_per_s:.0f} | {r.speedup:.2f}{mark(r)} | {r.efficiency:.2f}{mark(r)} |"
        )
    if any(r.caution for r in rows):
        lines.append("\n(!) efficiency above 1 is not possible: the machine was busy during a run; rerun on a quiet machine")
    return "\n".join(lines)


def plot(rows: list[ScaleRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for b in sorted({r.batch_size for r in rows}):
        sel = sorted((r for r in rows if r.batch_size == b), key=lambda r: r.devices)
        ax.plot([r.devices for r in sel], [r.images_per_s for r in sel], "o-", label=f"batch {b}/device")
        if sel and sel[0].devices == 1:
            ax.plot([r.devices for r in sel], [sel[0].images_per_s * r.devices for r in sel], ":", color="grey")
    ax.set_xticks(sorted({r.devices for r in rows}))
    ax.set_xlabel("devices")
    ax.set_ylabel("training images/s")
    ax.set_title("scaling (dotted: linear)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _error_line(stderr: str) -> str:
    """The run's own one-line error (``gputrain: error: ...``), else its last line of output."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line.removeprefix("gputrain: error:").strip() for line in lines if line.startswith("gputrain: error:")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def _out_folder(out: str | Path | None, overwrite: bool) -> Path:
    from gputrain.run_folder import clear_run_folder, default_run_dir

    if out is None:
        return default_run_dir("scale")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; give a folder for scale.json, scale.md and the runs")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"--out {out} is not empty; pass --overwrite to replace it, or choose another --out")
        clear_run_folder(out)
    return out


def scale_bench(recipe: str, *, devices: list[int], batch_sizes: list[int], out: str | Path | None,
                overrides: list[str], accelerator: str = "auto", epochs: int = 2,
                overwrite: bool = False) -> list[ScaleRow]:
    from gputrain.config import load_config
    from gputrain.hooks.logging import strict_json
    from gputrain.preflight import install_hint, installed
    from gputrain.strategies import strategy_class

    strategy = load_config(recipe, overrides).trainer.strategy
    if any(strategy_class(strategy).processes_per_node(d) < d for d in devices):
        raise ValueError(
            f"recipe {recipe} uses strategy {strategy} (one process for all its devices), so --devices does not change "
            "it; scale it with trainer.strategy=ddp, or vary its device options (trainer.dp_device_ids) in separate runs"
        )
    can_plot = installed("matplotlib")
    if not can_plot:
        print(f"gputrain: matplotlib is not installed, so scale.png is skipped; {install_hint('matplotlib')}", flush=True)
    out = _out_folder(out, overwrite)
    rows: list[ScaleRow] = []
    for d in devices:
        for b in batch_sizes:
            run = out / f"devices{d}_batch{b}"
            cmd = [sys.executable, "-m", "gputrain", "train", recipe, f"--devices={d}", f"--batch-size={b}",
                   f"--epochs={epochs}", f"--out={run}", f"--accelerator={accelerator}",
                   "trainer.progress_bar=false", "trainer.checkpoint_every_n_epochs=0", "trainer.loggers=[]",
                   *overrides]
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if done.returncode != 0:
                raise ValueError(f"bench scale: the run with --devices {d} --batch-size {b} failed (exit "
                                 f"{done.returncode}): {_error_line(done.stderr)} (its folder: {run})")
            summary = json.loads((run / "summary.json").read_text())
            rows.append(ScaleRow(
                devices=d, batch_size=b, iters_per_epoch=summary["iters_per_epoch"]["total"],
                train_time_s=summary["wall_s"], startup_s=wall - summary["wall_s"],
                images_per_s=steady_throughput(run / "metrics.jsonl"),
            ))
            print(f"devices={d} batch={b}: {rows[-1].images_per_s:.0f} images/s", flush=True)
    add_speedup(rows)
    table = markdown_table(rows)
    (out / "scale.json").write_text(strict_json([asdict(r) for r in rows], indent=2))
    (out / "scale.md").write_text(table + "\n")
    if can_plot:
        plot(rows, out / "scale.png")
    print(table)
    for r in rows:
        if r.caution:
            print(f"caution: devices={r.devices} batch={r.batch_size}: {r.caution}")
    saved = ["scale.json", "scale.md"] + (["scale.png"] if can_plot else [])
    print(f"saved {', '.join(str(out / name) for name in saved)}")
    return rows
