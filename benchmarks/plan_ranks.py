"""``gputrain plan``'s per-device memory against what real ranks measure training each plan (issue 30).

For each setting: ``gputrain plan RECIPE --devices 2 --batch-size 8 --json``, then every ddp, fsdp and pipeline
plan (and their ``+ac`` forms) trained as ``--strategy auto`` would hand it to the ranks (the plan's ``overrides``)
with ``trainer.measure_memory=true`` for two steps on 2 ranks; each rank's measured peak against the plan's figure
for that device. Memory counts are deterministic on a CPU (one run is the median of any number); ``--reps`` repeats
the whole comparison to show it.

Usage: ``python benchmarks/plan_ranks.py [--reps 1] [--json out.json] [--only autoencoder]`` (generated data, CPU, about 4 minutes).
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
from pathlib import Path
from typing import Any

from gputrain.data.cifar10 import make_cifar10
from gputrain.data.imagefolder import make_frames

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def gputrain(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "gputrain", *args], capture_output=True, text=True, env=ENV)
    if done.returncode:
        raise SystemExit(f"gputrain {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def compare(recipe: list[str], root: Path, tmp: Path) -> list[dict[str, Any]]:
    gputrain("plan", *recipe, "--data-root", str(root), "--devices", "2", "--accelerator", "cpu", "--batch-size",
             "8", "--json", str(tmp / "plan.json"))
    rows = []
    for plan in json.loads((tmp / "plan.json").read_text())["plans"]:
        if plan["strategy"] in ("single", "model_parallel"):
            continue
        label = plan["strategy"] + (f"-{plan['schedule']}" if plan["schedule"] else "") \
            + ("+ac" if plan["activation_checkpointing"] else "")
        run = tmp / label
        gputrain("train", *recipe, *plan["overrides"], "--data-root", str(root), "--devices", "2", "--accelerator",
                 "cpu", "--epochs", "1", "--out", str(run), "trainer.max_steps_per_epoch=2",
                 "trainer.measure_memory=true", "trainer.enable_checkpointing=false", "trainer.loggers=[]",
                 "trainer.pictures=0", "trainer.progress_bar=false")
        ranks = sorted(json.loads((run / "memory.json").read_text())["ranks"], key=lambda r: r["rank"])
        for rank, predicted in zip(ranks, plan["per_device_memory_bytes"], strict=True):
            rows.append({"recipe": " ".join(recipe), "plan": label, "rank": rank["rank"], "predicted": predicted,
                         "measured": rank["peak_bytes"], "error": (predicted - rank["peak_bytes"]) / rank["peak_bytes"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--json", default="")
    parser.add_argument("--only", default="", help="run the settings whose recipe contains this text")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cifar = make_cifar10(tmp / "cifar", train_per_class=4, test_per_class=1)
        frames = make_frames(tmp / "frames", count=64, size=80, videos=4)
        settings = [(["cifar10-resnet18", "trainer.strategy=ddp", "data.image_size=32", "optim.name=adam"], cifar),
                    (["cifar10-resnet18", "trainer.strategy=ddp", "data.image_size=64", "optim.name=sgd"], cifar),
                    (["autoencoder"], frames)]
        for rep in range(args.reps):
            for i, (recipe, root) in enumerate(settings):
                if args.only not in recipe[0]:
                    continue
                work = tmp / f"r{rep}-{i}"
                work.mkdir()
                rows += compare(recipe, root, work)
    for r in rows:
        print(f"{r['recipe']:<52} {r['plan']:<16} rank {r['rank']}: predicted {r['predicted'] / 2**20:8.1f} MiB, "
              f"measured {r['measured'] / 2**20:8.1f} MiB ({r['error']:+.1%})")
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    print(f"{within} of {len(rows)} rank figures within 10 %")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.node(),
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
