"""``gputrain bench throughput RECIPE``: images/s with real and with synthetic data, FLOPs, utilisation, memory.

Two short runs of the recipe on one device, as users run it (``gputrain train`` in a subprocess): one with
the real input pipeline, one with ``data.synthetic=true`` (samples kept on the device, no decoding). Their
ratio is the input-bound ratio: 1.0 means the loader keeps up, 0.5 that the model waits half the time.

Timing: each run logs its pace every :data:`WINDOW_STEPS` steps; the median of those windows after the first
epoch (which pays for start-up, caches and any compilation) is its images/s, so one slow window (another
process on the machine) does not decide it. Fewer than :data:`MIN_WINDOWS` timed windows, or a ratio above 1
(real data cannot be faster than data already on the device), is printed as a caution saying why.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gputrain.tools.progress import Progress

PEAK_FLOPS = {"H100": {"bf16": 989e12, "fp32": 67e12}, "H200": {"bf16": 989e12, "fp32": 67e12},
              "A100": {"bf16": 312e12, "fp32": 19.5e12}}
"""Dense peak FLOP/s by GPU name (NVIDIA's data sheets, SXM parts, without sparsity); utilisation is reported
against these where the device is one of them."""


@dataclass
class Throughput:
    recipe: str
    device: str
    precision: str
    batch_size: int
    train_images_per_s: float
    synthetic_train_images_per_s: float
    input_bound_ratio: float
    eval_images_per_s: float | None
    flops_per_image: float | None
    """Training FLOPs of one image (forward and backward), counted by torch.utils.flop_counter."""
    model_flops_utilisation: float | None
    peak_memory_bytes: int
    compile_s: float | None
    """With ``trainer.compile=true``: the real-data run's first step minus a steady step (the compile time);
    None when the model is not compiled."""


WINDOW_STEPS = 5
"""Steps per timed window (``trainer.log_every_n_steps`` of the two runs)."""
MIN_WINDOWS = 5
"""Timed windows below which a median says little: a caution asks for more ``--epochs``."""


def _run(recipe: str, out: Path, overrides: list[str], *, epochs: int, synthetic: bool) -> tuple[dict, list[dict]]:
    from gputrain.tools.bench.scale import _error_line

    cmd = [sys.executable, "-m", "gputrain", "train", recipe, "--devices", "1", "--epochs", str(epochs), "--out",
           str(out), "trainer.progress_bar=false", "trainer.checkpoint_every_n_epochs=0", "trainer.loggers=[]",
           "trainer.pictures=0", "trainer.enable_checkpointing=false", *overrides,
           f"trainer.log_every_n_steps={WINDOW_STEPS}", f"data.synthetic={str(synthetic).lower()}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        kind = "synthetic" if synthetic else "real"
        raise ValueError(f"bench throughput: the {kind}-data run failed (exit {done.returncode}): "
                         f"{_error_line(done.stderr)} (its folder: {out})")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), records


def steady(records: list[dict], key: str) -> tuple[float | None, int]:
    """The median of ``key`` over the timed windows after the first epoch, and how many there were.

    Step records (one per window of :data:`WINDOW_STEPS` steps) when the epochs after the first have any, else
    the epoch records after the first (all of them for a single epoch: then nothing is warm-up free).
    """
    epochs = [r for r in records if "time/train_s" in r]
    first_end = epochs[0]["step"] if len(epochs) > 1 else -1
    windows = [r[key] for r in records if "time/train_s" not in r and key in r and r["step"] > first_end
               and r[key] > 0]
    if key == "train/images_per_s" and windows:
        return statistics.median(windows), len(windows)
    values = [r[key] for r in (epochs[1:] or epochs) if r.get(key) is not None]
    return (statistics.median(values) if values else None), len(values)


def cautions(result: Throughput, windows: tuple[int, int]) -> list[str]:
    """Why a figure cannot be trusted, one line each (empty when nothing is off)."""
    lines = []
    if result.input_bound_ratio > 1.0:
        lines.append(f"input-bound ratio {result.input_bound_ratio:.2f} is above 1: real data ran faster than samples "
                     "already on the device, which the input pipeline cannot do; the machine was busy during the "
                     "synthetic run (or the runs are too short to time): rerun on a quiet machine, or with more --epochs")
    few = [f"{kind} {n}" for kind, n in zip(("real", "synthetic"), windows, strict=True) if n < MIN_WINDOWS]
    if few:
        lines.append(f"only {' and '.join(few)} timed window(s) of {WINDOW_STEPS} steps after the first epoch: the "
                     f"medians are rough; give more --epochs (or more data) for at least {MIN_WINDOWS} each")
    return lines


def flops_per_image(recipe: str, overrides: list[str]) -> float | None:
    """Forward+backward FLOPs of one training image of the recipe's model, on the CPU (shapes only matter)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from gputrain.config import load_config
    from gputrain.tasks import build_task

    try:
        # The float image a worker would hand over, whatever the run does on its device.
        built = build_task(load_config(recipe, [*overrides, "data.normalize_on_device=false",
                                                "data.decode_on_device=false"]))
        sample = built.train_data[0]
        images = sample[0] if isinstance(sample, (tuple, list)) else sample
        if not isinstance(images, torch.Tensor) or images.dim() != 3:
            return None  # detection and other structured inputs: not counted
        model = built.model.train()
        counter = FlopCounterMode(display=False)
        with counter:  # two images: training-mode BatchNorm refuses one value per channel (1x1 maps)
            out = model(torch.stack([images, images]))
            (out if isinstance(out, torch.Tensor) else next(iter(out.values()))).float().sum().backward()
        return float(counter.get_total_flops()) / 2
    except Exception:  # a count is a nicety: never fail the benchmark for it
        return None


def bench_throughput(recipe: str, *, epochs: int, out: Path, overrides: list[str]) -> tuple[Throughput, list[str]]:
    """The figures of the two runs, and the cautions that go with them."""
    with Progress("gputrain bench throughput", 2) as progress:
        progress.stage(f"training {epochs} epochs on the real data")
        real_summary, real = _run(recipe, out / "real", overrides, epochs=epochs, synthetic=False)
        progress.stage(f"training {epochs} epochs on synthetic data (no input pipeline)")
        synth_summary, synth = _run(recipe, out / "synthetic", overrides, epochs=epochs, synthetic=True)
    (real_ips, real_n), (synth_ips, synth_n) = steady(real, "train/images_per_s"), steady(synth, "train/images_per_s")
    real_ips, synth_ips = real_ips or 0.0, synth_ips or 0.0
    flops = flops_per_image(recipe, overrides)
    device = real_summary["device"]
    mfu = None
    if flops and device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(0)
        peak = next((p for key, p in PEAK_FLOPS.items() if key in name), None)
        if peak:
            kind = "bf16" if "bf16" in real_summary["precision"] or "16" in real_summary["precision"] else "fp32"
            mfu = synth_ips * flops / peak[kind]
    result = Throughput(
        recipe=recipe, device=device, precision=real_summary["precision"],
        batch_size=real_summary["batch_size_per_device"], train_images_per_s=real_ips,
        synthetic_train_images_per_s=synth_ips, input_bound_ratio=real_ips / synth_ips if synth_ips else 0.0,
        eval_images_per_s=steady(real, "time/val_images_per_s")[0], flops_per_image=flops,
        model_flops_utilisation=mfu,
        peak_memory_bytes=max(real_summary.get("peak_memory_bytes", 0), synth_summary.get("peak_memory_bytes", 0)),
        compile_s=_compile_s(real_summary, real_ips))
    return result, cautions(result, (real_n, synth_n))


def _compile_s(summary: dict[str, Any], images_per_s: float) -> float | None:
    """The first step's extra time over a steady step, where the run compiled its model."""
    first = summary.get("first_step_s")
    if "compile" not in summary.get("fast", "") or first is None or not images_per_s:
        return None
    return max(first - summary["batch_size_per_device"] / images_per_s, 0.0)


def table(result: Throughput) -> str:
    def fmt(value: Any, unit: str = "") -> str:
        if value is None:
            return "n/a"
        return f"{value:,.1f}{unit}" if isinstance(value, float) else f"{value}{unit}"

    rows = [("device", result.device), ("precision", result.precision), ("batch per device", result.batch_size),
            ("train images/s, real data", fmt(result.train_images_per_s)),
            ("train images/s, synthetic data", fmt(result.synthetic_train_images_per_s)),
            ("input-bound ratio (real / synthetic)",
             f"{result.input_bound_ratio:.2f}" + (" (!)" if result.input_bound_ratio > 1 else "")),
            ("eval images/s, real data", fmt(result.eval_images_per_s)),
            ("training GFLOPs per image", "n/a" if result.flops_per_image is None else f"{result.flops_per_image / 1e9:.3g}"),
            ("model FLOPs utilisation", fmt(result.model_flops_utilisation and 100 * result.model_flops_utilisation, " %")),
            ("peak memory", f"{result.peak_memory_bytes / 2**20:,.0f} MiB"),
            ("compile time", fmt(result.compile_s, " s"))]
    return "\n".join(["| measure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]])


def run_bench_throughput(recipe: str, *, epochs: int, out: str | None, overwrite: bool, overrides: list[str],
                         json_path: str | None) -> None:
    from gputrain.runs.records import strict_json
    from gputrain.tools.bench.scale import _out_folder

    folder = _out_folder(out, overwrite, "throughput")
    start = time.perf_counter()
    result, caution = bench_throughput(recipe, epochs=epochs, out=folder, overrides=overrides)
    text = strict_json(asdict(result) | {"cautions": caution}, indent=2)
    (folder / "throughput.json").write_text(text)
    if json_path:
        Path(json_path).write_text(text)
    print(table(result))
    for line in caution:
        print(f"caution: {line}")
    print(f"bench throughput: {time.perf_counter() - start:.0f} s; runs in {folder}")
