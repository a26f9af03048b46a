"""An elastic job stays exact when a node leaves or joins (issue 45): two torchrun agents as two nodes on loopback,
gloo, the same command line and the same ``--out`` (tests/elastic_runs.py).

- Scale-down: node B (agent and worker) is SIGKILLed mid-epoch. Node A's worker fails on the lost peer, its agent
  restarts it, the rendezvous goes on with one node, and the run resumes from the newest whole checkpoint on one
  process with the global batch kept. It ends with the weights of an uninterrupted one-process run, and the samples
  the restarted worker reads are exactly the epoch plan's from the checkpoint on, each once.
- Killed during a save: with sharded checkpoints, node B is SIGKILLed while its writer thread is halted at its
  first fsync of step 6's shards; step 6 is never committed, and the job resumes from step 4 with the same ending.
- Scale-up: node A trains alone; node B starts later with the same command. A's agent stops its worker (which saves
  a checkpoint on the agent's SIGTERM), both meet in the next round, and the run resumes on two processes with the
  global batch kept, ending with the uninterrupted weights. A's worker waits in its 4th step until it is stopped:
  on a busy machine it finished the epoch alone before B's agent was up (the test then tested nothing).
- Below the fewest nodes: one line and a non-zero exit within the rendezvous timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

import elastic_runs as el
from forked_cli import run_gputrain
from gputrain.checkpoint import load_checkpoint, model_weights
from gputrain.cli import main
from gputrain.data.samplers import EpochPlan
from gputrain.launcher.spec import free_port

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run: one process, the same global batch."""
    root = tmp_path_factory.mktemp("reference")
    assert main(["train", str(el.recipe(root)), "--batch-size", str(GLOBAL_BATCH), "--seed", "0", "--out",
                 str(root / "run")]) == 0
    return load_checkpoint(root / "run" / "checkpoints" / "last.pt")["model"]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _close(reference: dict[str, torch.Tensor], run: Path) -> float:
    weights = model_weights(run / "checkpoints" / "last.pt")  # a full checkpoint's, or a sharded one's folder
    return max(float((weights[k] - reference[k]).abs().max()) for k in reference)



# About 30 s each: two nodes start, one is killed, the other restarts, re-meets and finishes.
@pytest.mark.parametrize("when", ["after a save", "during a sharded save"])
def test_a_node_killed_mid_epoch_leaves_the_job_to_the_other_with_the_uninterrupted_weights(tmp_path, reference, when):
    """After a save: node B goes once the checkpoint of step 4 is written. During a sharded save (each rank writes
    its own shards): B's writer halts at its first fsync of step 6's folder, its shard written but not synced, and B
    is killed there; step 6 is never committed, so the job resumes from step 4 and loses nothing."""
    sharded = when == "during a sharded save"
    port = free_port()
    # Both start at once, so both meet in the first round; the one that does not host the rendezvous store goes.
    overrides = ["parallel.sharded_checkpoint=true"] if sharded else []
    names = {}
    a, b = el.node(tmp_path, port, "A", *overrides, fork=True), el.node(tmp_path, port, "B", *overrides, fork=True)
    names[a.pid], names[b.pid] = "A", "B"
    worker: list[int] = []
    try:
        checkpoints = tmp_path / "run" / "checkpoints"
        el.wait_for(lambda: el.hosting(port, [a.pid, b.pid]) is not None, 120, "the rendezvous store")
        if el.hosting(port, [a.pid, b.pid]) == b.pid:
            a, b = b, a
        if sharded:
            halted = el.stop_in_the_save_of(tmp_path, names[b.pid], "step_000006.dcp")
            el.wait_for(halted.is_file, 120, f"node {names[b.pid]} halting in the save of step 6")
            assert not (checkpoints / "step_000006.pt").exists()
            el.kill_node(b)
        else:
            el.wait_for(lambda: (checkpoints / "step_000004.pt").is_file(), 120, "the checkpoint of step 4")
            # Only the node's command (its torchrun agent) is killed, as `kill -9 PID` would: its worker, in a
            # session of its own, must not train on without it (it stops at a step boundary, with a checkpoint).
            worker = el.children(b.pid)
            b.kill()
            b.wait()
            el.wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in worker),
                        30, "node B's worker to follow its agent")
            # It stopped, not finished the job on two processes (A needs seconds to meet alone and resume).
            assert not (checkpoints / f"step_{el.N // GLOBAL_BATCH:06d}.pt").exists(), "B's worker trained on"
        assert a.wait(timeout=180) == 0, (tmp_path / f"{names[a.pid]}.log").read_text()[-3000:]
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                el.kill_node(proc)
        for pid in worker:  # a worker left behind by its killed agent (it must not be)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log = (tmp_path / f"{names[a.pid]}.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    [change] = el.membership(tmp_path / "run")
    assert (change["event"], change["world_size_before"], change["world_size"]) == ("membership", 2, 1)
    assert change["seconds_lost"] > 0 and change["samples_retrained"] >= 0
    gone = f"{socket.gethostname()}/{b.pid}"  # the killed node: its agent is the workers' parent
    assert (change["nodes_left"], change["nodes_joined"]) == ([gone], [])
    assert f"the job went from 2 to 1 process(es) (node {gone} left) and resumed at step {change['step']}" in log
    if sharded:  # the newest committed checkpoint when B went: step 6's shards were never whole
        assert change["step"] == 4, change
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["global_step"] == el.N // GLOBAL_BATCH
        assert sorted(p.name for p in checkpoints.glob("*.dcp")) == sorted(
            torch.load(p, weights_only=True)["sharded"] for p in checkpoints.glob("*.pt") if p.name != "last.pt"
        ), "a folder no checkpoint names was left"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["membership_changes"] == 1 and summary["world_size"] == 1
    assert _close(reference, tmp_path / "run") <= el.WEIGHTS_TOL
    # Every sample of the epoch from the resumed step on, each once, in the plan's order of one process.
    order = EpochPlan(el.N, seed=0, epoch=0, dp_size=1, batch_size=GLOBAL_BATCH).order
    after = [index for pid, ws, index in el.served(tmp_path) if ws == 1]
    assert after == order[change["step"] * GLOBAL_BATCH:]


