"""The one place that knows rank, world size and device.

Everything distributed reads a frozen :class:`DistInfo` that is passed in; nothing
stores rank on ``args`` or in module globals. Processes are started by torchrun's own
machinery (``torch.distributed.run``) or by SLURM; this module only joins them.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_MESHES: weakref.WeakSet[Any] = weakref.WeakSet()
"""The meshes :func:`device_mesh` made: their groups are dropped by :func:`teardown`."""


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


@functools.cache
def node_name() -> str:
    """This process's node as a membership record names it: ``host/pid`` of the process that started it (torchrun's
    agent, gputrain's launcher or SLURM's step daemon). The pid tells apart nodes that share a host (the loopback
    tests) and a node started again on the same host. Taken once, as the process joins the job: a rank whose agent
    was killed is re-parented before its last checkpoint, which must still name its node."""
    import socket

    return f"{socket.gethostname()}/{os.getppid()}"


def restart_attempt() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restarts_left() -> int:
    """How many more times torchrun would restart this worker group after a failure (``--max-restarts``)."""
    return max(0, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) - restart_attempt())


def init_distributed(accelerator: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the job this process belongs to and return its :class:`DistInfo`.

    Without a launcher in the environment this is a plain single process. The backend is
    nccl on CUDA and gloo on CPU.
    """
    node_name()  # while the process that started this one is still its parent
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
        _import_modules_that_capture_the_world_group()
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
        atexit.register(_teardown_at_exit)
    return DistInfo(
        rank=dist.get_rank(), local_rank=layout["local_rank"], world_size=dist.get_world_size(), device=device
    )


def _import_modules_that_capture_the_world_group() -> None:
    """Import, while no group exists, the torch modules whose functions take ``group=dist.group.WORLD`` as a default.

    A default is evaluated once, at import: imported after ``init_process_group`` (as building an FSDP model or a
    task does), each of them holds the world group for the life of the process, so ``destroy_process_group`` cannot
    free it, gloo's threads outlive :func:`teardown`, and interpreter exit aborts the rank ("terminate called without
    an active exception", SIGABRT) after the job has finished: 4 of 30 two-rank evals under load before this import.
    """
    import torch.distributed.fsdp.sharded_grad_scaler  # noqa: F401
    import torch.distributed.nn.functional  # noqa: F401
    import torch.distributed.optim.zero_redundancy_optimizer  # noqa: F401


def device_mesh(device_type: str, world_size: int) -> Any:
    """A 1-D ``DeviceMesh`` over the job's ranks (what FSDP shards over), released by :func:`teardown`.

    torch 2.14's ``DeviceMesh`` keeps its groups in ``_pg_registry``, and DTensor's sharding caches keep an FSDP run's
    mesh alive after ``destroy_process_group``: the group would live on, with its threads, to interpreter exit.
    Meshes made here have their groups dropped when the group is destroyed.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size,))
    _MESHES.add(mesh)
    return mesh


def teardown() -> None:
    """Destroy the process group if this process made one, and drop the groups the meshes made here hold."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for mesh in list(_MESHES):
        getattr(mesh, "_pg_registry", {}).clear()


def _teardown_at_exit() -> None:
    teardown()
    # A model wrapped by FSDP sits in reference cycles that hold its group: left to the collector of interpreter
    # exit, the group's gloo threads are torn down after Python is and abort the rank ("terminate called without
    # an active exception", SIGABRT) after a job that finished. Collected here, the group is freed while Python runs.
    gc.collect()
