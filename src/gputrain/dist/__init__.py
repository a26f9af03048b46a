"""Where a process sits in the job and how it talks to the others.

:mod:`~gputrain.dist.env`: the one frozen :class:`DistInfo` (rank, local rank, world size, device), joining and
leaving the job; :mod:`~gputrain.dist.comm`: the collectives gputrain needs; :mod:`~gputrain.dist.stop`: the
agreement of all ranks to stop at a step boundary on a signal.
"""

from gputrain.dist.env import DistInfo, device_mesh, init_distributed, launched_env, node_name, resolve_accelerator, restart_attempt, restarts_left, teardown

__all__ = ["DistInfo", "device_mesh", "init_distributed", "launched_env", "node_name", "resolve_accelerator", "restart_attempt", "restarts_left", "teardown"]
