"""What a failed rank leaves for its launcher, and the error :func:`gputrain.launch` raises from it.

torch's ``record`` machinery writes the exception into the rank's error file (``TORCHELASTIC_ERROR_FILE``), with
gputrain's one line and a fine timestamp (the first rank to fail is the one reported);
:mod:`gputrain.launcher.failures` reads it back.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler, record

from gputrain.errors import EXIT_FAILED, EXIT_USAGE
from gputrain.launcher.failures import failure_line, first_failure

T = TypeVar("T")


def worker_record(fn: Callable[..., T], *, usage: tuple[type[BaseException], ...]) -> Callable[..., T]:
    """``fn`` wrapped by torch's ``record``, writing gputrain's one line and a fine timestamp into the error file."""
    return record(fn, error_handler=WorkerErrorHandler(usage))  # type: ignore[return-value]


class WorkerErrorHandler(ErrorHandler):
    """torch's error-file format, plus what the launcher needs to print one line for the first failure."""

    def __init__(self, usage: tuple[type[BaseException], ...]) -> None:
        self.usage = usage

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        usage = isinstance(e, self.usage)
        line = str(e).strip().splitlines()[0] if usage and str(e).strip() else f"{type(e).__name__}: {e}"
        stack = traceback.format_exc()
        # The time the exception was raised (stamped by the worker before teardown), not when it is recorded.
        info = {"line": line, "usage": usage, "time": getattr(e, "gputrain_time", time.time()), "traceback": stack,
                "exit_code": getattr(e, "exit_code", EXIT_USAGE if usage else EXIT_FAILED)}
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time())), "gputrain": info}}}
        with open(path, "w") as f:
            json.dump(data, f)


class WorkerFailed(ChildFailedError):
    """A rank of :func:`gputrain.launch` failed: one line naming the first failing rank, its error and its log file.

    Still a ``ChildFailedError`` (``.failures`` maps each failed rank to torch's ``ProcessFailure``).
    """

    def __init__(self, name: str, failures: dict[int, Any], log: Path) -> None:
        super().__init__(name, failures)
        self.log = log
        """Every failed rank's traceback and stderr."""

    def __str__(self) -> str:
        rank, failure = first_failure(self.failures)
        return f"{failure_line(rank, failure)} (full traceback in {self.log})"
