"""An elastic job losing a node, run again and again (issue 45): what a membership change costs, and whether every run
stays exact.

Each round is the scale-down of ``tests/e2e/test_elastic.py``, with its helpers (``tests/elastic_runs.py``): two
torchrun agents as two nodes on loopback, gloo, the same command line and ``--out``; when the checkpoint of step 4
is written, the node that does not host the rendezvous store is SIGKILLed (agent and worker), and the other restarts
its worker, which resumes on one process with the global batch kept. Per round: the wall time from both starts to
the end, the membership record's ``seconds_lost`` (the last checkpoint's age when the node went, plus the restart
to the resumed step) and ``samples_retrained``, the largest weight difference from an uninterrupted one-process run,
and whether the samples the restarted worker read are exactly the epoch plan's from the resumed step on, each once.

``--scale-up``: the test of a node joining: node A trains alone (``--batch-size 4``), node B starts with the same
command once A has saved step 2; A's agent stops its worker (a checkpoint on its SIGTERM) and both resume on two
processes with the global batch kept. ``seconds_lost`` is then the restart's cost alone.

``--during-save``: the test's second case, with sharded checkpoints; the node is killed while its checkpoint thread
is halted at its first fsync of step 6's shards, so the job must resume from step 4.

    python benchmarks/elastic.py [--rounds 5] [--during-save | --scale-up] [--json out.json] [OVERRIDE ...]

OVERRIDEs go to both nodes' command lines, after the test's recipe (which beats every second and waits 5 s for more
nodes): ``launch.keep_alive_s=5 launch.last_call_s=30`` measures gputrain's defaults.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from elastic_runs import (  # noqa: E402
    WEIGHTS_TOL,
    N,
    hosting,
    kill_node,
    membership,
    node,
    recipe,
    served,
    stop_in_the_save_of,
    wait_for,
)

GLOBAL_BATCH = 4  # as tests/e2e/test_elastic.py


def reference(root: Path) -> dict[str, torch.Tensor]:
    """The uninterrupted run: one process, the same global batch."""
    from gputrain.checkpoint import load_checkpoint
    from gputrain.cli import main

    assert main(["train", str(recipe(root)), "--batch-size", str(GLOBAL_BATCH), "--seed", "0", "--out",
                 str(root / "run")]) == 0
    return load_checkpoint(root / "run" / "checkpoints" / "last.pt")["model"]


def _row(root: Path, weights: dict[str, torch.Tensor], code: int, wall: float, world_after: int) -> dict[str, Any]:
    """A round's figures; each sample once: the processes after the change read exactly the plan's samples from the
    resumed step on (one process: in the plan's order)."""
    from gputrain.checkpoint import model_weights
    from gputrain.data.samplers import EpochPlan

    changes = membership(root / "run")
    ended = model_weights(root / "run" / "checkpoints" / "last.pt") if code == 0 else None
    change = changes[0] if len(changes) == 1 else {}
    order = EpochPlan(N, seed=0, epoch=0, dp_size=1, batch_size=GLOBAL_BATCH).order
    after = [index for _, ws, index in served(root) if ws == world_after]
    rest = order[change["step"] * GLOBAL_BATCH:] if change else None
    return {"exit": code, "wall_s": round(wall, 1), "changes": len(changes),
            "seconds_lost": change.get("seconds_lost"), "samples_retrained": change.get("samples_retrained"),
            "resumed_step": change.get("step"),
            "max_weight_diff": None if ended is None else max(float((ended[k] - weights[k]).abs().max()) for k in weights),
            "each_sample_once": rest is not None and (after == rest if world_after == 1 else sorted(after) == sorted(rest))}


def one_round(root: Path, weights: dict[str, torch.Tensor], during_save: bool = False,
              extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """``during_save``: sharded checkpoints, and node B killed while halted in its save of step 6 (the test's
    second case); else killed once the checkpoint of step 4 is written."""
    from gputrain.launcher.spec import free_port

    root.mkdir(parents=True)
    port, started = free_port(), time.monotonic()
    overrides = [*(["parallel.sharded_checkpoint=true"] if during_save else []), *extra]
    a, b = node(root, port, "A", *overrides), node(root, port, "B", *overrides)
    names = {a.pid: "A", b.pid: "B"}
    try:
        wait_for(lambda: hosting(port, [a.pid, b.pid]) is not None, 120, "the rendezvous store")
        if hosting(port, [a.pid, b.pid]) == b.pid:
            a, b = b, a
        if during_save:
            wait_for(stop_in_the_save_of(root, names[b.pid], "step_000006.dcp").is_file, 120, "the halt in a save")
        else:
            wait_for(lambda: (root / "run" / "checkpoints" / "step_000004.pt").is_file(), 120, "step 4's checkpoint")
        kill_node(b)
        code = a.wait(timeout=180)
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                kill_node(proc)
    return _row(root, weights, code, time.monotonic() - started, world_after=1)


def scale_up_round(root: Path, weights: dict[str, torch.Tensor], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Node A alone, node B joining once A's step 2 is saved; both must end with the uninterrupted weights."""
    from gputrain.launcher.spec import free_port

    root.mkdir(parents=True)
    port, started = free_port(), time.monotonic()
    same = ["--batch-size", str(GLOBAL_BATCH), "launch.join_timeout_s=20", *extra]
    a, b = node(root, port, "A", *same), None
    try:
        wait_for(lambda: (root / "run" / "checkpoints" / "step_000002.pt").is_file(), 120, "A's step 2")
        b = node(root, port, "B", *same)
        code = max(a.wait(timeout=180), b.wait(timeout=60))
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                kill_node(proc)
    return _row(root, weights, code, time.monotonic() - started, world_after=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--during-save", action="store_true",
                        help="sharded checkpoints; the node is killed halted inside its save of step 6")
    parser.add_argument("--scale-up", action="store_true", help="a second node joins the running job instead")
    parser.add_argument("overrides", nargs="*", help="config overrides for both nodes, e.g. launch.last_call_s=30")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
        weights = reference(Path(tmp) / "reference")
        extra = tuple(args.overrides)
        for k in range(args.rounds):
            round_root = Path(tmp) / f"round{k}"
            row = (scale_up_round(round_root, weights, extra) if args.scale_up
                   else one_round(round_root, weights, args.during_save, extra))
            rows.append(row)
            print(f"round {k + 1}: {row}", flush=True)
    exact = [r for r in rows if r["exit"] == 0 and r["changes"] == 1 and r["each_sample_once"]
             and r["max_weight_diff"] is not None and r["max_weight_diff"] <= WEIGHTS_TOL]
    print("\n| round | exit | wall s | seconds lost | samples retrained | resumed at step | max weight diff | each sample once |"
          "\n|---|---|---|---|---|---|---|---|")
    for k, r in enumerate(rows, 1):
        print(f"| {k} | {r['exit']} | {r['wall_s']} | {r['seconds_lost']} | {r['samples_retrained']} | "
              f"{r['resumed_step']} | {r['max_weight_diff']} | {r['each_sample_once']} |")
    lost = [r["seconds_lost"] for r in rows if r["seconds_lost"] is not None]
    print(f"\n{len(exact)} of {len(rows)} rounds exact (exit 0, one change, weights within {WEIGHTS_TOL:g}, each "
          f"sample once); "
          f"seconds lost per change: median {statistics.median(lost) if lost else 'n/a'}")
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "cores": os.cpu_count(),
                "torch": torch.__version__}
        args.json.write_text(json.dumps({"rounds": rows, "exact": len(exact), **meta}, indent=2) + "\n")
    sys.exit(0 if len(exact) == len(rows) else 1)


if __name__ == "__main__":
    main()
