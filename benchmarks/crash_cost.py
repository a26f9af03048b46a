"""Work lost to a crash: steps redone and extra wall time, for a checkpoint every N steps.

A 2-process job (gloo, CPU) of the fault-test task (tests/e2e/faulty_task.py: a small CNN on
101 in-memory samples, 13 steps per epoch at batch 8 x 2) loses rank 1 to SIGKILL at step K of the
first attempt; torchrun restarts both workers (--max-restarts 1) and they resume from the newest
checkpoint. Against the same job without the crash, we report the steps trained twice and the
extra wall time (restart, checkpoint writes and redone steps together).

    python benchmarks/crash_cost.py [--every 1,2,4,8] [--crash-step 7] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "e2e"


def run(recipe: Path, out: Path, every: int, epochs: int, fault: str, step: int) -> tuple[float, int, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TASKS),
           "GPUTRAIN_TEST_FAULT": fault, "GPUTRAIN_TEST_FAULT_STEP": str(step)}
    cmd = [sys.executable, "-m", "gputrain", "train", str(recipe), "--devices", "2", "--out", str(out),
           "--max-restarts", "1", "--epochs", str(epochs), f"trainer.checkpoint_every_n_steps={every}"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    if fault != "kill":
        return wall, 0, max(steps)
    # Steps completed before the crash (step - 1) minus the step the restarted workers resumed from
    # (0 when no checkpoint existed yet and they started over).
    resumed = re.search(r"resumed from \S+ at epoch \d+ step (\d+)", done.stdout)
    return wall, step - 1 - (int(resumed.group(1)) if resumed else 0), max(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", default="1,2,4,8")
    parser.add_argument("--crash-step", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    recipe = tmp / "faulty.yaml"
    recipe.write_text(
        f"task: faulty_task:build\ndata: {{root: {tmp}}}\noptim: {{name: sgd, lr: 0.1}}\n"
        "trainer: {strategy: ddp, accelerator: cpu, batch_size: 8, progress_bar: false, loggers: [], "
        "log_every_n_steps: 1}\n")
    print(f"crash: rank 1 SIGKILLed in the forward of step {args.crash_step}; 2 processes, {args.epochs} epochs\n")
    print("| checkpoint every N steps | steps redone | wall, no crash | wall, crash + restart | extra wall |")
    print("|---|---|---|---|---|")
    for every in (int(x) for x in args.every.split(",")):
        clean, _, total = run(recipe, tmp / f"clean{every}", every, args.epochs, "", args.crash_step)
        crashed, redone, _ = run(recipe, tmp / f"crash{every}", every, args.epochs, "kill", args.crash_step)
        print(f"| {every} | {redone} of {total} | {clean:.1f} s | {crashed:.1f} s | {crashed - clean:+.1f} s |",
              flush=True)


if __name__ == "__main__":
    main()
