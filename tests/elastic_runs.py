"""An elastic job on this machine: two torchrun agents as two nodes on loopback, started with the same command line and
the same ``--out`` (as nodes on a shared file system would be), for tests/e2e/test_elastic.py (issue 45).

The task's training set records every sample it serves (process, world size, index) in ``served.txt`` beside the
data, and reads slowly enough (``SLOW_S`` a sample) that a node can be stopped in the middle of the epoch.

A node can also be stopped in the middle of a save (:func:`stop_in_the_save_of`): its worker's checkpoint-writing
thread halts at its first ``fsync`` of that save, the shard it wrote not yet synced and the checkpoint not
committed, and says so in a file, so the test can SIGKILL the node there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

N = 64
SLOW_S = 0.05
TESTS = str(Path(__file__).resolve().parent)


ALONE_UNTIL_STOPPED = "ELASTIC_ALONE_UNTIL_STOPPED"
"""In a node's environment: after this many reads, a worker that is alone (world size 1) waits in its next read
until its agent stops it (SIGTERM, as for a node that joins), so a node started later always joins a job still
running, however slowly it starts; at most ``JOIN_WAIT_S``."""
JOIN_WAIT_S = 120.0
WEIGHTS_TOL = 5e-6
"""Largest weight difference from the uninterrupted run: float32 sums of the same gradients in another order (the
world changes size mid-run). Measured up to 9.5e-7 in 5 scale-downs (docs/benchmarks.md); a sample read twice or
skipped, or another global batch, moves the weights by 1e-3 or more."""


class Recorded(Dataset):
    """``N`` fixed random vectors; each read appends ``pid world_size index`` to ``served``."""

    def __init__(self, served: Path) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(N, 8, generator=g)
        self.served = served
        self.reads = 0

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        alone_until = int(os.environ.get(ALONE_UNTIL_STOPPED, "0"))
        if alone_until and self.reads == alone_until + 1 and os.environ.get("WORLD_SIZE") == "1":
            _wait_for_sigterm()
        time.sleep(SLOW_S)
        with self.served.open("a") as f:
            f.write(f"{os.getpid()} {os.environ.get('WORLD_SIZE', '1')} {index}\n")
        return self.x[index], self.x[index].sum(0, keepdim=True)


def _wait_for_sigterm() -> None:
    """Wait until this process is sent SIGTERM (gputrain's own handler still runs: it stops after this step)."""
    stopped = threading.Event()
    handler = signal.getsignal(signal.SIGTERM)

    def note(signum: int, frame: Any) -> None:
        stopped.set()
        if callable(handler):
            handler(signum, frame)

    signal.signal(signal.SIGTERM, note)
    deadline = time.monotonic() + JOIN_WAIT_S
    while not stopped.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)  # short sleeps: the handler runs between them


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


STOP_FILE = "stop_in_save"
"""In the data folder: ``NODE FOLDER``, the node whose worker halts in the save that writes ``FOLDER``."""


def stop_in_the_save_of(root: Path, node_name: str, folder: str) -> Path:
    """Arm node ``node_name`` to halt in the save that writes ``folder`` (a sharded checkpoint's ``.dcp`` folder);
    returns the file that appears once it has halted there."""
    (root / "data" / STOP_FILE).write_text(f"{node_name} {folder}")
    return root / "data" / "halted_in_save"


def _halt_in_a_save(data: Path, out: Path) -> None:
    """In the first run's workers: every thread started from now on (DCP's writer among them) halts at its first
    ``os.fsync`` once the armed node's armed save has begun (its folder exists), and stays there until killed."""
    name = os.environ.get("ELASTIC_NODE", "")
    if not name or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return

    def trap(frame: Any, event: str, arg: Any) -> None:
        if event != "c_call" or arg is not os.fsync:
            return
        try:
            armed, folder = (data / STOP_FILE).read_text().split()
        except (OSError, ValueError):
            return
        if armed == name and (out / "checkpoints" / folder).is_dir():
            threading.setprofile(None)
            (data / "halted_in_save").write_text(f"{name} {os.getpid()} {threading.current_thread().name}")
            time.sleep(600)

    threading.setprofile(trap)