# About 20 s: one node trains, a second joins, both restart and finish together.
def test_a_node_that_joins_a_running_job_is_taken_in_at_the_next_restart_with_the_uninterrupted_weights(tmp_path,
                                                                                                        reference):
    """torch's agents share their rendezvous TCP store with the workers by default, and a node that first meets the
    others in a later round of the rendezvous then waits for an address the staying node never writes into that
    round: the job would end at the join timeout (20 s here). gputrain turns the sharing off for several nodes."""
    port = free_port()
    # --batch-size 4 on both: A alone trains with the global batch of 4; after the join, 2 per process keep it.
    same = ["--batch-size", str(GLOBAL_BATCH), "launch.join_timeout_s=20"]
    # A alone trains 3 steps and waits in its 4th until its agent stops it for B, however slowly B starts.
    a = el.node(tmp_path, port, "A", *same, env={el.ALONE_UNTIL_STOPPED: str(3 * GLOBAL_BATCH)}, fork=True)
    b = None
    try:
        el.wait_for(lambda: (tmp_path / "run" / "checkpoints" / "step_000002.pt").is_file(), 120, "A's step 2")
        b = el.node(tmp_path, port, "B", *same, fork=True)
        assert a.wait(timeout=180) == 0, (tmp_path / "A.log").read_text()[-3000:]
        assert b.wait(timeout=60) == 0, (tmp_path / "B.log").read_text()[-3000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                el.kill_node(proc)
    log = (tmp_path / "A.log").read_text()
    assert "Traceback" not in log + (tmp_path / "B.log").read_text(), log[-3000:]
    [change] = el.membership(tmp_path / "run")
    assert (change["event"], change["world_size_before"], change["world_size"]) == ("membership", 1, 2)
    assert (change["step"], change["samples_retrained"]) == (4, 0), change  # A saved step 4 as its agent stopped it
    joined = f"{socket.gethostname()}/{b.pid}"
    assert (change["nodes_left"], change["nodes_joined"]) == ([], [joined])
    assert f"the job went from 1 to 2 process(es) (node {joined} joined) and resumed at step {change['step']}" in log
    # A's worker, stopped by its agent for the restart, says the job goes on by itself (not only "continue with").
    assert "; if torchrun restarts the workers (a node joined or left, or a rank failed with restarts left), they " \
           "continue from it by themselves; if the whole job was stopped, continue with: " in log, log[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["membership_changes"] == 1 and summary["world_size"] == 2
    assert summary["global_step"] == el.N // GLOBAL_BATCH
    assert _close(reference, tmp_path / "run") <= el.WEIGHTS_TOL
    # A alone read the plan's first steps in order; the two processes together read the rest, each sample once.
    order = EpochPlan(el.N, seed=0, epoch=0, dp_size=1, batch_size=GLOBAL_BATCH).order
    cut = change["step"] * GLOBAL_BATCH
    alone = [index for pid, ws, index in el.served(tmp_path) if ws == 1]
    together = [index for pid, ws, index in el.served(tmp_path) if ws == 2]
    assert alone[:cut] == order[:cut]
    assert sorted(together) == sorted(order[cut:])


def test_fewer_nodes_than_the_job_needs_end_in_one_line_within_the_rendezvous_timeout(tmp_path):
    start = time.monotonic()
    done = run_gputrain(["train", str(el.recipe(tmp_path)), "--nnodes", "2:2", "--rdzv-endpoint",
                         f"127.0.0.1:{free_port()}", "--out", str(tmp_path / "run"), "launch.join_timeout_s=5"],
                        env=el.ENV, timeout=120)
    assert done.returncode != 0 and time.monotonic() - start < 5 + 30
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("gputrain: error: fewer than 2 node(s) met at the rendezvous 127.0.0.1:")
    assert "launch.join_timeout_s=5 s" in lines[-1] and "Traceback" not in done.stderr
