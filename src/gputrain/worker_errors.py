"""The worker side of a failure: torch's error file, plus the one line the launcher prints for it."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from gputrain.errors import EXIT_FAILED, EXIT_USAGE

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
