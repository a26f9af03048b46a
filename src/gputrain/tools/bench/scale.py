"""``gputrain bench scale``: train a recipe at several device counts and batch sizes; print an honest table.

Each combination is a separate ``gputrain train`` job, so start-up (imports, torchrun) is
measured and reported apart from training. Throughput comes from the epochs after the first
(warm-up excluded when there is more than one), speedup is against 1 device at the same
per-device batch, and efficiency is speedup divided by the device count. Every run gets the same
threads per process (``OMP_NUM_THREADS``), stated in the table: otherwise the 1-process run would
use all cores' threads and N processes a share each (torchrun's default), and the speedups would
measure thread counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from gputrain.tools.progress import Progress


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
    threads: int = 0
    """Threads per process (``OMP_NUM_THREADS``) the run had; the same in every row of one benchmark."""


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's share), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(devices: Sequence[int], *, cores: int, env: Mapping[str, str]) -> int:
    """One thread count for every row: ``OMP_NUM_THREADS`` when set, else the cores over the largest device count.

    Giving each run its own share (all cores to 1 process, half to each of 2) would make N
    processes look up to N times faster per thread than they are, on a busy machine more.
    """
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"OMP_NUM_THREADS={given!r} must be a whole number of threads, at least 1; unset it "
                             "to let bench scale share the cores among the largest --devices")
        return int(given)
    return max(1, cores // max(devices))


def run_command(recipe: str, devices: int, batch_size: int, *, epochs: int, out: Path, accelerator: str,
                threads: int, overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The ``gputrain train`` job of one row and its environment (the same threads for every row)."""
    cmd = [sys.executable, "-m", "gputrain", "train", recipe, f"--devices={devices}", f"--batch-size={batch_size}",
           f"--epochs={epochs}", f"--out={out}", f"--accelerator={accelerator}",
           "trainer.progress_bar=false", "trainer.checkpoint_every_n_epochs=0", "trainer.loggers=[]", *overrides]
    return cmd, {**os.environ, "OMP_NUM_THREADS": str(threads)}


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
        "| devices | threads per process | batch size (per device) | iters per epoch (train + val) "
        "| total training time | start-up | images/s | speedup | efficiency |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.devices} | {r.threads} | {r.batch_size} | {r.iters_per_epoch} | {r.train_time_s:.1f} s "
            f"| {r.startup_s:.1f} s | {r.images_per_s:.0f} | {r.speedup:.2f}{mark(r)} | {r.efficiency:.2f}{mark(r)} |"
        )
    if any(r.caution for r in rows):
        lines.append("\n(!) efficiency above 1 is not possible: the machine was busy during a run; rerun on a quiet machine")
    return "\n".join(lines)


def plot(rows: list[ScaleRow], path: Path) -> list[tuple[int, int]]:
    """Images/s against devices, one line per batch size; impossible points (``caution``) are marked (!) as in the
    table. Returns the marked points as (devices, batch size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for b in sorted({r.batch_size for r in rows}):
        sel = sorted((r for r in rows if r.batch_size == b), key=lambda r: r.devices)
        ax.plot([r.devices for r in sel], [r.images_per_s for r in sel], "o-", label=f"batch {b}/device")
        if sel and sel[0].devices == 1:
            ax.plot([r.devices for r in sel], [sel[0].images_per_s * r.devices for r in sel], ":", color="grey")
    odd = [r for r in rows if r.caution]
    if odd:
        ax.scatter([r.devices for r in odd], [r.images_per_s for r in odd], s=120, facecolors="none",
                   edgecolors="red", zorder=3, label="(!) impossible: busy machine, rerun")
        for r in odd:
            ax.annotate("(!)", (r.devices, r.images_per_s), textcoords="offset points", xytext=(6, 6), color="red")
    threads = sorted({r.threads for r in rows})
    ax.set_xticks(sorted({r.devices for r in rows}))
    ax.set_xlabel("devices")
    ax.set_ylabel("training images/s")
    ax.set_title(f"scaling, {'/'.join(map(str, threads))} threads per process (dotted: linear)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [(r.devices, r.batch_size) for r in odd]


def _error_line(stderr: str) -> str:
    """The run's own one-line error (``gputrain: error: ...``), else its last line of output."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line.removeprefix("gputrain: error:").strip() for line in lines if line.startswith("gputrain: error:")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def _out_folder(out: str | Path | None, overwrite: bool, name: str = "scale") -> Path:
    """The benchmark's folder (``runs/NAME-DATE-TIME`` by default), marked as gputrain's, empty or cleared."""
    from gputrain.runs.folder import clear_run_folder, default_run_dir, mark_run_folder

    if out is None:
        folder = default_run_dir(name)
    else:
        folder = Path(out)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--out {folder} is a file, not a folder; give a folder for {name}.json and the runs")
        if folder.is_dir() and any(folder.iterdir()):
            if not overwrite:
                raise ValueError(f"--out {folder} is not empty; pass --overwrite to replace it, or choose another --out")
            clear_run_folder(folder)
    mark_run_folder(folder)
    return folder


def scale_bench(recipe: str, *, devices: list[int], batch_sizes: list[int], out: str | Path | None,
                overrides: list[str], accelerator: str = "auto", epochs: int = 2,
                overwrite: bool = False) -> list[ScaleRow]:
    from gputrain.config import load_config
    from gputrain.extras import install_hint, installed
    from gputrain.runs.records import strict_json
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
    threads = threads_per_process(devices, cores=available_cores(), env=os.environ)
    out = _out_folder(out, overwrite)
    print(f"bench scale: every run has {threads} threads per process (OMP_NUM_THREADS={threads})", flush=True)
    rows: list[ScaleRow] = []
    progress = Progress("gputrain bench scale", len(devices) * len(batch_sizes))
    for d in devices:
        for b in batch_sizes:
            progress.stage(f"training --devices {d} --batch-size {b} for {epochs} epochs")
            run = out / f"devices{d}_batch{b}"
            cmd, env = run_command(recipe, d, b, epochs=epochs, out=run, accelerator=accelerator, threads=threads,
                                   overrides=overrides)
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - start
            if done.returncode != 0:
                raise ValueError(f"bench scale: the run with --devices {d} --batch-size {b} failed (exit "
                                 f"{done.returncode}): {_error_line(done.stderr)} (its folder: {run})")
            summary = json.loads((run / "summary.json").read_text())
            rows.append(ScaleRow(
                devices=d, batch_size=b, iters_per_epoch=summary["iters_per_epoch"]["total"],
                train_time_s=summary["wall_s"], startup_s=wall - summary["wall_s"],
                images_per_s=steady_throughput(run / "metrics.jsonl"), threads=threads,
            ))
            print(f"devices={d} batch={b}: {rows[-1].images_per_s:.0f} images/s", flush=True)
    progress.close()
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
