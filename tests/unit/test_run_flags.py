"""One command line: every command that runs a recipe takes train's run flags (``gputrain.cli.run_flags``).

A train command with ``train`` replaced by plan, doctor, parity or bench parses; each flag is used (as an override
of the config field it sets) or refused in one line that names it and says why. Parsing only: nothing is run.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from gputrain.cli.main import parse_args
from gputrain.cli.parser import check_flags
from gputrain.cli.run_flags import DEFINITIONS, REFUSED, refuse_flags

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("plan", "doctor", "parity", "bench scale", "bench throughput")
EVERY_FLAG = ["--devices", "2", "--strategy", "ddp", "--data-root", "data/x", "--accelerator", "cpu", "--precision",
              "32", "--batch-size", "4", "--memory-budget", "1GiB", "--out", "runs/x", "--overwrite", "--nnodes", "1",
              "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500", "--epochs", "2", "--seed", "3", "--resume",
              "auto", "--max-restarts", "1"]


def _parsed(command: str, argv: list[str]) -> tuple[object, str]:
    """(the parsed namespace, the refusal line or "")."""
    args = parse_args([*command.split(), "autoencoder", *argv])
    try:
        check_flags(args)  # a page may show a refused number (--devices 0): one line too
        refuse_flags(args)
    except ValueError as err:
        return args, str(err)
    return args, ""


def test_every_run_flag_is_defined_once_and_the_table_names_only_run_flags():
    dests = [d for d, _, _ in DEFINITIONS]
    assert len(dests) == len(set(dests)) == 16
    for command, refused in REFUSED.items():
        assert set(refused) <= set(dests), command


@pytest.mark.parametrize("command", TOOLS)
@pytest.mark.parametrize("index", range(0, len(EVERY_FLAG)))
def test_each_train_flag_is_used_or_refused_in_one_line_by_each_tool(command, index):
    if EVERY_FLAG[index].startswith("--"):
        flag = EVERY_FLAG[index]
        value = [] if flag == "--overwrite" else [EVERY_FLAG[index + 1]]
        args, refusal = _parsed(command, [flag, *value])
        dest = flag.removeprefix("--").replace("-", "_")
        if dest in REFUSED[command]:
            assert refusal == f"{flag} does not apply to gputrain {command}: {REFUSED[command][dest]}"
            assert "\n" not in refusal
        else:
            assert refusal == ""


def test_plan_and_doctor_take_seed_and_the_other_shared_flags_as_overrides():
    for command in ("plan", "doctor", "parity"):
        args, refusal = _parsed(command, ["--seed", "7", "--precision", "32", "--data-root", "d"])
        assert refusal == ""
        assert args.overrides[:3] == ["data.root='d'", "trainer.precision=32", "trainer.seed=7"], command
    args, _ = _parsed("plan", ["--batch-size", "6", "--devices", "2"])
    assert args.overrides == ["trainer.batch_size=6"] and args.devices == 2  # plan's own --devices: per node


def test_plan_refuses_out_naming_what_it_writes_instead():
    _, refusal = _parsed("plan", ["--seed", "0", "--out", "runs/x"])
    assert refusal == "--out does not apply to gputrain plan: plan writes no run folder; --json FILE writes its plans"


def _documented_train_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            text = line.strip().removeprefix("$ ")
            refused = number < len(lines) and lines[number].startswith("gputrain: error: unrecognized arguments")
            if text.startswith("gputrain train ") and not text.endswith("\\") and "..." not in text and not refused:
                found.append((f"{page.name}:{number}", shlex.split(text, comments=True)[2:]))
    return found


def test_every_documented_train_command_parses_as_each_tool():
    commands = _documented_train_commands()
    assert len(commands) >= 20
    for where, argv in commands:
        argv = [a for a in argv if a != "&"]
        for command in TOOLS:
            args, refusal = _parsed(command, argv[1:])  # argv[0] is the recipe
            assert refusal == "" or refusal.startswith("--") and ("does not apply to gputrain" in refusal
                                                                  or "must be at least" in refusal), \
                (where, command, refusal)


def test_the_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    listed = capsys.readouterr().out.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    names = {line.split()[0] for line in listed.splitlines() if line.startswith("  ") and not line.startswith("   ")}
    assert names == {"train", "eval", "export", "predict", "report", "replay", "data", "bench", "parity", "doctor",
                     "plan", "env"}


def test_nnodes_min_max_makes_an_elastic_job_and_bad_ranges_are_refused_in_one_line(capsys):
    """Issue 45: ``--nnodes MIN:MAX`` sets both fields; a range that cannot be is refused before anything starts."""
    from gputrain.cli.commands import _overrides
    from gputrain.config import load_config

    args = parse_args(["train", "autoencoder", "--nnodes", "1:3", "--rdzv-endpoint", "h:1"])
    assert {"launch.nnodes=1", "launch.max_nodes=3"} <= set(_overrides(args))
    assert {"launch.nnodes=2", "launch.max_nodes=0"} <= set(_overrides(parse_args(["train", "autoencoder",
                                                                                    "--nnodes", "2"])))
    from gputrain.cli.main import main

    for bad, why in (("3:1", "MAX must be at least MIN"), ("1:2:3", "give a number of nodes"), ("0", "give a number")):
        assert main(["train", "autoencoder", "--nnodes", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"gputrain: error: --nnodes {bad}: ") and why in err[0]  # no usage
    for strategy in ("pipeline", "single", "dp"):  # a new user's finding: single and dp trained alone, or failed late
        with pytest.raises(ValueError, match=f"strategy {strategy} runs on a fixed number of processes"):
            load_config(None, ["launch.nnodes=1", "launch.max_nodes=2", f"trainer.strategy={strategy}"])
    with pytest.raises(ValueError, match=r"launch.node_rank=2 must be in \[0, launch.max_nodes=2\)"):
        load_config(None, ["launch.nnodes=1", "launch.max_nodes=2", "launch.node_rank=2"])


@pytest.mark.parametrize(("argv", "says"), [
    (["predict", "--checkpoint", "c.pt", "--input", "x", "--out", "p", "--strategy", "ddp"],
     "(--strategy is a flag of gputrain train and the commands that run a recipe, not of gputrain predict); "
     "see gputrain predict --help"),
    (["export", "onnx", "--checkpoint", "c.pt", "--out", "m.onnx", "--epochs", "2"],
     "(--epochs is a flag of gputrain train and the commands that run a recipe, not of gputrain export onnx); "
     "see gputrain export onnx --help"),
    (["train", "autoencoder", "--checkpoint", "c.pt"],
     "(gputrain train continues a checkpoint with --resume PATH (or --resume auto --out RUN); eval, predict and "
     "export take --checkpoint); see gputrain train --help"),
])
def test_a_flag_the_command_does_not_take_says_whose_it_is_and_where_help_is(capsys, argv, says):
    """Found by a new user (round 5): argparse's bare "unrecognized arguments" gave no reason."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gputrain: error: unrecognized arguments: ") and last.endswith(says), last
