"""One failure report for every way ranks are started: from the failed ranks (torch's ``ProcessFailure``, whoever
started them) the first failing rank's line, printed last, and a log of every failed rank.

No torch at import: the command line's launcher starts the ranks before it imports torch, so the ranks' own imports
run meanwhile. What a rank writes when it fails is :mod:`gputrain.launcher.worker_errors`."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from gputrain.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_USAGE, exit_code_for_signal


def write_failure_log(path: Path, failures: dict[int, Any], logs: Path) -> Path:
    """Each failed rank's traceback (from its error file) and stderr (``logs/**/<rank>/stderr.log``), in one file."""
    parts = []
    for rank, failure in sorted(failures.items()):
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        message = data.get("message")
        stack = message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""
        stderr = next(iter(sorted(logs.glob(f"**/{rank}/stderr.log"))), None)
        text = stderr.read_text(errors="replace") if stderr is not None else ""
        parts.append(f"== {failure_line(rank, failure)}\n{stack}\n-- stderr of rank {rank}:\n{text}\n")
    path.write_text("".join(parts))
    return path


INTERRUPT_CODES = tuple(exit_code_for_signal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1))
"""Exit codes of a rank that stopped for a signal the ranks agreed on (it printed its own line)."""


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


def is_consequence(rank: int, failure: Any) -> bool:
    """Whether the rank failed because a peer left (its lost connection), not for a reason of its own.

    Such a rank often exits first, whatever the times: the rank that failed tears its process group down
    before its own error file is written.
    """
    line = failure_line(rank, failure)
    return any(text in line for text in _PEER_LOST)


def recorded_own_error(failure: Any) -> bool:
    """Whether the rank wrote gputrain's record of its own error (then it failed, whatever signal ended it)."""
    return bool(_gputrain_info(failure).get("line"))


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failing rank whose error came first and is not a consequence of another's; (rank, failure)."""
    def order(item: tuple[int, Any]) -> tuple[bool, float, int]:
        return is_consequence(*item), _gputrain_info(item[1]).get("time", item[1].timestamp), item[0]

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
