"""Training and evaluation images/s of each built-in recipe on CPU, on 1 and 2 processes.

Each row is one ``gputrain train`` run with the shrunken settings of ``tests/e2e/test_recipes.py``
(imported, so the figures describe exactly what the tests run). Throughput comes from the run's
``metrics.jsonl`` epoch records after the first (warm-up): training is ``train/samples`` over
``time/train_s`` summed over all ranks' samples; evaluation is ``val/samples`` (``val/images``
for detection) over ``time/val_s``, which for COCO includes gathering and scoring with
pycocotools on rank 0. The per-process batch is the tests', so 2 processes run twice the global
batch (weak scaling). ``cifar10-resnet18`` is ``dp`` (one process) in its recipe; its 2-process
row runs ``--strategy ddp``. Start-up (imports, torchrun) and checkpoint writes are not counted.

    python benchmarks/recipes.py [--recipes cifar10-resnet18,...] [--processes 1,2] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from test_recipes import COMMON, RECIPES, RecipeRun  # noqa: E402  (the tests own the settings)

# The tests' settings without their per-step logging (an all-reduce and a host sync every step)
# and without checkpoints.
BENCH_COMMON = (*(a for a in COMMON if not a.startswith(("trainer.log_every_n_steps=", "trainer.checkpoint_"))),
                "trainer.log_every_n_steps=0", "trainer.enable_checkpointing=false")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


@dataclass
class Row:
    recipe: str
    processes: int
    strategy: str
    epochs_timed: int
    """Epochs after the first, whose figures are averaged."""
    train_images_per_s: float
    eval_images_per_s: float
    settings: str


def gputrain(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "gputrain", *args], capture_output=True, text=True, env=ENV)
    if done.returncode != 0:
        raise RuntimeError(f"gputrain {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def steady_epochs(metrics: Path) -> list[dict[str, Any]]:
    """Epoch records after the first (all of them if there is only one)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    epochs = [r for r in records if "time/train_s" in r]
    if not epochs:
        raise ValueError(f"{metrics} has no epoch records; did the run finish?")
    return epochs[1:] or epochs


def throughput(epochs: list[dict[str, Any]]) -> tuple[float, float]:
    """(training images/s, evaluation images/s) over ``epochs``."""
    train = sum(r["train/samples"] for r in epochs) / sum(r["time/train_s"] for r in epochs)
    evaluated = sum(r.get("val/samples", r.get("val/images", 0.0)) for r in epochs)
    val_s = sum(r.get("time/val_s", 0.0) for r in epochs)
    return train, evaluated / val_s if val_s > 0 else float("nan")


def bench_recipe(spec: RecipeRun, processes: int, work: Path) -> Row:
    data = work / spec.recipe / "data"
    if not data.exists():
        gputrain("data", "make", spec.data, "--out", str(data), "--count", str(spec.count), "--size", str(spec.size))
    extra = ("--strategy", "ddp") if processes > 1 and "cifar10" in spec.recipe else ()
    out = work / spec.recipe / f"processes{processes}"
    gputrain("train", spec.recipe, "--devices", str(processes), "--data-root", str(data), "--out", str(out),
             *BENCH_COMMON, *spec.args, *extra)
    summary = json.loads((out / "summary.json").read_text())
    epochs = steady_epochs(out / "metrics.jsonl")
    train, evaluate = throughput(epochs)
    return Row(spec.recipe, summary["world_size"], summary["strategy"], len(epochs), train, evaluate,
               spec.settings())


def markdown(rows: list[Row]) -> str:
    lines = ["| recipe | processes | train images/s | eval images/s | settings |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.recipe} | {r.processes} ({r.strategy}) | {r.train_images_per_s:.1f} "
                     f"| {r.eval_images_per_s:.1f} | `{r.settings}` |")
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    return {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "load_average_at_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads_per_process": 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--work", help="folder for data and runs (default: a temporary folder)")
    parser.add_argument("--json", help="also write rows and machine to this JSON file")
    args = parser.parse_args()
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown recipe(s) {unknown}; choose from {list(RECIPES)}")
    counts = [int(p) for p in args.processes.split(",") if p]
    with tempfile.TemporaryDirectory(prefix="gputrain-bench-") as tmp:
        work = Path(args.work or tmp)
        rows = []
        for name in names:
            for p in counts:
                rows.append(bench_recipe(RECIPES[name], p, work))
                r = rows[-1]
                print(f"{r.recipe} x{r.processes}: train {r.train_images_per_s:.1f} images/s, "
                      f"eval {r.eval_images_per_s:.1f} images/s", flush=True)
    info = machine()
    print(f"\n{info['date']}, {info['cpu']} x {info['cpu_count']} CPUs ({info['platform']}), torch {info['torch']}, "
          f"1 thread per process, load average at end {info['load_average_at_end'][0]:.2f}; "
          f"every run: {' '.join(BENCH_COMMON)}\n")
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": [asdict(r) for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
