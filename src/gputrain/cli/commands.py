"""What each sub-command does: check what can be checked here, then launch the ranks or run in this process.

The process the user started is the launcher: it checks everything it can (config, paths, packages, checkpoint,
run folder) before any worker starts, decides what must be the same on every rank (the run folder, a precision
fallback) and hands the workers the same command line with those values appended, so they never decide them again.

Nothing here imports torch at module level: a command function imports its tool inside itself, after the config is
loaded and checked, so a config error answers without it (benchmarks/cli_startup.py). Keep that pattern for new
sub-commands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gputrain.cli import preflight
from gputrain.cli.parser import COMMON_FLAGS
from gputrain.cli.run_flags import CONFIG_FIELD, field_overrides
from gputrain.config import RunConfig, load_config
from gputrain.errors import EXIT_OK
from gputrain.launcher.spec import is_worker  # whether this process is a rank (imports no torch)

# Flags that are shorthands for config fields; everything else is a dotted key=value override. --data-root and
# --accelerator (cli_parser.COMMON_FLAGS) reach train, eval and predict as overrides from the parser already.
TRAIN_FLAGS = {name: key for name, key in CONFIG_FIELD.items() if name not in COMMON_FLAGS}
TRAINING_ONLY = ("epochs", "seed", "resume", "max_restarts")
"""Train flags that eval accepts for scripts that share a command line, ignores, and leaves out of --help."""


def _overrides(args: argparse.Namespace, skip: Sequence[str] = ()) -> list[str]:
    flags = [item for name, key in TRAIN_FLAGS.items() if name not in skip and getattr(args, name, None) is not None
             for item in field_overrides(name, key, getattr(args, name))]
    return flags + list(args.overrides)


def _quote(value: str) -> str:
    """A YAML single-quoted scalar, so any path survives the dotted-override parser."""
    return "'" + value.replace("'", "''") + "'"


def _explicit(args: argparse.Namespace, field: str, flag: str) -> bool:
    return getattr(args, flag, None) is not None or any(o.split("=", 1)[0] == field for o in args.overrides)


def _prepare(cfg: RunConfig, args: argparse.Namespace) -> tuple[RunConfig, list[str]]:
    """Launcher-side checks shared by train and eval; returns the config and overrides for the workers."""
    t = cfg.trainer
    preflight.check_accelerator(t.accelerator)
    precision, line = preflight.cpu_precision(t.precision, t.accelerator,
                                              explicit=_explicit(args, "trainer.precision", "precision"))
    if line:
        print(line, file=sys.stderr if precision == t.precision else sys.stdout, flush=True)
    extra = [] if precision == t.precision else [f"trainer.precision={precision}"]  # a plain name: no quoting
    t.precision = precision
    note = preflight.devices_note(t.strategy, t.devices, t.accelerator)
    if note:
        print(note, flush=True)
    preflight.check_packages(cfg)
    preflight.check_data_paths(cfg)
    preflight.check_model(cfg)
    preflight.fetch_weights(cfg)
    return cfg, extra


def _launch_or_run(cfg: RunConfig, worker_argv: Sequence[str], run: Callable[[RunConfig], Any]) -> int:
    from gputrain.launcher.ranks import run_command
    from gputrain.launcher.spec import LaunchSpec

    spec = LaunchSpec.from_config(cfg)  # no torch import: the ranks start first and import it at once
    if spec.needs_launch:
        return run_command(spec, "gputrain", worker_argv)  # the workers run the same command line and join
    run(cfg)
    return EXIT_OK


def _run_train(cfg: RunConfig) -> None:
    from gputrain.tools.train import train_from_config

    train_from_config(cfg)  # the "continue with" line is built from this command line, by tools/train.py


def cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    cfg = load_config(args.recipe, _overrides(args))  # a config error is one line before torch is imported
    from gputrain.runs import folder as run_folder

    if is_worker():  # the launcher checked and resolved everything
        _run_train(cfg)
        return EXIT_OK
    if cfg.trainer.resume and cfg.trainer.resume != "auto":
        from gputrain.checkpoint.load import load_checkpoint
        from gputrain.checkpoint.state import check_same_run

        saved = load_checkpoint(cfg.trainer.resume)  # unreadable or truncated: one line naming the file, first
        check_same_run(saved.get("config") or {}, str(cfg.task), cfg.model.name, cfg.trainer.resume)  # another run's
    planned = _plan_strategy(cfg, args) if cfg.trainer.strategy == "auto" else []
    if planned:  # every setting of the plan, here as in the workers (which load them from their command line)
        cfg = load_config(args.recipe, [*_overrides(args), *planned])
    cfg, extra = _prepare(cfg, args)
    extra = [*planned, *extra]
    t = cfg.trainer
    if cfg.launch.elastic and not t.resume:  # each node continues the run in the shared --out
        if not t.out:
            raise ValueError(f"--nnodes {cfg.launch.nnodes}:{cfg.launch.max_nodes} needs --out, the run folder every "
                             "node of the job shares (on storage each node can read)")
        t.resume = "auto"
        extra.append("trainer.resume=auto")
    if not t.out and t.resume == "auto":
        raise ValueError("--resume auto continues a run folder: name it with --out (e.g. --out runs/latest)")
    if t.out:
        run_folder.check_run_folder(t.out, resume=t.resume, overwrite=t.overwrite)
        if t.overwrite:
            run_folder.clear_run_folder(t.out)
            extra.append("trainer.overwrite=false")  # cleared once, here: not again under rank 0's first files
    else:
        t.out = str(run_folder.default_run_dir(run_folder.run_name(args.recipe, str(cfg.task))))
        before = run_folder.latest_target(t.out)
        if not run_folder.point_latest(t.out):
            print(f"gputrain: runs/latest is a folder (an older gputrain's default output), so it was left alone; "
                  f"this run is in {t.out}", flush=True)
        extra.append(f"trainer.out={_quote(t.out)}")  # the workers must not pick another timestamp
        code = 1
        try:  # a run refused before it trained leaves no empty dated folder, and runs/latest where it was
            code = _launch_or_run(cfg, [*argv, *extra], _run_train)
            return code
        finally:
            if code != EXIT_OK:
                run_folder.forget_untrained_run(t.out, before)
    t.overwrite = False
    return _launch_or_run(cfg, [*argv, *extra], _run_train)


def _plan_strategy(cfg: RunConfig, args: argparse.Namespace) -> list[str]:
    """``--strategy auto``: plan here, before any worker, and hand the workers the chosen plan's settings."""
    if cfg.trainer.resume:
        raise ValueError("--strategy auto plans a new run; to continue one, give its strategy "
                         "(config.yaml in the run folder records the one auto chose)")
    from gputrain.tools.plan.command import auto_overrides

    overrides, line = auto_overrides(cfg, devices=cfg.trainer.devices, nnodes=cfg.launch.nnodes,
                                     budget_text=getattr(args, "memory_budget", "") or "")
    print(line, flush=True)
    return overrides


