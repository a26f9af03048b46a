"""``scripts/gpu_check.sh`` runs its whole checklist on a CPU (GPU_ACC=cpu, tiny sizes) and prints one table.

Every built-in recipe trains for real (one epoch on a few generated images), as does ``gputrain bench throughput``;
the CUDA-only checks say "skipped: no GPU". A recipe made to diverge (a huge learning rate through GPU_ARGS) ends
with exit 3, and the checklist then fails and names it. The verdicts themselves are tested in
``tests/unit/test_gpu_checklist.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from forked_cli import python_via_fork

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = {"GPU_ACC": "cpu", "EPOCHS": "1", "WORKERS": "0", "FRAMES_COUNT": "24", "CIFAR_COUNT": "60", "PER_CLASS": "2",
        "RESNET_SIZE": "32", "ADE_COUNT": "10", "ADE_SIZE": "64", "COCO_COUNT": "5", "COCO_SIZE": "64",
        "COCO_MIN": "64", "COCO_MAX": "64", "MP_COUNT": "20", "MP_SIZE": "32", "BATCH": "8"}
"""Sizes that run the whole checklist in about 40 s on 2 quiet CPU cores."""


def _made_here(data: Path) -> None:
    """The data sets the script would make, made in this process (each `gputrain data make` of the script is a
    process that imports torch: about 3 s of CPU apiece). The script still makes CIFAR-10's and the JPEGs itself,
    so its own way of making data runs too."""
    from gputrain.tools.make_data import make_dataset

    for kind, folder, count, size in (("imagefolder", "frames-24", 24, 80), ("ade20k", "ade20k-64-10", 10, 64),
                                      ("coco", "coco-64-5", 5, 64), ("classfolder", "classes-32-20", 20, 32)):
        make_dataset(kind, data / folder, size=size, count=count)


def _gpu_check(tmp: Path, *parts: str, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The script as a user runs it, but each of its ``$PYTHON -m gputrain`` commands forked from the preloaded
    server rather than a new interpreter (tests/forked_cli.py: python_via_fork): a dozen commands, each 3 CPU-s of
    importing torch, were half of this file's time."""
    out = tmp / "out"
    with python_via_fork() as forked:
        env = {**os.environ, **TINY, **forked, "OUT": str(out), "GPU_DATA": str(tmp / "data"),
               "GPU_RUNS": str(tmp / "runs"), "OMP_NUM_THREADS": "1", **env}
        done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *parts], capture_output=True,
                              text=True, env=env, timeout=900)
    return done, out


def _table(stdout: str) -> dict[str, str]:
    """The rows of the table the script printed last, by check name."""
    start = stdout.rindex("| check | setting |")
    return {line.split(" | ")[0].removeprefix("| "): line for line in stdout[start:].splitlines()[2:]
            if line.startswith("| ")}


