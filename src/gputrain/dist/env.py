"""The one place that knows rank, world size and device.

Everything distributed reads a frozen :class:`DistInfo` that is passed in; nothing
stores rank on ``args`` or in module globals. Processes are started by torchrun's own
machinery (``torch.distributed.run``) or by SLURM; this module only joins them.
"""

from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    """Global rank, 0 .. world_size-1."""
    local_rank: int = 0
    """Rank on this node; picks the CUDA device."""
    world_size: int = 1
    """Number of processes in the job."""
    device: torch.device = torch.device("cpu")
    """The device this process computes on."""

    @property
    def is_main(self) -> bool:
        """True on the one process that logs, prints and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is in use."""
        return self.world_size > 1


def resolve_accelerator(accelerator: str) -> str:
    """Map ``auto`` to ``cuda`` or ``cpu``; refuse ``cuda`` on a machine without one."""
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.accelerator={accelerator!r} is not one of auto, cpu, cuda")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "trainer.accelerator=cuda but torch sees no CUDA device; use --accelerator cpu "
            "(or auto) on this machine"
        )
    return accelerator


def launched_env() -> dict[str, int] | None:
    """Rank layout from the environment when torchrun or SLURM started this process, else None.

    torchrun sets RANK/LOCAL_RANK/WORLD_SIZE. Under ``srun`` we read SLURM's variables and
    fill in what ``init_process_group(init_method="env://")`` needs.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "rank": int(env["RANK"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
            "world_size": int(env["WORLD_SIZE"]),
        }
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if "MASTER_ADDR" not in env:
            raise ValueError(
                "running under SLURM with several tasks but MASTER_ADDR is not set; export "
                "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) in the "
                "batch script (and MASTER_PORT if 29500 is taken)"
            )
        return {
            "rank": int(env["SLURM_PROCID"]),
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
            "world_size": int(env["SLURM_NTASKS"]),
        }
    return None


def restart_attempt() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def init_distributed(accelerator: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the job this process belongs to and return its :class:`DistInfo`.

    Without a launcher in the environment this is a plain single process. The backend is
    nccl on CUDA and gloo on CPU.
    """
    kind = resolve_accelerator(accelerator)
    layout = launched_env()
    if layout is None:
        device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
        return DistInfo(device=device)

    if kind == "cuda":
        n = torch.cuda.device_count()
        if layout["local_rank"] >= n:
            raise ValueError(
                f"local rank {layout['local_rank']} has no GPU: this node has {n}; "
                f"start at most {n} processes per node (--devices {n})"
            )
        device = torch.device("cuda", layout["local_rank"])
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_PORT", "29500")
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world_size = next(dist.rendezvous(
            "env://", rank=layout["rank"], world_size=layout["world_size"], timeout=timeout))
        # After an elastic restart torchrun hands the workers the same rendezvous store, which still
        # holds the previous attempt's keys: gloo then connects to the dead attempt's ports
        # (pytorch/pytorch#167288). A key prefix per attempt keeps each attempt's group apart.
        attempt = restart_attempt()
        dist.init_process_group(
            backend="nccl" if kind == "cuda" else "gloo",
            store=dist.PrefixStore(f"gputrain/attempt{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if kind == "cuda" else None,
        )
        # gputrain made the group, so gputrain ends it: left to interpreter exit, gloo's threads may be torn down
        # while running and abort the process ("terminate called without an active exception", SIGABRT), and
        # torchrun or a scheduler then marks a job that trained as failed. atexit runs before that teardown.
        atexit.register(teardown)
    return DistInfo(
        rank=dist.get_rank(), local_rank=layout["local_rank"], world_size=dist.get_world_size(), device=device
    )


def teardown() -> None:
    """Destroy the process group if this process made one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
