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


def steady_throughput(metrics_path: Path) -> float:
    """Images/s over epoch records after the first (all of them if there is only one)."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    epochs = [r for r in records if "time/train_s" in r]
    if not epochs:
        raise ValueError(f"{metrics_path} has no epoch records; did the run finish?")
    steady = epochs[1:] or epochs
    return sum(r["train/samples"] for r in steady) / sum(r["time/train_s"] for r in steady)


def add_speedup(rows: list[ScaleRow]) -> None:
    """Fill speedup and efficiency against the 1-device row of the same batch size."""
    base = {r.batch_size: r.images_per_s for r in rows if r.devices == 1}
    for r in rows:
        if r.batch_size in base and base[r.batch_size] > 0:
            r.speedup = r.images_per_s / base[r.batch_size]
            r.efficiency = r.speedup / r.devices


def markdown_table(rows: list[ScaleRow]) -> str:
    lines = [
        "| devices | batch size (per device) | iters per epoch (train + val) | total training time | start-up "
        "| images/s | speedup | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.devices} | {r.batch_size} | {r.iters_per_epoch} | {r.train_time_s:.1f} s | {r.startup_s:.1f} s "
            f"| {r.images_per_s:.0f} | {r.speedup:.2f} | {r.efficiency:.2f} |"
        )
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


def scale_bench(recipe: str, *, devices: list[int], batch_sizes: list[int], out: str | Path,
                overrides: list[str], accelerator: str = "auto", epochs: int = 2) -> list[ScaleRow]:
    from gputrain.config import load_config

    if load_config(recipe, overrides).trainer.strategy == "dp" and any(d > 1 for d in devices):
        raise ValueError(
            f"recipe {recipe} uses strategy dp (one process driving several GPUs), so --devices does not change it; "
            "scale it with trainer.strategy=ddp, or vary trainer.dp_device_ids in separate runs"
        )
    out = Path(out)
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
                raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr[-3000:]}")
            summary = json.loads((run / "summary.json").read_text())
            rows.append(ScaleRow(
                devices=d, batch_size=b, iters_per_epoch=summary["iters_per_epoch"]["total"],
                train_time_s=summary["wall_s"], startup_s=wall - summary["wall_s"],
                images_per_s=steady_throughput(run / "metrics.jsonl"),
            ))
            print(f"devices={d} batch={b}: {rows[-1].images_per_s:.0f} images/s", flush=True)
    add_speedup(rows)
    table = markdown_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    (out / "scale.md").write_text(table + "\n")
    plot(rows, out / "scale.png")
    print(table)
    print(f"saved {out / 'scale.json'}, {out / 'scale.md'}, {out / 'scale.png'}")
    return rows
