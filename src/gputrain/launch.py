"""Start worker processes with torchrun's own machinery; never a home-made pool.

``gputrain train ... --devices N`` re-executes itself under ``torch.distributed.run``
(the module behind ``torchrun``). Python callers use :func:`launch`, which goes through
``torch.distributed.launcher.api.elastic_launch``: the same elastic agent and rendezvous.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from gputrain.dist import launched_env

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How many processes to start and how nodes meet."""

    nproc_per_node: int = 1
    """Worker processes on this node (``--devices``)."""
    nnodes: int = 1
    """Nodes in the job; above 1 a rendezvous endpoint is required."""
    node_rank: int = 0
    """This node's index (static rendezvous); ignored by c10d rendezvous."""
    rdzv_endpoint: str = ""
    """host:port of the c10d rendezvous store for multi-node jobs."""
    rdzv_id: str = "gputrain"
    """Job id shared by all nodes of one job."""
    max_restarts: int = 0
    """Elastic restarts of the worker group after a failure."""

    @property
    def needs_launch(self) -> bool:
        """Whether this process must start workers rather than be one."""
        return launched_env() is None and (self.nproc_per_node > 1 or self.nnodes > 1)


def free_port() -> int:
    """A TCP port that was free a moment ago on loopback (for standalone jobs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_args(spec: LaunchSpec, program: Sequence[str]) -> list[str]:
    """The ``torchrun`` argument list that runs ``program`` (``-m module args...``)."""
    args = [f"--nproc-per-node={spec.nproc_per_node}", f"--max-restarts={spec.max_restarts}"]
    if spec.nnodes == 1:
        args.append("--standalone")
    else:
        if not spec.rdzv_endpoint:
            raise ValueError(
                f"--nnodes {spec.nnodes} needs --rdzv-endpoint HOST:PORT (the address of one node that "
                "every node can reach)"
            )
        args += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
        ]
    return args + list(program)


def run_torchrun(spec: LaunchSpec, module: str, module_args: Sequence[str]) -> None:
    """Run ``python -m module module_args`` in ``spec.nproc_per_node`` workers via torchrun."""
    from torch.distributed.run import get_args_parser, run

    # torchrun would set 1 thread per worker and warn; a share of the cores is a better default.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node)))
    # --no-python with sys.executable keeps the workers on the interpreter (and venv) we run in.
    argv = ["--no-python", *torchrun_args(spec, [sys.executable, "-m", module, *module_args])]
    run(get_args_parser().parse_args(argv))


def launch(fn: Callable[..., T], *args: Any, devices: int = 2, max_restarts: int = 0) -> T:
    """Run ``fn(*args)`` in ``devices`` processes on this node and return rank 0's result.

    See :func:`launch_all` for every rank's result.
    """
    return launch_all(fn, *args, devices=devices, max_restarts=max_restarts)[0]


def launch_all(fn: Callable[..., T], *args: Any, devices: int = 2, max_restarts: int = 0) -> list[T]:
    """Run ``fn(*args)`` in ``devices`` processes on this node; return each rank's result, by rank.

    ``fn`` must be importable by name (a module-level function), since workers are
    spawned. Each worker should call :func:`gputrain.dist.init_distributed`.
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=devices,
        run_id=f"gputrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"is_host": True},
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    results = elastic_launch(config, fn)(*args)
    return [results[r] for r in range(devices)]
