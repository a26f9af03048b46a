"""What to launch: how many processes a node starts (as the strategy is registered) and how nodes meet.

No torch at import: the command line reads a config and decides whether it is a worker before anything heavy.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputrain.config.schema import RunConfig

LAUNCHER_ENV = "GPUTRAIN_LAUNCHER"
"""Set for workers that ``gputrain`` started: they record errors and leave printing them to the launcher."""


def is_worker() -> bool:
    """Whether torchrun, SLURM or gputrain's launcher started this process as a rank (asks :mod:`gputrain.dist`, and
    so imports torch, only when their variables are set)."""
    if not any(name in os.environ for name in ("RANK", "SLURM_PROCID")):
        return False
    from gputrain.dist import launched_env

    return launched_env() is not None


def debug() -> bool:
    """``GPUTRAIN_DEBUG=1``: tracebacks and torchrun's log lines instead of one-line errors."""
    return bool(os.environ.get("GPUTRAIN_DEBUG"))


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How many processes to start and how nodes meet."""

    nproc_per_node: int = 1
    """Worker processes on this node (what the strategy says ``--devices`` means)."""
    nnodes: int = 1
    """Nodes in the job (the fewest, for an elastic one); above 1 a rendezvous endpoint is required."""
    max_nodes: int = 0
    """The most nodes of an elastic job (0: ``nnodes``, a fixed size)."""
    node_rank: int = 0
    """This node's index (static rendezvous); ignored by c10d rendezvous."""
    rdzv_endpoint: str = ""
    """host:port of the c10d rendezvous store for multi-node jobs."""
    rdzv_id: str = "gputrain"
    """Job id shared by all nodes of one job."""
    max_restarts: int = 0
    """Elastic restarts of the worker group after a failure."""
    join_timeout_s: int = 600
    """Seconds the rendezvous waits for ``nnodes`` nodes."""
    last_call_s: int = 30
    """Seconds an elastic rendezvous waits for more nodes once ``nnodes`` have joined."""
    keep_alive_s: int = 5
    """Seconds between an agent's heartbeats; the rendezvous drops a node that missed 3 (a lost node's cost)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> LaunchSpec:
        """The launch of ``cfg``: its strategy's registration says how many processes ``trainer.devices`` starts."""
        from gputrain.strategies import processes_per_node

        nproc = processes_per_node(cfg.trainer.strategy, cfg.trainer.devices)
        launch = cfg.launch
        return cls(nproc_per_node=nproc, nnodes=launch.nnodes, max_nodes=launch.max_nodes, node_rank=launch.node_rank,
                   rdzv_endpoint=launch.rdzv_endpoint, rdzv_id=launch.rdzv_id, max_restarts=launch.max_restarts,
                   join_timeout_s=launch.join_timeout_s, last_call_s=launch.last_call_s,
                   keep_alive_s=launch.keep_alive_s)

    @property
    def most_nodes(self) -> int:
        return max(self.nnodes, self.max_nodes)

    @property
    def needs_launch(self) -> bool:
        """Whether this process must start workers rather than be one."""
        return not is_worker() and (self.nproc_per_node > 1 or self.most_nodes > 1)

    @property
    def elastic(self) -> bool:
        """Whether the job needs torchrun's elastic agent: several nodes to meet, or restarts after a failure."""
        return self.most_nodes > 1 or self.max_restarts > 0

    @property
    def nodes_text(self) -> str:
        """``N``, or ``MIN:MAX`` for an elastic job, as torchrun's --nnodes takes it."""
        return f"{self.nnodes}:{self.max_nodes}" if self.max_nodes > self.nnodes else str(self.nnodes)


def free_port() -> int:
    """A TCP port that was free a moment ago on loopback (for standalone jobs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_env(spec: LaunchSpec) -> dict[str, str]:
    """What torchrun's agent must find in its environment for ``spec``.

    A node that joins a running job (a scale-up, or a replacement for a lost node) first meets the others in a later
    round of the rendezvous. With the agents' TCP store shared with the workers (torch's default since 2.4), the
    node that stays rank 0 keeps the store of its first round and never writes its address into the later round, so
    the newcomer waits for it until the store's timeout and the job ends (torch 2.14). Without sharing, rank 0's
    agent publishes an address every round and its rank-0 worker hosts the workers' store, as before torch 2.4.
    """
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if spec.most_nodes > 1 else {}


def torchrun_args(spec: LaunchSpec, program: Sequence[str]) -> list[str]:
    """The ``torchrun`` argument list that runs ``program`` (``-m module args...``)."""
    args = [f"--nproc-per-node={spec.nproc_per_node}", f"--max-restarts={spec.max_restarts}"]
    if spec.most_nodes == 1:
        args.append("--standalone")
    else:
        if not spec.rdzv_endpoint:
            raise ValueError(
                f"--nnodes {spec.nodes_text} needs --rdzv-endpoint HOST:PORT (the address of one node that "
                "every node can reach)"
            )
        args += [
            f"--nnodes={spec.nodes_text}",
            f"--node-rank={spec.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
            f"--rdzv-conf=join_timeout={spec.join_timeout_s},last_call_timeout={spec.last_call_s},"
            f"keep_alive_interval={spec.keep_alive_s}",
        ]
    return args + list(program)
