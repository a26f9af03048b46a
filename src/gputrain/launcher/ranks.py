"""Starting the ranks of a job, and reporting the first failure in one line.

One way per situation: on one node without restarts the ranks are plain subprocesses with torchrun's variables
(:mod:`gputrain.launcher.direct`), for ``gputrain train ... --devices N`` (the same command line in N ranks), for
:func:`launch` (a function in N ranks) and for the tools' rank runner alike; across nodes, or with restarts,
torchrun's elastic agent and rendezvous (``torch.distributed.run``, ``elastic_launch``).

When workers fail, the launcher prints the first failing rank's one-line error, last
(:mod:`gputrain.launcher.failures`); when the user interrupts, it exits with the signal's code (130, 143) and adds
nothing to the workers' one line. torchrun's own log lines are kept off the console (``GPUTRAIN_DEBUG=1`` shows them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gputrain.errors import EXIT_FAILED, EXIT_OK, exit_code_for_signal
from gputrain.launcher.failures import report_failure
from gputrain.launcher.spec import LAUNCHER_ENV, LaunchSpec, debug, free_port, torchrun_args, torchrun_env

T = TypeVar("T")


def run_torchrun(spec: LaunchSpec, module: str, module_args: Sequence[str]) -> None:
    """Run ``python -m module module_args`` in ``spec.nproc_per_node`` workers via torchrun."""
    from torch.distributed.run import get_args_parser, run

    # torchrun would set 1 thread per worker and warn; a share of the cores is a better default.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node)))
    for name, value in torchrun_env(spec).items():  # a user's own setting wins
        os.environ.setdefault(name, value)
    # --no-python with sys.executable keeps the workers on the interpreter (and venv) we run in.
    argv = ["--no-python", *torchrun_args(spec, [sys.executable, "-m", module, *module_args])]
    run(get_args_parser().parse_args(argv))


_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


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


def run_command(spec: LaunchSpec, module: str, module_args: Sequence[str]) -> int:
    """:func:`run_direct` or :func:`run_torchrun`, returning the exit code for the command and printing at most the failure line.

    0 when every worker succeeded; 128 + signal when the launcher was interrupted (the workers
    print their own "interrupted" line); otherwise what :func:`report_failure` decides.
    """
    with _launcher_scope():
        if not spec.elastic:
            from gputrain.launcher.direct import run_direct

            return run_direct(spec.nproc_per_node, module, module_args)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

        try:
            run_torchrun(spec, module, module_args)
        except SignalException as err:
            return exit_code_for_signal(err.sigval)
        except ChildFailedError as err:
            return report_failure(err.failures)
        except RendezvousTimeoutError:
            # Fewer nodes than the job needs met within the timeout: it cannot start, or continue after a node left.
            print(f"gputrain: error: fewer than {spec.nnodes} node(s) met at the rendezvous {spec.rdzv_endpoint} within "
                  f"launch.join_timeout_s={spec.join_timeout_s} s, so the job cannot start, or go on after a node left; "
                  f"start the missing node(s) with the same command (--nnodes {spec.nodes_text}), or allow fewer "
                  f"with --nnodes MIN:MAX", file=sys.stderr, flush=True)
            return EXIT_FAILED
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

    ``fn`` must be importable by name (a module-level function, or one of the calling script), since each rank is a
    fresh interpreter. Each worker should call :func:`gputrain.dist.init_distributed`. A failing rank raises
    :class:`~gputrain.launcher.worker_errors.WorkerFailed` here: one line naming the first failing rank, its error and
    the log file holding the workers' stderr (tracebacks included). The ranks start as ``gputrain train``'s do
    (:mod:`gputrain.launcher.direct`); with ``max_restarts`` torchrun's elastic agent restarts them after a failure.
    The caller's signal handlers are restored when this returns or raises.
    """
    from gputrain.launcher.failures import write_failure_log
    from gputrain.launcher.worker_errors import WorkerFailed

    logs = Path(tempfile.mkdtemp(prefix="gputrain-launch-"))
    # Workers' stderr (tracebacks, torch's warnings) goes to a file per rank that a failure names;
    # their stdout stays on the terminal. GPUTRAIN_DEBUG=1 shows everything.
    with _launcher_scope():  # quiet agent, and the caller's signal handlers back afterwards
        if max_restarts:
            results, failures = _elastic(fn, args, devices, max_restarts, logs)
        else:
            from gputrain.launcher.direct import run_function

            results, failures = run_function(devices, _run_then_teardown, (fn, *args),
                                             logs=None if debug() else logs)
    if failures:
        raise WorkerFailed("gputrain.launch", failures, write_failure_log(logs / "failures.log", failures, logs))
    shutil.rmtree(logs, ignore_errors=True)
    return results


def _elastic(fn: Callable[..., Any], args: tuple[Any, ...], devices: int, max_restarts: int,
             logs: Path) -> tuple[list[Any], dict[int, Any]]:
    """The ranks under torchrun's elastic agent, which restarts them after a failure: (results, failed ranks)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.NONE if debug() else Std.ERR),
        min_nodes=1, max_nodes=1, nproc_per_node=devices, run_id=f"gputrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"is_host": True},
        max_restarts=max_restarts, monitor_interval=0.1,
    )
    try:
        results = elastic_launch(config, _run_then_teardown)(fn, *args)
    except ChildFailedError as err:
        return [], err.failures
    return [results[r] for r in range(devices)], {}
