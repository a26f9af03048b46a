"""Start the ranks of a single-node job without restarts as plain subprocesses, as torchrun would.

torchrun's elastic agent earns its keep with restarts and multi-node rendezvous; for one node
and ``--max-restarts 0`` neither is used (figures in docs/benchmarks.md). Here the launcher sets the variables torchrun sets
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and hosts the rendezvous store at
MASTER_ADDR:MASTER_PORT itself, as the agent does (``TORCHELASTIC_USE_AGENT_STORE``), on a socket it listens on before
it starts them and imports torch after. Everything else stays torchrun's: workers record their error with
``record`` into ``TORCHELASTIC_ERROR_FILE``, and a failure is described by torch's
``ProcessFailure``, so the launcher reports it exactly as it does for torchrun.

Each rank runs in a session of its own, as torchrun's workers do: with the kernel's autogroup scheduling
(on by default in desktop and many server kernels) CPU time is shared out per session, so ranks kept in the
launcher's session shared one share between them and, on a busy machine, reached their first step 1.2-1.4 times
as late as torchrun's (docs/benchmarks.md). Signals reach them through the launcher, which forwards the ones in :data:`FORWARDED`
it receives (Ctrl-C in a terminal, ``kill -- -PGID``) to every rank. When a rank fails the
others get SIGTERM, then SIGKILL after a grace period (torchrun's 30 s). A rank whose launcher
dies (even by SIGKILL) gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``), so none is orphaned.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from multiprocessing import spawn
from pathlib import Path
from types import FrameType
from typing import Any

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
"""Signals the launcher passes on to every rank (SIGUSR1: SLURM's "time is nearly up")."""
GRACE_S = 30.0
"""How long ranks may take to leave after SIGTERM before SIGKILL (torchrun's default)."""
CAUSE_GRACE_S = 10.0
"""How long the other ranks may take to leave on their own when the first to leave only lost a peer: the rank
that caused it is still writing its error, and a SIGTERM then would lose the error that explains the run."""
_PR_SET_PDEATHSIG = 1


def rank_env(base: dict[str, str], *, rank: int, world_size: int, port: int, run_id: str,
             error_file: str) -> dict[str, str]:
    """The environment torchrun gives local rank ``rank`` of a single-node job."""
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": str(0), "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file, "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    return env


def _die_with_launcher(launcher: int) -> None:
    """Runs in each rank before exec: SIGTERM when the launcher dies, and leave if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the ranks still get forwarded signals
        return
    if os.getppid() != launcher:
        os._exit(143)


def die_with_parent() -> None:
    """In a rank torchrun's agent started: SIGTERM when the agent dies, as the direct launcher's ranks get. torchrun
    starts its workers in sessions of their own, so a node stopped by its command's pid alone (SIGKILL to
    ``gputrain train``) left its worker training beside the others, with nobody to restart it; now the worker stops
    at the next step boundary with a checkpoint, and the other nodes go on without it."""
    parent = os.getppid()
    if parent == 1:  # the agent is already gone
        os._exit(143)
    _die_with_launcher(parent)


class _Job:
    """The ranks of one job, their error files, and the signal the launcher received (0: none)."""

    def __init__(self, nproc: int, argv: Sequence[str], base_env: dict[str, str], logs: Path | None = None,
                 stdout_too: bool = False) -> None:
        self.errors = Path(tempfile.mkdtemp(prefix="gputrain-ranks-"))
        # The launcher hosts the store, as torchrun's agent does: ranks connect at once instead of
        # retrying with back-off until rank 0 has imported torch and opened it (seconds on busy cores).
        # Its socket listens before the ranks start and the store opens on it afterwards (open_store), so
        # the launcher's torch import runs while the ranks import theirs; a rank that connects first waits
        # in the socket's backlog. Not inherited by the ranks (Python sockets are not).
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=max(128, nproc))
        self.nproc, port = nproc, int(self.listener.getsockname()[1])
        run_id, me = f"gputrain-{uuid.uuid4().hex[:8]}", os.getpid()
        self.store: Any = None
        self.signum = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(nproc):
                env = rank_env(base_env, rank=rank, world_size=nproc, port=port, run_id=run_id,
                               error_file=str(self.errors / f"rank{rank}.json"))
                out = err = None
                if logs is not None:  # each rank's output in files of its own (a failure names them)
                    (logs / str(rank)).mkdir(parents=True, exist_ok=True)
                    err = open(logs / str(rank) / "stderr.log", "wb")  # noqa: SIM115  (the rank holds it)
                    out = open(logs / str(rank) / "stdout.log", "wb") if stdout_too else None  # noqa: SIM115
                self.procs.append(subprocess.Popen(list(argv), env=env, start_new_session=True, stdout=out,
                                                   stderr=err, preexec_fn=lambda: _die_with_launcher(me)))
                for f in (out, err):
                    if f is not None:
                        f.close()
        except BaseException:  # a rank that could not start (out of processes or files): none is left waiting
            self.close()
            raise

    def close(self) -> None:
        """Kill what still runs, and free the socket and the error files."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.listener.close()  # a no-op once the store owns it
        shutil.rmtree(self.errors, ignore_errors=True)

    def open_store(self) -> None:
        """Serve the rendezvous store on the listening socket (the ranks already started)."""
        from torch.distributed import TCPStore

        port = int(self.listener.getsockname()[1])
        self.store = TCPStore("127.0.0.1", port, self.nproc, is_master=True, wait_for_workers=False,
                              master_listen_fd=self.listener.detach())  # the store owns the socket from here

    def forward(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum
        self.send(signum)

    def send(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def wait_first_failure(self) -> Any:
        """Wait until every rank succeeded (None) or one failed (its ``ProcessFailure``)."""
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        while True:
            codes = [proc.poll() for proc in self.procs]
            for rank, code in enumerate(codes):
                if code:  # non-zero: failed or killed
                    return ProcessFailure(rank, self.procs[rank].pid, code, str(self.errors / f"rank{rank}.json"))
            if all(code == 0 for code in codes):
                return None
            time.sleep(0.05)

    def wait_all(self, seconds: float) -> None:
        """Wait up to ``seconds`` for every rank to leave on its own."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
            time.sleep(0.05)

    def stop_all(self, *, terminate: bool) -> dict[int, Any]:
        """Wait for every rank (SIGTERM first if ``terminate``), SIGKILL after :data:`GRACE_S`; the failed ranks."""
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        if terminate:
            self.send(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {rank: ProcessFailure(rank, proc.pid, proc.returncode, str(self.errors / f"rank{rank}.json"))
                for rank, proc in enumerate(self.procs) if proc.returncode}


def _supervise(nproc: int, argv: Sequence[str], logs: Path | None = None,
               stdout_too: bool = False) -> tuple[int, dict[int, Any]]:
    """Start ``argv`` as ``nproc`` ranks and wait for them: (the signal the launcher received, the failed ranks).

    A rank's failure stops the others (SIGTERM, then SIGKILL after :data:`GRACE_S`); a signal the launcher receives
    is forwarded to every rank, which agree to stop at a step boundary.
    """
    from gputrain.launcher.failures import INTERRUPT_CODES, is_consequence, recorded_own_error

    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    saved = {sig: signal.getsignal(sig) for sig in FORWARDED}
    job: _Job | None = None
    try:
        # Handlers first: a signal between the first fork and the last must still reach every rank.
        pending: list[int] = []
        for sig in FORWARDED:
            signal.signal(sig, lambda signum, frame: pending.append(signum))
        job = _Job(nproc, argv, base, logs, stdout_too)
        for sig in FORWARDED:
            signal.signal(sig, job.forward)
        for signum in pending[:1]:
            job.forward(signum, None)
        job.open_store()
        first = job.wait_first_failure()
        if first is None:
            return job.signum, {}
        # A rank that stopped for a signal was agreed with the others, which are leaving too: no SIGTERM.
        terminate = not job.signum and first.exitcode not in INTERRUPT_CODES
        if terminate and is_consequence(first.local_rank, first):
            job.wait_all(CAUSE_GRACE_S)
        failures = job.stop_all(terminate=terminate)
        if terminate:  # a rank that left for our SIGTERM did not fail: else a crash with no error file (OOM kill)
            failures = {rank: failure for rank, failure in failures.items()  # could be reported as "interrupted"
                        if failure.exitcode not in INTERRUPT_CODES
                        and (failure.exitcode != -signal.SIGTERM or recorded_own_error(failure))}
        failures[first.local_rank] = first
        return job.signum, failures
    finally:
        if job is not None:
            job.close()  # an exception in the launcher itself leaves no rank behind
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_direct(nproc: int, module: str, module_args: Sequence[str]) -> int:
    """Run ``python -m module module_args`` as ``nproc`` ranks on this node; the command's exit code.

    0 when every rank succeeded; 128 + signal when the launcher itself was signalled; otherwise
    what :func:`gputrain.launcher.failures.report_failure` decides from the first failing rank.
    """
    from gputrain.errors import EXIT_OK, exit_code_for_signal
    from gputrain.launcher.failures import report_failure

    signum, failures = _supervise(nproc, [sys.executable, "-m", module, *module_args])
    if signum:
        return exit_code_for_signal(signum)
    return report_failure(failures) if failures else EXIT_OK


def run_function(nproc: int, fn: Callable[..., Any], args: tuple[Any, ...], *, logs: Path | None = None,
                 stdout_too: bool = False) -> tuple[list[Any], dict[int, Any]]:
    """``fn(*args)`` in ``nproc`` ranks of this node, each a fresh interpreter: (results by rank, failed ranks).

    ``logs``: each rank's stderr (and with ``stdout_too`` its stdout) goes to ``logs/<rank>/``.

    ``fn`` must be importable by name (a module-level function), as for ``multiprocessing``'s spawn: the ranks
    unpickle it (:mod:`gputrain.launcher.worker`). A rank that failed has no result (None).
    """
    folder = Path(tempfile.mkdtemp(prefix="gputrain-call-"))
    try:
        # What multiprocessing's spawn hands a child (sys.path, the main script to import as __mp_main__, ...), so a
        # function defined in the caller's script or found on its sys.path unpickles in the rank as it would there.
        # The authentication key stays out: it guards multiprocessing's own connections, which ranks do not use.
        preparation = {k: v for k, v in spawn.get_preparation_data("gputrain-rank").items() if k != "authkey"}
        (folder / "prepare.pkl").write_bytes(pickle.dumps(preparation))
        (folder / "call.pkl").write_bytes(pickle.dumps((fn, args)))
        _, failures = _supervise(nproc, [sys.executable, "-m", "gputrain.launcher.worker", str(folder)], logs,
                                 stdout_too)
        results = []
        for rank in range(nproc):
            result = folder / f"result{rank}.pkl"
            results.append(pickle.loads(result.read_bytes()) if result.is_file() else None)
        return results, failures
    finally:
        shutil.rmtree(folder, ignore_errors=True)
