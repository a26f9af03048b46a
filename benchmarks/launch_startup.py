"""Start-up of a 2-process ``gputrain train``: ranks started directly vs by torchrun's elastic agent.

The job is the user-code task of the fault tests (tests/e2e/faulty_task.py: a tiny CNN on in-memory
data), so the time is the launcher's, the imports' and the rendezvous', not the model's. Direct launch
is what ``--max-restarts 0`` (the default) gets on one node; ``--max-restarts 1`` goes through torchrun
(no restart happens: nothing fails). Runs are interleaved A B A B (``--pairs``); per pair the figures
are: start -> the first training forward on every rank (each rank writes its step to a file), and the
wall time of the whole 1-epoch run. Medians over pairs, and the median of per-pair ratios.

``--baseline-python PATH`` adds a third run to each round: direct launch by another installation of gputrain
(e.g. the venv of an older checkout), rotated with the other two, and its ratios to this one's direct launch.

    python benchmarks/launch_startup.py [--pairs 5] [--baseline-python OTHER/.venv/bin/python] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "tests" / "e2e"
RECIPE = """task: faulty_task:build
data: {{root: {root}}}
optim: {{name: sgd, lr: 0.1, momentum: 0.9}}
trainer: {{strategy: ddp, accelerator: cpu, epochs: 1, batch_size: 8, progress_bar: false, loggers: [],
          checkpoint_every_n_steps: 0, enable_checkpointing: false}}
"""


def one_run(folder: Path, restarts: int, python: str = sys.executable) -> tuple[float, float]:
    """(seconds from start to the first forward on both ranks, seconds of the whole run)."""
    steps = folder / "steps"
    steps.mkdir(parents=True)
    recipe = folder / "job.yaml"
    recipe.write_text(RECIPE.format(root=folder))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPUTRAIN_TEST_STEPS_DIR": str(steps),
           "PYTHONPATH": os.pathsep.join([str(E2E), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "gputrain", "train", str(recipe), "--devices", "2",
                             "--max-restarts", str(restarts), "--out", str(folder / "run")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = float("nan")
    while proc.poll() is None:
        if first != first and all((steps / f"rank{r}").is_file() for r in (0, 1)):
            first = time.perf_counter() - start
        time.sleep(0.01)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"launch_startup: the run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
    return first, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--baseline-python", help="interpreter of another gputrain installation to compare with")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    modes = [("direct", 0, sys.executable), ("torchrun", 1, sys.executable)]
    if args.baseline_python:
        modes.append(("baseline direct", 0, args.baseline_python))
    rows: dict[str, dict[str, list[float]]] = {m[0]: {"first": [], "wall": []} for m in modes}
    ratios: dict[str, dict[str, list[float]]] = {m[0]: {"first": [], "wall": []} for m in modes[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            got = {}
            for mode, restarts, python in modes[pair % len(modes):] + modes[:pair % len(modes)]:  # rotated
                got[mode] = one_run(Path(tmp) / f"{pair}-{mode.replace(' ', '-')}", restarts, python)
                rows[mode]["first"].append(got[mode][0])
                rows[mode]["wall"].append(got[mode][1])
            for mode in ratios:
                ratios[mode]["first"].append(got[mode][0] / got["direct"][0])
                ratios[mode]["wall"].append(got[mode][1] / got["direct"][1])
            print(f"round {pair + 1}: " + ", ".join(f"{m} {got[m][0]:.2f} s / {got[m][1]:.2f} s" for m in got), flush=True)
    result = {
        "date": datetime.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} cores)",
        "command": " ".join(["python", "benchmarks/launch_startup.py", *sys.argv[1:]]), "pairs": args.pairs,
        "median_s": {m: {k: round(statistics.median(v), 2) for k, v in r.items()} for m, r in rows.items()},
        "median_ratio_over_direct": {m: {k: round(statistics.median(v), 3) for k, v in r.items()}
                                     for m, r in ratios.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