# About 40 s alone (over 20 s by design): every recipe trains through the command line, each a process of its own
# (forked), as on the GPU.
def test_the_whole_checklist_runs_on_a_cpu_and_prints_one_table(tmp_path):
    _made_here(tmp_path / "data")
    # No pictures at the end of each run (matplotlib's import and drawing, seconds per recipe here): the checklist's
    # verdicts read metrics.jsonl and summary.json, and the pictures have tests of their own (tests/unit/test_report.py).
    done, out = _gpu_check(tmp_path, GPU_ARGS="trainer.pictures=0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _table(done.stdout)
    recipes = sorted(p.stem for p in (ROOT / "src" / "gputrain" / "recipes").glob("*.yaml"))
    names = list(rows)
    assert names == ["stack", "CUDA tests", "autoencoder", "cifar10-resnet18", "cifar10-resnet18-recipe",
                     "imagefolder-resnet50", "imagenet-resnet50-v2", "resnet50-model-parallel", "ade20k-deeplabv3plus",
                     "ade20k-deeplabv3plus 16-mixed", "coco-maskrcnn",
                     "ResNet-50 images/s, JPEGs decoded in the workers", "ResNet-50 images/s, JPEGs decoded on the GPU"]
    assert sorted(set(names[2:11]) - {"ade20k-deeplabv3plus 16-mixed"}) == recipes  # every recipe, the cheapest first
    assert rows["stack"].endswith("JPEG decoded on the CPU |") and "| pass: torch " in rows["stack"]
    assert rows["ade20k-deeplabv3plus 16-mixed"].endswith("| skipped: no GPU (float16 is 20-35x slower on a CPU) |")
    for name in recipes:
        assert "| finite, last " in rows[name] and rows[name].endswith("| pass |"), rows[name]
        assert "precision=32" in rows[name] and "device=cpu" in rows[name]
    assert rows["CUDA tests"].endswith("| skipped: no GPU (GPU_ACC=cpu) |")
    assert rows["ResNet-50 images/s, JPEGs decoded in the workers"].endswith("| pass |")
    assert " real / " in rows["ResNet-50 images/s, JPEGs decoded in the workers"]
    assert rows["ResNet-50 images/s, JPEGs decoded on the GPU"].endswith("| skipped: no GPU (nvJPEG decoding needs CUDA) |")
    # Every figure is JSON under $OUT; the table is saved beside them.
    checks = [json.loads(p.read_text()) for p in (out / "checks").glob("*.json")]
    assert sorted(c["name"] for c in checks) == sorted(names)
    images = next(c for c in checks if c["name"] == "ResNet-50 images/s, JPEGs decoded in the workers")
    assert images["images_per_s"] > 0 and images["synthetic_images_per_s"] > 0 and images["peak_memory_bytes"] > 0
    assert "| coco-maskrcnn |" in (out / "checklist.md").read_text()


def test_a_diverging_recipe_fails_the_checklist_and_the_table_names_it(tmp_path):
    done, _ = _gpu_check(tmp_path, "cifar10-resnet18", EPOCHS="2", CIFAR_COUNT="64",
                           GPU_ARGS="optim.lr=100 trainer.batch_size=16 model.kwargs.cifar_stem=false trainer.pictures=0")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _table(done.stdout)
    assert "| NaN/inf |" in rows["cifar10-resnet18"]
    # The row is the replay's report of the run's first non-finite step (issue 41), and where its bundle is.
    assert "**FAIL**: exit 3 (diverged: NaN/inf); replay of step " in rows["cifar10-resnet18"]
    assert "(gputrain replay " in rows["cifar10-resnet18"] and "cifar10-resnet18/nonfinite)" in rows["cifar10-resnet18"]
    assert "1 check(s): 0 passed, 1 failed, 0 skipped" in done.stdout


def test_no_check_starts_after_the_budget_and_each_gets_a_row(tmp_path):
    """BUDGET_S: a lease's one command stops starting checks in time to print its table; nothing is made or run
    for the checks it does not start (no data sets either). SPENT_S: the budget was spent by an earlier command."""
    done, _ = _gpu_check(tmp_path, "stack", "ade20k-deeplabv3plus", "images", BUDGET_S="60", SPENT_S="60")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _table(done.stdout)
    assert list(rows) == ["stack", "ade20k-deeplabv3plus", "ade20k-deeplabv3plus 16-mixed",
                          "ResNet-50 images/s, JPEGs decoded in the workers",
                          "ResNet-50 images/s, JPEGs decoded on the GPU"]
    assert all(row.endswith("| skipped: not started: the budget of BUDGET_S=60 s was spent |") for row in rows.values())
    assert not list((tmp_path / "data").iterdir())


def test_the_plan_part_trains_each_one_device_plan_against_its_own_predictions(tmp_path):
    """``plan:autoencoder``: the recipe's plans for one device, each trained with its predictions and
    ``trainer.measure_memory=true``; each row sets the measure against the prediction (a CPU's step time shown,
    not judged)."""
    from gputrain.tools.make_data import make_dataset

    # Batches of 4 from 64 frames: steps enough for the two measured by memory.json and the pace's after the first.
    make_dataset("imagefolder", tmp_path / "data" / "frames-64", size=80, count=64)
    done, out = _gpu_check(tmp_path, "plan:autoencoder", FRAMES_COUNT="64",
                           GPU_ARGS="trainer.pictures=0 trainer.batch_size=4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _table(done.stdout)
    assert list(rows) == ["plan: autoencoder single", "plan: autoencoder single+ac"]
    for row in rows.values():
        assert "| pass: memory predicted " in row and " by MemTracker (" in row and "time not judged on a CPU" in row
    checks = {c["name"]: c for c in map(json.loads, map(Path.read_text, (out / "checks").glob("*.json")))}
    for check in checks.values():
        assert abs(check["memory_off"]) <= 0.10 and check["predicted_step_s"] > 0 and check["compute_s"] > 0
        assert "trainer.predicted_peak_bytes=[" in check["setting"]
    assert "trainer.activation_checkpointing=true" in checks["plan: autoencoder single+ac"]["setting"]
