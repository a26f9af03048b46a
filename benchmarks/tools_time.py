"""Wall time of ``gputrain parity`` and the time ``gputrain doctor`` adds to the steps it runs.

parity: the autoencoder and cifar10-resnet18 recipes in their tiny configurations (imported from
``tests/distributed/test_parity_tool.py``, so these are the settings the tests run), every
registered mode, wall time of :func:`check_parity` including the launch of the 2-process modes.

doctor: the same tiny configurations, the dry run of :func:`gputrain.tools.doctor.run_doctor` on 2
ranks, with its probes and without them (the same Trainer steps, no hook), interleaved A B A B
(``--pairs``). The figure is the median over pairs of (rank 0's ``train_s`` with probes) /
(``train_s`` without) - 1: the time of the optimizer steps, which is where the probes run. Wall time on
a shared machine is noisy, so the CPU time of ``fit`` (``time.process_time``, all ranks summed,
setup included, which the probes also touch) is reported beside it.
Start-up (spawn, imports, rendezvous) is the same for both and reported apart.

    python benchmarks/tools_time.py [--pairs 5] [--doctor-steps 10] [--only parity|doctor] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_parity_tool import tiny_config  # noqa: E402  (the tests own the settings)

from gputrain.tools.diagnose.doctor import _doctor_rank  # noqa: E402
from gputrain.tools.diagnose.parity import build_from_config, check_parity  # noqa: E402
from gputrain.tools.diagnose.ranks import run_on_ranks  # noqa: E402

RECIPES = ("autoencoder", "cifar10-resnet18")


def parity_time(recipe: str, folder: Path) -> dict:
    cfg, g = tiny_config(recipe, folder)
    start = time.perf_counter()
    report = check_parity(functools.partial(build_from_config, cfg), cfg, global_batch=g)
    wall = time.perf_counter() - start
    return {"recipe": recipe, "global_batch": g, "wall_s": round(wall, 1), "failed": report.failed,
            "modes": {r.mode: r.status for r in report.rows}}


def doctor_overhead(recipe: str, folder: Path, pairs: int, steps: int) -> dict:
    cfg, g = tiny_config(recipe, folder)
    cfg.trainer.batch_size = g // 2
    ratios, cpu_ratios, added_ms, walls = [], [], [], {True: [], False: []}
    for _ in range(pairs):
        train, cpu = {}, {}
        for probe in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                out = run_on_ranks(_doctor_rank, cfg, steps, f"{tmp}/run", 60.0, probe, devices=2, timeout_s=60.0)
                walls[probe].append(time.perf_counter() - start)
            assert all(o.ok for o in out), [o.error for o in out]
            train[probe] = out[0].value["train_s"]
            cpu[probe] = sum(o.value["cpu_s"] for o in out)
        ratios.append(train[True] / train[False] - 1)
        cpu_ratios.append(cpu[True] / cpu[False] - 1)
        added_ms.append((train[True] - train[False]) / (2 * steps) * 1e3)
    return {"recipe": recipe, "steps": 2 * steps, "pairs": pairs, "added_median": round(statistics.median(ratios), 3),
            "added_per_pair": [round(r, 3) for r in ratios],
            "added_ms_per_step_median": round(statistics.median(added_ms), 2),
            "added_cpu_median": round(statistics.median(cpu_ratios), 3), "added_cpu_per_pair": [round(r, 3) for r in
                                                                                            cpu_ratios],
            "wall_s_with_probes": round(statistics.median(walls[True]), 1),
            "wall_s_without": round(statistics.median(walls[False]), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--doctor-steps", type=int, default=10, help="steps per epoch of the doctor's dry run "
                        "(its default is 3; more steps make the ratio less noisy)")
    parser.add_argument("--only", choices=["parity", "doctor"], default=None)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "load_average": os.getloadavg(), "parity": [], "doctor": []}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in RECIPES if args.only != "doctor" else ():
            row = parity_time(recipe, Path(tmp) / f"p-{recipe}")
            print(f"parity {recipe}: {row['wall_s']} s, {row['modes']}", flush=True)
            result["parity"].append(row)
        for recipe in RECIPES if args.only != "parity" else ():
            row = doctor_overhead(recipe, Path(tmp) / f"d-{recipe}", args.pairs, args.doctor_steps)
            print(f"doctor {recipe}: steps' wall {row['added_median']:+.1%} ({row['added_ms_per_step_median']:+.2f} "
                  f"ms/step), fit's CPU time {row['added_cpu_median']:+.1%} (pairs {row['added_cpu_per_pair']}) over "
                  f"{row['steps']} steps "
                  f"(pairs {row['added_per_pair']}); dry run {row['wall_s_with_probes']} s vs "
                  f"{row['wall_s_without']} s bare", flush=True)
            result["doctor"].append(row)
    result["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
