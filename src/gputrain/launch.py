"""Start worker processes with torchrun's own machinery; never a home-made pool.

``gputrain train ... --devices N`` re-executes itself under ``torch.distributed.run``
(the module behind ``torchrun``) when the job spans nodes or may restart; on one node without
restarts it starts the ranks itself with torchrun's variables (:mod:`gputrain.direct_launch`). Python callers use :func:`launch`, which goes through
``torch.distributed.launcher.api.elastic_launch``: the same elastic agent and rendezvous.

When workers fail, the launcher prints the first failing rank's one-line error, last; when the
user interrupts, it exits with the signal's code (130, 143) and adds nothing to the workers' one
line. Workers record their error with torch's ``record`` machinery (an error file per rank);
torchrun's own log lines are kept off the console (``GPUTRAIN_DEBUG=1`` shows them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from gputrain.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_OK, EXIT_USAGE, exit_code_for_signal

# No torch at import: the command line's launcher decides how many ranks to start and starts them before it
# imports torch (about 1.5 s), so the ranks' own imports run meanwhile (gputrain.direct_launch).

T = TypeVar("T")

WORKER_ERROR_NAMES = ("WorkerFailed", "WorkerErrorHandler", "worker_record")
"""Names that live in :mod:`gputrain.worker_errors` (which imports torch) and are still found here."""


def __getattr__(name: str) -> Any:
    if name in WORKER_ERROR_NAMES:
        from gputrain import worker_errors

        return getattr(worker_errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ONE_PROCESS_STRATEGIES = frozenset({"single", "dp", "model_parallel"})
PROCESS_PER_DEVICE_STRATEGIES = frozenset({"ddp", "fsdp", "pipeline"})
"""How many processes each built-in strategy starts, known without importing torch (and the strategy); each
class's own ``processes_per_node`` says the same (a test holds them together)."""


def processes_per_node(strategy: str, devices: int) -> int:
    """The processes a node starts for ``strategy`` on ``devices``; asks the strategy's class (and imports torch)
    only for a name the tables above do not know, which also gives an unknown name its one-line error."""
    if strategy in ONE_PROCESS_STRATEGIES:
        return 1
    if strategy in PROCESS_PER_DEVICE_STRATEGIES:
        return devices
    from gputrain.strategies import strategy_class

    return strategy_class(strategy).processes_per_node(devices)


def is_worker() -> bool:
    """Whether torchrun or SLURM started this process as a rank (asks :mod:`gputrain.dist`, and so imports torch,
    only when their variables are set)."""
    if not any(name in os.environ for name in ("RANK", "SLURM_PROCID")):
        return False
    from gputrain.dist import launched_env

    return launched_env() is not None


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
        return not is_worker() and (self.nproc_per_node > 1 or self.nnodes > 1)

    @property
    def direct(self) -> bool:
        """Whether the ranks are started as plain subprocesses (one node, no restarts) rather than by torchrun."""
        return self.nnodes == 1 and self.max_restarts == 0


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


LAUNCHER_ENV = "GPUTRAIN_LAUNCHER"
"""Set for workers that ``gputrain`` started: they record errors and leave printing them to the launcher."""

INTERRUPT_CODES = tuple(exit_code_for_signal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def debug() -> bool:
    """``GPUTRAIN_DEBUG=1``: tracebacks and torchrun's log lines instead of one-line errors."""
    return bool(os.environ.get("GPUTRAIN_DEBUG"))


TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher",
                    "torch.multiprocessing.spawn")
"""The loggers of torchrun's agent: a line for every forwarded signal, stopped worker and failure."""


@contextlib.contextmanager
def _launcher_scope() -> Iterator[None]:
    """Workers know gputrain launched them; torchrun's logs stay quiet; signal handlers come back after."""
    saved_env = os.environ.get(LAUNCHER_ENV)
    saved_handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    # Each of torchrun's loggers sets its own level, and torch installs a stderr handler on
    # "torch.distributed": records are stopped below that handler instead, and the launcher
    # prints the one line that matters.
    quiet = logging.NullHandler()
    loggers = [] if debug() else [logging.getLogger(name) for name in TORCHRUN_LOGGERS]
    saved_propagate = [log.propagate for log in loggers]
    for log in loggers:
        log.addHandler(quiet)
        log.propagate = False
    os.environ[LAUNCHER_ENV] = "1"
    try:
        yield
    finally:
        for log, propagate in zip(loggers, saved_propagate, strict=True):
            log.removeHandler(quiet)
            log.propagate = propagate
        for sig, handler in saved_handlers.items():  # the agent installs its own and never puts ours back
            signal.signal(sig, handler)
        if saved_env is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = saved_env


def run_workers(spec: LaunchSpec, module: str, module_args: Sequence[str]) -> int:
    """:func:`run_direct` or :func:`run_torchrun`, returning the exit code for the command and printing at most the failure line.

    0 when every worker succeeded; 128 + signal when the launcher was interrupted (the workers
    print their own "interrupted" line); otherwise what :func:`report_failure` decides.
    """
    with _launcher_scope():
        if spec.direct:
            from gputrain.direct_launch import run_direct

            return run_direct(spec.nproc_per_node, module, module_args)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousError

        try:
            run_torchrun(spec, module, module_args)
        except SignalException as err:
            return exit_code_for_signal(err.sigval)
        except ChildFailedError as err:
            return report_failure(err.failures)
        except RendezvousError as err:
            # torchrun's agent raises these to the top when the node hosting the rendezvous store ends or fails
            # first (its output has the cause), or when the nodes never meet: one line, not the agent's traceback.
            first = (str(err).splitlines() or [""])[0]
            print(f"gputrain: error: node {spec.node_rank} lost the rendezvous at {spec.rdzv_endpoint} "
                  f"({type(err).__name__}: {first}); if another node ended or failed first, its output says why; "
                  "otherwise check that every node runs the same command with the same --nnodes and --rdzv-endpoint, "
                  "and that the endpoint is reachable from each", file=sys.stderr, flush=True)
            return EXIT_FAILED
    return EXIT_OK


