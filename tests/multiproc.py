"""Run a test body in real worker processes (gloo on CPU).

Two ways to start the ranks:

* forked (the default) from a server process that imported torch and gputrain once per test worker: Python's
  ``multiprocessing`` forkserver with those modules preloaded. Each rank is a real process with its own gloo group,
  as torch's own distributed tests do it, without the 3 CPU-s of a fresh interpreter importing torch (two of those
  per launch were about a tenth of the suite). For tests that need only a process group.
* ``fresh=True``: started by gputrain's own launcher (:func:`gputrain.launcher.ranks.launch_all`, fresh
  interpreters, error files, the launcher's failure report), for tests of what the launcher does.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

from gputrain.dist import init_distributed, teardown
from gputrain.launcher.ranks import launch_all
from gputrain.launcher.spec import free_port

PRELOADED = ["torch", "torch.distributed", "torchvision", "gputrain.dist", "gputrain.engine", "multiproc", "frozen_gc"]
"""What the fork server imports once: a forked rank finds these loaded (nothing runs a torch op before a fork)."""


class RankFailed(RuntimeError):
    """A forked rank raised: its rank and traceback, in the message."""


def _entry(fn: Callable[..., Any], args: tuple[Any, ...], accelerator: str, timeout_s: float) -> Any:
    torch.set_num_threads(1)
    info = init_distributed(accelerator, timeout_s=timeout_s)
    try:
        return fn(info, *args)
    finally:
        teardown()


def _forked_rank(rank: int, call: bytes, conn: Any) -> None:
    """One rank, in a process forked from the server: the caller's sys.path, environment and folder, then ``fn``."""
    path, env, cwd, world_size, port, payload, logs = pickle.loads(call)
    # stderr to a file, as the launcher's ranks: tests/hangs.py reads a hung rank's stacks (SIGABRT) from it.
    log = os.open(os.path.join(logs, f"rank{rank}.stderr"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 2)
    os.close(log)
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    sys.path[:] = path  # the server's path is the one it started with; test folders imported since are added here
    os.environ.clear()
    os.environ.update(env)  # what the test set (monkeypatch) after the server started
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    os.chdir(cwd)
    try:
        fn, args, accelerator, timeout_s = pickle.loads(payload)
        answer = ("ok", _entry(fn, args, accelerator, timeout_s))
    except BaseException:  # noqa: BLE001  (sent to the test, which raises it with this rank's traceback)
        answer = ("error", traceback.format_exc())
    try:
        # Plain pickle: multiprocessing's own would pass tensors as shared memory that dies with this process.
        conn.send_bytes(pickle.dumps(answer))
    finally:
        conn.close()


_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOADED)
    return _context


def _run_forked(payload: bytes, world_size: int) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        return _run_forked_logged(payload, world_size, logs)


def _run_forked_logged(payload: bytes, world_size: int, logs: str) -> list[Any]:
    context = _forkserver()
    call = pickle.dumps((list(sys.path), dict(os.environ), os.getcwd(), world_size, free_port(), payload, logs))
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]
    procs = [context.Process(target=_forked_rank, args=(rank, call, pipes[rank][1]), name=f"rank{rank}")
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    for _, sender in pipes:
        sender.close()  # the ranks hold the sending ends: a rank that dies unsent gives EOF, not a wait
    answers: list[Any] = []
    for rank, (receiver, _) in enumerate(pipes):
        try:
            answers.append(pickle.loads(receiver.recv_bytes()))
        except EOFError:
            procs[rank].join()
            answers.append(("error", f"rank {rank} exited with code {procs[rank].exitcode} before it answered"))
    for proc in procs:
        proc.join()
    failed = [(rank, text) for rank, (kind, text) in enumerate(answers) if kind == "error"]
    if failed:
        raise RankFailed("\n".join(f"rank {rank} failed:\n{text}\n-- its stderr, last lines:\n"
                                   + _tail(os.path.join(logs, f"rank{rank}.stderr")) for rank, text in failed))
    return [value for _, value in answers]


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, accelerator: str = "cpu",
              timeout_s: float = 600.0, fresh: bool = False) -> list[Any]:
    """``fn(dist_info, *args)`` on each of ``world_size`` ranks; results listed by rank.

    ``fn`` must be a module-level function of an importable module. ``timeout_s``: how long a collective may wait for
    the other ranks (a test whose planted fault leaves a rank waiting sets it short). ``fresh``: start the ranks with
    gputrain's launcher, as fresh interpreters (its failures raise its ``WorkerFailed``); else forked, whose failures
    raise :class:`RankFailed` with every failed rank's traceback.
    """
    if fresh:
        return launch_all(_entry, fn, args, accelerator, timeout_s, devices=world_size)
    return _run_forked(pickle.dumps((fn, args, accelerator, timeout_s)), world_size)