def cmd_plan(args: argparse.Namespace, argv: Sequence[str]) -> int:
    cfg = load_config(args.recipe, list(args.overrides))  # the run flags given are overrides already (parse_args)
    if args.memory_budget:
        from gputrain.tools.plan.budget import parse_size

        parse_size(args.memory_budget)  # before torch: a typo answers at once
    preflight.check_data_paths(cfg)
    preflight.check_model(cfg)
    from gputrain.tools.plan.command import cmd_plan as run

    return run(cfg, recipe=args.recipe, devices=args.devices or cfg.trainer.devices, nnodes=args.nnodes,
               budget_text=args.memory_budget, json_path=args.json)


def cmd_eval(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.runs import folder as run_folder
    from gputrain.tools.evaluate import evaluate_from_config
    from gputrain.tools.from_checkpoint import build_fitting_model, config_from_checkpoint, load_for_eval

    state = load_for_eval(args.checkpoint, args.weights)
    cfg, note = config_from_checkpoint(state, args.checkpoint, recipe=args.recipe,
                                       overrides=_overrides(args, skip=TRAINING_ONLY))
    run = lambda c: evaluate_from_config(c, args.checkpoint, state)  # noqa: E731
    if is_worker():
        run(cfg)
        return EXIT_OK
    ignored = [f"--{n.replace('_', '-')}" for n in TRAINING_ONLY if getattr(args, n, None) is not None]
    for line in ([note] if note else []) + ([f"gputrain: eval ignores {', '.join(ignored)}"] if ignored else []):
        print(line, flush=True)
    cfg, extra = _prepare(cfg, args)
    if cfg.model.name:  # a misfit is one line here, not N ranks' tracebacks later
        build_fitting_model(cfg, state, args.checkpoint)
    t = cfg.trainer
    name = cfg.task if note or not args.recipe else args.recipe  # a note: the recipe was ignored
    if t.out:
        run_folder.check_eval_folder(t.out, overwrite=t.overwrite)
    else:
        t.out = str(run_folder.check_eval_folder(run_folder.eval_dir_for(args.checkpoint, name),
                                                 overwrite=t.overwrite))
        extra.append(f"trainer.out={_quote(t.out)}")
    return _launch_or_run(cfg, [*argv, *extra], run)


def cmd_data_make(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from pathlib import Path

    from gputrain.tools.make_data import make_dataset

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder; choose another --out (sample data is "
                         "never written over existing files)")
    print(make_dataset(args.kind, out, size=args.size or 0, count=args.count or 0, seed=args.seed))
    return EXIT_OK


def _check_recipe(args: argparse.Namespace) -> None:
    """The config, packages and data paths of a tool's recipe (with its flags), before the tool starts any rank."""


    cfg = load_config(args.recipe, list(args.overrides))
    preflight.check_packages(cfg)
    preflight.check_data_paths(cfg)
    preflight.check_model(cfg)
    preflight.fetch_weights(cfg)


def cmd_bench_scale(args: argparse.Namespace, argv: Sequence[str]) -> int:
    _check_recipe(args)
    from gputrain.tools.bench.scale import scale_bench

    scale_bench(args.recipe, devices=args.devices, batch_sizes=args.batch_size, out=args.out,
                overrides=list(args.overrides), accelerator=args.accelerator or "auto", epochs=args.epochs,
                overwrite=args.overwrite)
    return EXIT_OK


def cmd_bench_throughput(args: argparse.Namespace, argv: Sequence[str]) -> int:
    _check_recipe(args)
    from gputrain.tools.bench.throughput import run_bench_throughput

    run_bench_throughput(args.recipe, epochs=args.epochs, out=args.out, overwrite=args.overwrite,
                         overrides=list(args.overrides), json_path=args.json)
    return EXIT_OK


def cmd_export_onnx(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.runs.folder import check_output_file
    from gputrain.tools.export import export_onnx

    check_output_file(args.out, overwrite=args.overwrite)
    export_onnx(args.checkpoint, args.out, input_shape=args.input_shape, opset=args.opset,
                overrides=list(args.overrides), recipe=args.recipe, weights=args.weights)
    return EXIT_OK


def cmd_predict(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.predict.command import check_predict, prepare_predict, split_overrides

    split_overrides(args)
    cfg, state, run = prepare_predict(args, _overrides(args, skip=(*TRAINING_ONLY, "out", "overwrite")))
    if is_worker():
        run(cfg)
        return EXIT_OK
    # Not the training data: predict needs only the checkpoint and the images (and the packages of its task).
    preflight.check_packages(cfg)
    precision, line = preflight.cpu_precision(cfg.trainer.precision, cfg.trainer.accelerator,
                                              explicit=_explicit(args, "trainer.precision", "precision"))
    if line:
        print(line, flush=True)
    extra = [] if precision == cfg.trainer.precision else [f"trainer.precision={precision}"]
    cfg.trainer.precision = precision
    check_predict(cfg, args, state)
    return _launch_or_run(cfg, [*argv, *extra], run)


def cmd_report(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.report import report_run

    report_run(args.run_dir, samples=args.samples)
    return EXIT_OK


def cmd_replay(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.diagnose.replay import run_replay

    return run_replay(args.bundle, device=args.accelerator)


def cmd_parity(args: argparse.Namespace, argv: Sequence[str]) -> int:
    _check_recipe(args)  # a missing data folder is one line here, not a hang or a failure on every rank
    from gputrain.tools.diagnose.parity import cmd_parity as run

    return run(args, argv)


def cmd_doctor(args: argparse.Namespace, argv: Sequence[str]) -> int:
    _check_recipe(args)  # a missing data folder is one line here, not a hang or a failure on every rank
    from gputrain.tools.diagnose.doctor import cmd_doctor as run

    return run(args, argv)


def cmd_env(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.env import cmd_env as run

    return run(args, argv)


