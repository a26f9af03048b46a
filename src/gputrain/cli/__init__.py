"""The ``gputrain`` command line: :mod:`~gputrain.cli.main` (entry point and exit codes), :mod:`~gputrain.cli.parser`
(flags), :mod:`~gputrain.cli.commands` (one function per sub-command) and :mod:`~gputrain.cli.preflight` (what the
launcher checks before any worker starts). Nothing here imports torch until a command runs."""

from gputrain.cli.main import main

__all__ = ["main"]
