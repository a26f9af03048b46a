"""What a long tool is doing while it works: a bar on a terminal, one line per stage in a log.

``gputrain plan``, ``doctor``, ``parity`` and ``bench`` run for seconds to minutes before they print their report.
Each names its stages here as it enters them: on a terminal a tqdm bar shows the stage and how many are done; where
stderr is a file or a pipe (a log, CI), each stage is one line, ``gputrain plan: [3/12] counting memory: ddp``.
Written to stderr, so that the report on stdout (and ``--json``) stays as it was.
"""

from __future__ import annotations

import sys
from typing import IO, Any


class Progress:
    def __init__(self, command: str, total: int | None = None, *, stream: IO[str] | None = None,
                 log_lines: bool = True) -> None:
        """``log_lines``: False for a stage of a larger command (train's ``--strategy auto``), whose log the stages
        would only crowd: a bar on a terminal, nothing elsewhere."""
        self.command, self.total, self.done, self.log_lines = command, total, 0, log_lines
        self.stream = stream or sys.stderr
        self.bar: Any = None
        if self.stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=command, file=self.stream, leave=False, dynamic_ncols=True,
                            bar_format="{desc} [{n_fmt}/{total_fmt}] {elapsed}")

    def stage(self, what: str, *, total: int | None = None) -> None:
        """Entering the stage ``what``; ``total``: the stages now known to be in the whole run."""
        if total is not None:
            self.total = total
        self.done += 1
        count = f"{self.done}/{self.total}" if self.total else str(self.done)
        if self.bar is not None:
            if total is not None:
                self.bar.total = total
            self.bar.set_description_str(f"{self.command}: {what}", refresh=False)
            self.bar.update(1)
        elif self.log_lines:
            print(f"{self.command}: [{count}] {what}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Silent(Progress):
    """No output: a tool called from Python, or inside another tool that reports its own stages."""

    def __init__(self) -> None:
        self.command, self.total, self.done, self.bar, self.log_lines = "", None, 0, None, False

    def stage(self, what: str, *, total: int | None = None) -> None:
        self.done += 1
