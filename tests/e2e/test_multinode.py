"""Multi-node, run for real: two "nodes" on 127.0.0.1 train as one 2-rank job.

Each node is its own ``gputrain train`` command (its own torchrun agent, or its own SLURM task; a process forked from
the preloaded server, tests/forked_cli.py) with its own ``--out`` folder, as on two machines; only the data folder is
shared. The job must end with the weights of a 2-process single-node run of the same settings, and only rank 0's folder
receives the run (checkpoints, summary).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from forked_cli import Started, start_gputrain
from gputrain.data.imagefolder import make_frames
from gputrain.launcher.spec import free_port

pytestmark = pytest.mark.slow

TIMEOUT_S = 400
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (pytest may itself run under SLURM or torchrun)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    # One thread per rank: the same reduction order in every run, and 2 ranks per run on 2 cores.
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _train_args(data: Path, out: Path) -> list[str]:
    return ["train", "autoencoder", "--accelerator", "cpu",
            "--data-root", str(data), "--out", str(out), "--epochs", "2", "--batch-size", "2", "--seed", "0",
            "trainer.progress_bar=false", "trainer.loggers=[]", "trainer.log_every_n_steps=1"]


def _start_all(commands: list[tuple[list[str], dict[str, str]]], cwds: list[Path] | None = None) -> list[Started]:
    """Start every ``gputrain`` command at once (the nodes must meet), each a process of its own forked from the
    preloaded server (tests/forked_cli.py): a node's agent imports torch, 3 CPU-s in a new interpreter."""
    return [start_gputrain(args, env=env, cwd=cwds[k] if cwds else None) for k, (args, env) in enumerate(commands)]


def _run_all(commands: list[tuple[list[str], dict[str, str]]]) -> list[subprocess.CompletedProcess]:
    """Run every command at once, and wait for all of them; each must succeed."""
    done = [started.wait(timeout=TIMEOUT_S) for started in _start_all(commands)]
    for d in done:
        assert d.returncode == 0, f"{' '.join(map(str, d.args))} exited {d.returncode}:\n{d.stdout[-2000:]}\n" \
                                  f"{d.stderr[-4000:]}"
    return done


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _rank0_folder(folders: list[Path]) -> Path:
    """The one node folder that holds the run: rank 0 owns the run folder, the other rank writes nothing."""
    holders = [f for f in folders if (f / "checkpoints" / "last.pt").is_file()]
    assert len(holders) == 1, f"expected exactly one node to hold the checkpoint, found {holders}"
    for other in set(folders) - set(holders):
        assert not other.exists() or not any(other.iterdir()), f"rank 1 wrote into {other}: {list(other.iterdir())}"
    return holders[0]


def _assert_one_two_rank_job(run: Path, epochs: int = 2) -> None:
    """2 ranks; 8 training images (half of 16) at a global batch of 2 x 2 make 2 steps an epoch, 2 epochs."""
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["global_step"], summary["samples_seen"]) == (2, 2 * epochs, 8 * epochs)


@pytest.fixture(scope="module")
def frames(tmp_path_factory) -> Path:
    return make_frames(tmp_path_factory.mktemp("data") / "frames", count=16, size=40, videos=2)  # ConvAutoencoder needs a multiple of 20


@pytest.fixture(scope="module")
def reference(frames, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The 2-process single-node run: ``--devices 2``."""
    out = tmp_path_factory.mktemp("single_node") / "run"
    _run_all([(_train_args(frames, out) + ["--devices", "2"], _clean_env())])
    _assert_one_two_rank_job(out)
    return _weights(out)


def test_two_slurm_tasks_train_as_one_job(frames, reference, tmp_path):
    port = str(free_port())
    folders = [tmp_path / f"task{k}" for k in range(2)]
    commands = [(_train_args(frames, folders[k]),
                 _clean_env(SLURM_PROCID=str(k), SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_ID="4242",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for k in range(2)]
    done = _run_all(commands)
    run = _rank0_folder(folders)
    _assert_one_two_rank_job(run)
    assert "world_size=2" in "".join(d.stdout for d in done)
    assert _max_diff(_weights(run), reference) <= 1e-6
    # SLURM requeues the job on one task (issue 45): it resumes on the new world size with the global batch kept,
    # trains the third epoch's samples once, and records the change in metrics.jsonl.
    args = _train_args(frames, run)
    args[args.index("--epochs") + 1] = "3"
    [done_again] = _run_all([([*args, "--resume", "auto"], _clean_env(SLURM_RESTART_COUNT="1", SLURM_JOB_ID="4242"))])
    assert "the job went from 2 to 1 process(es) and resumed at step 4" in done_again.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["global_batch"], summary["samples_seen"]) == (1, 4, 24)
    assert (summary["membership_changes"], summary["restarts"]) == (1, 0)


def _node_commands(frames: Path, folders: list[Path], extra: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    endpoint = f"127.0.0.1:{free_port()}"
    return [(_train_args(frames, folders[k]) + ["--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint", endpoint,
                                               "--devices", "1", *extra], _clean_env()) for k in range(2)]


def test_two_torchrun_nodes_train_as_one_job_and_resume_auto_follows_rank_0s_checkpoint(frames, reference, tmp_path):
    # Two torchrun nodes on loopback train epoch 1 as one 2-rank job. Only node 0's folder holds last.pt after it;
    # node 1's is empty, as with node-local disks. (One test: each 2-node launch costs 4 processes.)
    folders = [tmp_path / f"node{k}" for k in range(2)]
    _run_all(_node_commands(frames, folders, ["--epochs", "1"]))
    _assert_one_two_rank_job(_rank0_folder(folders), epochs=1)
    assert not folders[1].exists() or not any(folders[1].iterdir())
    done = _run_all(_node_commands(frames, folders, ["--epochs", "2", "--resume", "auto"]))
    assert "resumed from" in "".join(d.stdout for d in done)
    run = _rank0_folder(folders)
    _assert_one_two_rank_job(run)
    assert _max_diff(_weights(run), reference) <= 1e-6  # both ranks continued from the same checkpoint


def test_resume_auto_fails_in_one_line_when_another_node_cannot_read_the_checkpoint(frames, tmp_path):
    # A relative --out resolved in different working folders: node 1 cannot see node 0's checkpoint.
    homes = [tmp_path / f"home{k}" for k in range(2)]
    for home in homes:
        home.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"

    def commands(extra: list[str]) -> list[Started]:
        return _start_all([(_train_args(frames, Path("run")) + [
            "--nnodes", "2", "--node-rank", str(k), "--rdzv-endpoint", endpoint, "--devices", "1", *extra],
            _clean_env()) for k in range(2)], cwds=homes)

    # Node 0's checkpoint, made by one process (any world size resumes it): a 2-node launch costs 4 processes.
    [first] = _start_all([(_train_args(frames, Path("run")) + ["--epochs", "1"], _clean_env())], cwds=homes[:1])
    assert first.wait(timeout=TIMEOUT_S).returncode == 0
    results = [started.wait(timeout=TIMEOUT_S) for started in commands(["--epochs", "2", "--resume", "auto"])]
    assert all(done.returncode != 0 for done in results)
    errors = "".join(done.stderr for done in results)
    assert "cannot read run/checkpoints/" in errors and "the checkpoint rank 0 resumes from" in errors
    assert "Traceback" not in errors
    assert not (homes[1] / "run" / "checkpoints").exists()  # node 1 did not start a run of its own
