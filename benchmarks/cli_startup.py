"""How long the ``gputrain`` command takes to answer ``--help``, ``--version`` and a config error.

Each case runs ``python -m gputrain ...`` as a new process (what a user waits for), interleaved
case by case for ``--rounds`` rounds; the figure is the median wall time per case. The reference
is ``python -c "import torch, torchvision"``, what every answer cost before the CLI stopped
importing torch for them (issue 15 item 9). ``import gputrain.loop`` against ``import torch`` shows what
gputrain's own modules add to every launcher and rank (issue 16 item 5). Ratios are within one run.

    python benchmarks/cli_startup.py [--rounds 7] [--json out.json]
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

CASES = {
    "--help": ["-m", "gputrain", "--help"],
    "--version": ["-m", "gputrain", "--version"],
    "config error (optim.lr=1e39)": ["-m", "gputrain", "train", "autoencoder", "optim.lr=1e39"],
    "usage error (--no-such-flag)": ["-m", "gputrain", "train", "autoencoder", "--no-such-flag"],
    "import torch, torchvision (reference)": ["-c", "import torch, torchvision"],
    # What a launcher process imports before it starts the ranks, and every rank before its first step; the
    # optional strategies (pipeline, fsdp, model_parallel) stay out until a run names one.
    "import torch (reference)": ["-c", "import torch"],
    "import gputrain.loop (a launcher's and a rank's own imports)": ["-c", "import gputrain.loop"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory() as cwd:  # no runs/ or data/ of the caller's is touched
        for _ in range(args.rounds):
            for name, cmd in CASES.items():
                start = time.perf_counter()
                subprocess.run([sys.executable, *cmd], capture_output=True, cwd=cwd, env=os.environ.copy())
                times[name].append(time.perf_counter() - start)
    ref = statistics.median(times["import torch, torchvision (reference)"])
    print(f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"python {platform.python_version()}, median of {args.rounds} interleaved rounds")
    print("| command | median wall time | vs importing torch |\n|---|---|---|")
    for name, values in times.items():
        print(f"| `{name}` | {statistics.median(values):.2f} s | {statistics.median(values) / ref:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(times, f, indent=2)


if __name__ == "__main__":
    main()