def _gputrain_info(failure: Any) -> dict[str, Any]:
    """What :class:`WorkerErrorHandler` added to a failed rank's error file ({} when it wrote none)."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")
    return message.get("extraInfo", {}).get("gputrain", {}) if isinstance(message, dict) else {}


def failure_line(rank: int, failure: Any) -> str:
    info = _gputrain_info(failure)
    if info.get("line"):
        return f"rank {rank}: {info['line']}"
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message")  # torch's own record(): "Type: message" for a Python function's exception
    text = message.get("message", "") if isinstance(message, dict) else ""
    if isinstance(text, str) and text.strip():
        return f"rank {rank}: {text.strip().splitlines()[0]}"
    if failure.exitcode < 0:
        name = failure.signal_name()
        hint = " (out of memory? see `dmesg`)" if name == "SIGKILL" else ""
        return f"rank {rank} was killed by {name}{hint}"
    return f"rank {rank} exited with code {failure.exitcode} without an error message"


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "DistNetworkError", "DistBackendError")


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failing rank whose error came first and is not a consequence of another's; (rank, failure)."""
    def order(item: tuple[int, Any]) -> tuple[bool, float, int]:
        # A peer's lost connection is a consequence, whatever its time: the rank that left first
        # tears its process group down before its own error file is written.
        line = failure_line(item[0], item[1])
        consequence = any(text in line for text in _PEER_LOST)
        return consequence, _gputrain_info(item[1]).get("time", item[1].timestamp), item[0]

    return min(failures.items(), key=order)


def report_failure(failures: dict[int, Any]) -> int:
    """Print the first failing rank's error (by time) as the last line; return the command's exit code.

    Later failures are usually consequences (the other ranks' "Connection closed by peer"), so
    only the first is shown. Crashes that are not bad input get the last lines of their traceback
    above the line. A rank that stopped for a signal (exit 130/143) printed its own line.
    """
    rank, failure = first_failure(failures)
    if failure.exitcode in INTERRUPT_CODES:
        return failure.exitcode
    info = _gputrain_info(failure)
    if info and not info.get("usage"):
        context = [line for line in info.get("traceback", "").splitlines() if line.strip()][-5:-1]
        for line in context:
            print(line, file=sys.stderr)
    print(f"gputrain: error: {failure_line(rank, failure)}", file=sys.stderr, flush=True)
    code = int(info.get("exit_code", failure.exitcode))
    return code if code in (EXIT_USAGE, EXIT_DIVERGED) else EXIT_FAILED


def launch(fn: Callable[..., T], *args: Any, devices: int = 2, max_restarts: int = 0) -> T:
    """Run ``fn(*args)`` in ``devices`` processes on this node and return rank 0's result.

    See :func:`launch_all` for every rank's result.
    """
    return launch_all(fn, *args, devices=devices, max_restarts=max_restarts)[0]


def _run_then_teardown(fn: Callable[..., T], *args: Any) -> T:
    """A rank of :func:`launch_all`: ``fn(*args)``, then the end of any process group it joined (a gloo group left
    to interpreter exit may abort the finished rank with SIGABRT, and the job would count as failed)."""
    try:
        return fn(*args)
    finally:
        from gputrain.dist import teardown

        teardown()


def launch_all(fn: Callable[..., T], *args: Any, devices: int = 2, max_restarts: int = 0) -> list[T]:
    """Run ``fn(*args)`` in ``devices`` processes on this node; return each rank's result, by rank.

    ``fn`` must be importable by name (a module-level function), since workers are
    spawned. Each worker should call :func:`gputrain.dist.init_distributed`. A failing rank
    raises :class:`WorkerFailed` here: one line naming the first failing rank, its error and the
    log file holding the workers' stderr (tracebacks included). The caller's signal handlers are
    restored when this returns or raises.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from gputrain.worker_errors import WorkerFailed, write_failure_log

    logs = Path(tempfile.mkdtemp(prefix="gputrain-launch-"))
    # Workers' stderr (tracebacks, torch's warnings) goes to a file per rank that a failure names;
    # their stdout stays on the terminal. GPUTRAIN_DEBUG=1 shows everything.
    specs = DefaultLogsSpecs(log_dir=str(logs), redirects=Std.NONE if debug() else Std.ERR)
    config = LaunchConfig(
        logs_specs=specs,
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
    with _launcher_scope():  # quiet agent, and the caller's signal handlers back afterwards
        try:
            results = elastic_launch(config, _run_then_teardown)(fn, *args)
        except ChildFailedError as err:
            raise WorkerFailed(err.name, err.failures, write_failure_log(logs / "failures.log", err.failures)) from None
    shutil.rmtree(logs, ignore_errors=True)
    return [results[r] for r in range(devices)]