def build(cfg: Any) -> Any:
    """``task: elastic_runs:build``."""
    from gputrain.models import build_model
    from gputrain.tasks.base import Task
    from gputrain.tasks.spec import TaskSpec

    _halt_in_a_save(Path(cfg.data.root), Path(cfg.trainer.out))
    return TaskSpec(task=Task(nn.functional.mse_loss), model=build_model(cfg.model.name),
                    train_data=Recorded(Path(cfg.data.root) / "served.txt"), val_data=None)


def recipe(root: Path) -> Path:
    (root / "data").mkdir(parents=True, exist_ok=True)
    path = root / "elastic.yaml"
    path.write_text(f"task: elastic_runs:build\nmodel:\n  name: elastic_runs:model\ndata:\n  root: {root / 'data'}\n"
                    "  num_workers: 0\noptim:\n  name: sgd\n  lr: 0.05\n  momentum: 0.9\n"
                    "trainer:\n  strategy: ddp\n  accelerator: cpu\n  epochs: 1\n  batch_size: 2\n"
                    "  checkpoint_every_n_steps: 2\n  log_every_n_steps: 1\n  progress_bar: false\n  pictures: 0\n"
                    "  loggers: []\nlaunch:\n  last_call_s: 5\n  join_timeout_s: 60\n  keep_alive_s: 1\n")
    return path


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}


class ForkedNode:
    """A node's ``gputrain train`` forked from the test worker's preloaded server (tests/forked_cli.py), with the
    part of ``subprocess.Popen`` the tests use: its agent's import of torch is not paid again for every node (its
    workers are new interpreters, as torchrun starts them)."""

    def __init__(self, started: Any) -> None:
        self.process = started.process
        self.pid: int = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"node {self.pid}", timeout or 0)
        return self.process.exitcode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


Node = subprocess.Popen[str] | ForkedNode


def node(root: Path, port: int, name: str, *overrides: str, env: dict[str, str] | None = None,
         fork: bool = False) -> Node:
    """One node: ``gputrain train`` with its torchrun agent, in a session of its own; output in ``root/name.log``.
    ``fork``: forked from the preloaded server (the tests), else a new interpreter (benchmarks/elastic.py, whose
    figures include a node's start)."""
    args = ["train", str(recipe(root)), "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts",
            "3", "--out", str(root / "run"), "--seed", "0", *overrides]
    environ, log = {**ENV, "ELASTIC_NODE": name, **(env or {})}, root / f"{name}.log"
    if fork:
        from forked_cli import Started

        log.write_text("")
        return ForkedNode(Started(args, environ, None, streams=(str(log), str(log))))
    return subprocess.Popen([sys.executable, "-m", "gputrain", *args], env=environ, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def hosting(port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` (or their descendants) listens on ``port``: the node that hosts the rendezvous store."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    for pid in pids:
        for owner in [pid, *children(pid)]:
            try:
                links = [os.readlink(fd) for fd in Path(f"/proc/{owner}/fd").iterdir()]
            except OSError:
                continue
            if any(link == f"socket:[{inode}]" for link in links for inode in inodes):
                return pid
    return None


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), deepest last."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for kid in kids.get(todo.pop(), []):
            found.append(kid)
            todo.append(kid)
    return found


def kill_node(proc: Node) -> None:
    """SIGKILL a node: its agent and every worker (the workers lead sessions of their own)."""
    for pid in [proc.pid, *children(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.02)


def served(root: Path) -> list[tuple[int, int, int]]:
    path = root / "data" / "served.txt"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [tuple(int(v) for v in line.split()) for line in lines if len(line.split()) == 3]  # type: ignore[misc]


def membership(run: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("event") in ("membership", "restart")]
