"""Exceptions that end a run on purpose, and the exit codes the command line gives them.

A user-facing failure is one line. Bad input raises ``ValueError`` or ``FileNotFoundError``
with a message naming the file, field or rank and the fix; the CLI prints it after
``gputrain: error:`` and exits with :data:`EXIT_USAGE`. The classes below are the other ways a
run ends early, each with its own documented exit code (docs/cli.md).
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_FAILED = 1
"""A worker failed (an exception that is not bad input); the failing rank's error is printed last."""
EXIT_USAGE = 2
"""Bad input: config, paths, checkpoint or flags; nothing was trained or overwritten."""
EXIT_DIVERGED = 3
"""Training produced non-finite values; no checkpoint holding them was written."""


def exit_code_for_signal(signum: int) -> int:
    """The shell convention, 128 + signal number: 130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1."""
    return 128 + int(signum)


class Interrupted(Exception):
    """A signal (SIGINT, SIGTERM, SIGUSR1) stopped training at a step boundary after one checkpoint was written."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = exit_code_for_signal(signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class NonFiniteError(ValueError):
    """Loss, weights, buffers or optimizer state became NaN/inf; the last good checkpoint is kept."""

    exit_code = EXIT_DIVERGED
    streak = 0
    """Steps in a row the 16-mixed loss scaler skipped before the run ended (0: the run ended on a NaN/inf)."""
    head = ""
    """What went non-finite, and when."""
    kept = ""
    """What was (not) written, and the checkpoint that is kept."""


class MissingExtra(ImportError):
    """An optional package is not installed; the message names the ``pip install`` that adds it (exit 2)."""
