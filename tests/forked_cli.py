"""``gputrain ARGS`` in a process of its own, forked from the test worker's preloaded server instead of a new
interpreter.

A command a test starts as ``python -m gputrain ...`` spends about 3 CPU-s importing torch and torchvision before it
does anything: about a third of the suite's CPU went to it (docs/testing.md). :func:`run_gputrain` runs the command
in a process forked from the server :mod:`multiproc` keeps (torch, torchvision and gputrain's core imported, no
torch op run before a fork), with what ``subprocess.run([sys.executable, "-m", "gputrain", *args],
capture_output=True, text=True)`` gives it: its own arguments, environment, working folder, ``sys.path`` as a new
interpreter builds it (the folder, then ``PYTHONPATH``, then the site's), standard streams (stdin empty, stdout and
stderr to files, not a terminal), ``gputrain`` run as ``__main__``, its threads joined and ``atexit`` run at the end,
and its exit status (minus the signal's number when a signal ended it). Its own children (the launcher's ranks, data
workers) are started as they are for a user.

What a fork cannot give, so such tests keep ``subprocess``: code that runs when an interpreter starts
(``sitecustomize.py`` on ``PYTHONPATH``, as the core-install tests use), environment variables torch reads when it is
imported (the thread count is set from ``OMP_NUM_THREADS`` here, as torch would at start), another ``gputrain`` on
the command's ``PYTHONPATH`` (the server's preloaded package is the one that runs: the test worker's, which under
``make mutants`` is the planted copy), and the cost of start-up itself. A test that signals the command or reads its
output while it runs uses :func:`start_gputrain`'s ``pid`` (its own session and process group), ``stdout_so_far``
and ``kill``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path

import torch

from multiproc import _forkserver


@cache
def _site_path() -> list[str]:
    """``sys.path`` of a new interpreter of this venv, without its first entry (the folder) and ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", "-c", "import json, site, sys; site.main(); print(json.dumps(sys.path[1:]))"],
                          capture_output=True, text=True, env=env, check=True)
    return list(json.loads(done.stdout))


def _command(call: bytes) -> None:
    """The forked process: ``python -m gputrain ARGS`` as a new interpreter would run it; never returns."""
    args, env, cwd, site_path, out, err = pickle.loads(call)
    code = 1
    try:
        os.setsid()  # its own process group, as a job of a shell: a timeout ends the ranks it started too
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_APPEND),
                                 (2, err, os.O_WRONLY | os.O_APPEND)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False, buffering=1 if unbuffered else -1)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *site_path]
        if env.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = ["-m", *args]
        try:
            runpy.run_module("gputrain", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int | None):
                print(stop.code, file=sys.stderr)
        except KeyboardInterrupt:  # as an interpreter ends on it: the traceback, then killed by SIGINT (status -2)
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001  (printed as an interpreter prints an uncaught exception)
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as at an interpreter's exit: its threads end first
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


class Started:
    """A ``gputrain`` command started by :func:`start_gputrain`; :meth:`wait` gives its ``CompletedProcess``."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None, cwd: str | Path | None,
                 streams: tuple[str, str] | None = None) -> None:
        """``streams``: where its stdout and stderr go (paths, appended to); by default files read by :meth:`wait`."""
        self.args = [str(a) for a in args]
        self._folder = None
        if streams is None:
            self._folder = tempfile.TemporaryDirectory(prefix="gputrain-command-")
            streams = (os.path.join(self._folder.name, "stdout"), os.path.join(self._folder.name, "stderr"))
            for path in streams:
                Path(path).touch()
        self._out, self._err = streams
        call = pickle.dumps((self.args, dict(os.environ if env is None else env), str(cwd or os.getcwd()),
                             _site_path(), self._out, self._err))
        self.process = _forkserver().Process(target=_command, args=(call,), name="gputrain")
        self.process.start()

    @property
    def pid(self) -> int:
        """Its process id, which is also its process group's and session's (it runs in a session of its own)."""
        assert self.process.pid is not None
        return self.process.pid

    def _end_group(self) -> None:
        """SIGKILL to its whole process group (the ranks it started too), if it still runs; then reap it."""
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.join()

    def kill(self) -> None:
        """End it and its process group now (a test that failed while it ran), and drop its output."""
        self._end_group()
        if self._folder is not None:
            self._folder.cleanup()

    def stdout_so_far(self) -> str:
        """What it has written to stdout yet (the default streams only)."""
        assert self._folder is not None
        return Path(self._out).read_text(errors="replace")

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Its end, as ``subprocess.run`` gives it; past ``timeout`` s its process group is killed and
        ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
        self.process.join(timeout)
        timed_out = self.process.exitcode is None
        self._end_group()
        stdout, stderr = "", ""
        if self._folder is not None:
            stdout, stderr = (Path(p).read_text(errors="replace") for p in (self._out, self._err))
            self._folder.cleanup()
        command = [sys.executable, "-m", "gputrain", *self.args]
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout or 0, output=stdout, stderr=stderr)
        assert self.process.exitcode is not None
        return subprocess.CompletedProcess(command, self.process.exitcode, stdout, stderr)


def start_gputrain(args: Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: str | Path | None = None) -> Started:
    """``gputrain ARGS`` started in a forked process (module docstring), not waited for."""
    return Started(args, env, cwd)


def run_gputrain(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                 timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, "-m", "gputrain", *args], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)``, in a forked process (module docstring)."""
    return Started(args, env, cwd).wait(timeout)


SHIM = Path(__file__).with_name("python_via_fork.sh")


@contextlib.contextmanager
def python_via_fork() -> Iterator[dict[str, str]]:
    """The environment for a shell script that runs ``$PYTHON -m gputrain ...`` (scripts/gpu_check.sh): while this
    context is open, each such command runs forked from the preloaded server, as :func:`run_gputrain` runs one,
    writing to the script's own stdout and stderr and exiting with its status; ``$PYTHON`` runs anything else in
    this interpreter's executable (tests/python_via_fork.sh)."""
    commands: list[Started] = []
    with tempfile.TemporaryDirectory(prefix="fork-") as folder, socket.socket(socket.AF_UNIX) as server:
        path = os.path.join(folder, "commands")
        server.bind(path)
        server.listen()
        accepting = threading.Thread(target=_accept, args=(server, commands), daemon=True)
        accepting.start()
        try:
            yield {"PYTHON": str(SHIM), "FORKED_PYTHON": sys.executable, "FORKED_SOCKET": path}
        finally:
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept
            accepting.join()
            for command in commands:  # a script timed out or killed mid-command leaves none running
                if command.process.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(command.process.pid, signal.SIGKILL)


def _accept(server: socket.socket, commands: list[Started]) -> None:
    while True:
        try:
            connection, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=_serve, args=(connection, commands), daemon=True).start()


def _serve(connection: socket.socket, commands: list[Started]) -> None:
    """One ``$PYTHON -m gputrain ARGS`` of the script: the shim's arguments, environment, folder and pid in, the
    exit status out (the shim's own stdout and stderr are the command's)."""
    with connection:
        args, env, cwd, pid = json.loads(connection.makefile().readline())
        commands.append(Started(args, env, cwd, streams=(f"/proc/{pid}/fd/1", f"/proc/{pid}/fd/2")))
        connection.sendall(f"{commands[-1].wait().returncode}\n".encode())
