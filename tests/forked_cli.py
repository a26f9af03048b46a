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
``make mutants`` is the planted copy), the cost of start-up itself, and tests that signal or wait on the command
while it runs (``subprocess.Popen``).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
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
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
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

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None, cwd: str | Path | None) -> None:
        self.args = [str(a) for a in args]
        self._folder = tempfile.TemporaryDirectory(prefix="gputrain-command-")
        self._out, self._err = (os.path.join(self._folder.name, name) for name in ("stdout", "stderr"))
        for path in (self._out, self._err):
            Path(path).touch()
        call = pickle.dumps((self.args, dict(os.environ if env is None else env), str(cwd or os.getcwd()),
                             _site_path(), self._out, self._err))
        self.process = _forkserver().Process(target=_command, args=(call,), name="gputrain")
        self.process.start()

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Its end, as ``subprocess.run`` gives it; past ``timeout`` s its process group is killed and
        ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
        self.process.join(timeout)
        timed_out = self.process.exitcode is None
        if timed_out:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.join()
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
