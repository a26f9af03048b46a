"""The ``gputrain`` command's entry point: parse the command line, run its sub-command, turn failures into exit codes.

Each sub-command is a function of :mod:`gputrain.cli.commands`; the parser is :mod:`gputrain.cli.parser`. A
failure of bad input is one ``gputrain: error:`` line (exit 2), a traceback never reaches the user unless
``GPUTRAIN_DEBUG=1``. Exit codes: docs/cli.md. Nothing here imports torch: ``--help``, ``--version`` and usage or
config errors answer without it (benchmarks/cli_startup.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from gputrain import __version__
from gputrain.cli import commands
from gputrain.cli.parser import DESCRIPTION, EPILOG, check_flags, common_overrides
from gputrain.cli.run_flags import flag_overrides, refuse_flags, unrecognized
from gputrain.errors import EXIT_USAGE, Interrupted, MissingExtra, exit_code_for_signal

USAGE_ERRORS = (ValueError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, MissingExtra)
"""Bad input: one ``gputrain: error:`` line and exit 2 (a diverged run's NonFiniteError is a ValueError: exit 3)."""

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line as the command function sees it: flags parsed, common flags and key=value in ``overrides``."""
    from gputrain.cli.parser import build_parser

    c = commands
    handlers = {"train": c.cmd_train, "eval": c.cmd_eval, "data make": c.cmd_data_make,
                "bench scale": c.cmd_bench_scale, "bench throughput": c.cmd_bench_throughput,
                "export onnx": c.cmd_export_onnx, "parity": c.cmd_parity, "doctor": c.cmd_doctor, "plan": c.cmd_plan, "env": c.cmd_env,
                "predict": c.cmd_predict, "report": c.cmd_report, "replay": c.cmd_replay}
    parser = build_parser(DESCRIPTION, EPILOG, __version__, c.TRAINING_ONLY, handlers)
    # Dotted overrides may come after flags; argparse cannot mix a nargs="*" positional with
    # flags under sub-commands, so collect leftovers of the form key=value ourselves.
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if x.startswith("-") or "=" not in x]
    if bad:
        sub = getattr(args, f"{args.command}_command", None)  # data make, bench scale, export onnx
        parser.error(unrecognized(f"{args.command} {sub}" if sub else args.command, bad))
    optional_recipe = args.command in ("eval", "export")
    if optional_recipe and args.recipe and "=" in args.recipe and not args.recipe.endswith((".yaml", ".yml")):
        extra, args.recipe = [args.recipe, *extra], None  # the recipe is optional here: this was an override
    if extra:
        if not hasattr(args, "overrides"):
            parser.error(f"{args.command} takes no key=value overrides: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    if hasattr(args, "overrides"):  # flags first: an explicit key=value wins, as for train's own flags
        tool = getattr(args, "run_flags_of", None) not in (None, "train", "eval")  # train and eval map their own
        args.overrides = common_overrides(args) + (flag_overrides(args) if tool else []) + list(args.overrides)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        # Recipes name user code as package.module:function; find it in the working directory as
        # `python -m gputrain` (what torchrun workers run) does, so 1 and N processes behave alike.
        sys.path.insert(0, os.getcwd())
    args = parse_args(argv)
    worker = False
    try:
        worker = commands.is_worker()
        if worker and _started_by_gputrain():  # a rank stops when the process that started it dies
            from gputrain.launcher.direct import die_with_parent

            die_with_parent()
        # torchrun gives each worker an error file: torch's `record` writes the exception there, for
        # the launcher to pick the first failing rank by time.
        command = _recorded(args.func) if worker and "TORCHELASTIC_ERROR_FILE" in os.environ else args.func
        check_flags(args)
        refuse_flags(args)
        return command(args, argv)
    except Interrupted as err:  # the loop printed the one line (and wrote the checkpoint)
        return err.exit_code
    except KeyboardInterrupt:
        if not worker:
            print("gputrain: interrupted", file=sys.stderr)
        return exit_code_for_signal(signal.SIGINT)
    except USAGE_ERRORS as err:
        if _debug():
            raise
        _print_error(err, worker)
        return int(getattr(err, "exit_code", EXIT_USAGE))
    except Exception:
        if worker and _started_by_gputrain() and not _debug():
            return 1  # recorded in the error file; the launcher prints the first failing rank's line
        raise


def _recorded(func: Any) -> Any:
    from gputrain.launcher.worker_errors import worker_record

    return worker_record(func, usage=USAGE_ERRORS)


def _debug() -> bool:
    """``GPUTRAIN_DEBUG=1`` (gputrain.launcher.spec.debug, read here without importing torch for a usage error)."""
    return bool(os.environ.get("GPUTRAIN_DEBUG"))


def _started_by_gputrain() -> bool:
    from gputrain.launcher.spec import LAUNCHER_ENV

    return bool(os.environ.get(LAUNCHER_ENV))


def _print_error(err: BaseException, worker: bool) -> None:
    """One line; a worker started by gputrain leaves it to the launcher, one under plain torchrun names its rank."""
    if worker and _started_by_gputrain():
        return
    rank = f"rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID'))}: " if worker else ""
    print(f"gputrain: error: {rank}{str(err).strip()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
