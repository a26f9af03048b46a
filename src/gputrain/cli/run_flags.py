"""The run flags of ``gputrain train``, defined once and taken by every command that runs a recipe.

A train command line with ``train`` replaced by ``plan``, ``doctor``, ``parity`` or ``bench`` parses: each flag is
either used (as the config field it sets, or with the command's own meaning where the command defines the flag
itself, like ``parity --epochs``) or refused in one line that says why it means nothing to that command. No
torch import here: parsing answers at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import Any

PRECISIONS = ["auto", "mixed", "32", "16-mixed", "bf16-mixed"]

CONFIG_FIELD = {
    "devices": "trainer.devices", "strategy": "trainer.strategy", "precision": "trainer.precision",
    "epochs": "trainer.epochs", "batch_size": "trainer.batch_size", "seed": "trainer.seed", "out": "trainer.out",
    "overwrite": "trainer.overwrite", "resume": "trainer.resume", "nnodes": "launch.nnodes",
    "node_rank": "launch.node_rank", "rdzv_endpoint": "launch.rdzv_endpoint", "max_restarts": "launch.max_restarts",
    "data_root": "data.root", "accelerator": "trainer.accelerator",
}
"""The config field each run flag sets; ``--memory-budget`` sets none (it is the plan's budget)."""

_LAUNCH = "it runs on this machine only; --nnodes, --node-rank and --rdzv-endpoint launch training jobs"
_NEW_RUN = "it trains no run of yours; --resume continues a training run (gputrain train ... --resume auto)"
_RESTARTS = "it restarts nothing; --max-restarts is for training jobs under torchrun"
_BUDGET = "the memory budget is for gputrain plan and train --strategy auto"

REFUSED: dict[str, dict[str, str]] = {
    "eval": {"memory_budget": _BUDGET},
    "plan": {
        "strategy": "plan predicts every strategy and names the fastest that fits; train --strategy auto runs it",
        "epochs": "plan predicts one training step, which the number of epochs does not change",
        "out": "plan writes no run folder; --json FILE writes its plans",
        "overwrite": "plan writes no run folder; --json FILE writes its plans",
        "resume": "plan predicts a new run; to plan a run you continue, plan its recipe",
        "max_restarts": _RESTARTS, "node_rank": "plan predicts every node's devices from here; give --nnodes",
        "rdzv_endpoint": "plan predicts every node's devices from here; give --nnodes",
    },
    "doctor": {
        "epochs": "the dry run is 2 epochs of --steps steps each",
        "out": "doctor writes no run folder; --json prints its report as JSON",
        "overwrite": "doctor writes no run folder", "resume": _NEW_RUN, "max_restarts": _RESTARTS,
        "memory_budget": _BUDGET, "nnodes": _LAUNCH, "node_rank": _LAUNCH, "rdzv_endpoint": _LAUNCH,
    },
    "parity": {
        "devices": "parity runs each mode on its own process count (1 or 2); choose the modes with --modes",
        "strategy": "parity runs every mode; choose them with --modes",
        "out": "parity writes its runs to a temporary folder; --json prints its report as JSON",
        "overwrite": "parity writes its runs to a temporary folder", "resume": _NEW_RUN, "max_restarts": _RESTARTS,
        "memory_budget": _BUDGET, "nnodes": _LAUNCH, "node_rank": _LAUNCH, "rdzv_endpoint": _LAUNCH,
    },
    "bench scale": {"resume": _NEW_RUN, "max_restarts": _RESTARTS, "memory_budget": _BUDGET, "nnodes": _LAUNCH,
                    "node_rank": _LAUNCH, "rdzv_endpoint": _LAUNCH},
    "bench throughput": {
        "devices": "bench throughput measures one device", "strategy": "bench throughput measures one device",
        "resume": _NEW_RUN, "max_restarts": _RESTARTS, "memory_budget": _BUDGET, "nnodes": _LAUNCH,
        "node_rank": _LAUNCH, "rdzv_endpoint": _LAUNCH},
}
"""For each command that takes a recipe (train refuses none): the run flags it refuses, and why."""


def nodes(text: str) -> str:
    """``--nnodes``: a count, or ``MIN:MAX`` for a job whose nodes may leave and join (torchrun's form); a value that
    is neither is one line (checked after parsing, so argparse prints no usage text)."""
    parts = str(text).split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--nnodes {text}: give a number of nodes, or MIN:MAX for an elastic job (e.g. 1:4)")
    if len(parts) == 2 and int(parts[1]) < int(parts[0]):
        raise ValueError(f"--nnodes {text}: MAX must be at least MIN")
    return str(text).strip()


def node_overrides(value: str) -> list[str]:
    """The config fields ``--nnodes`` sets: ``launch.nnodes``, and ``launch.max_nodes`` for ``MIN:MAX``."""
    low, _, high = str(value).partition(":")
    return [f"launch.nnodes={int(low)}", f"launch.max_nodes={int(high) if high else 0}"]


DEFINITIONS: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [
    ("devices", ("--devices",), {"type": int, "help": "processes on this node (one per GPU; ddp)"}),
    ("strategy", ("--strategy",), {"help": "single, ddp, dp, ... (trainer.strategy); train: auto plans first "
                                           "(gputrain plan)"}),
    ("data_root", ("--data-root",), {"help": "dataset folder (data.root)"}),
    ("accelerator", ("--accelerator",), {"choices": ["auto", "cpu", "cuda"],
                                         "help": "where to run (trainer.accelerator)"}),
    ("precision", ("--precision",), {"choices": PRECISIONS, "help": "a recipe's 16-bit default falls back to 32 "
                                                                    "on a CPU; this flag is obeyed"}),
    ("batch_size", ("--batch-size",), {"type": int, "help": "per device; the global batch is printed at start"}),
    ("memory_budget", ("--memory-budget",), {"help": "with --strategy auto: bytes per device (12GiB, 800MB); "
                                                     "default: the GPU's free memory, or the available RAM"}),
    ("out", ("--out",), {"help": "run folder (default: a new runs/RECIPE-DATE-TIME; runs/latest points to it); "
                                 "a non-empty one needs --resume auto or --overwrite"}),
    ("overwrite", ("--overwrite",), {"action": "store_const", "const": True, "default": None,
                                     "help": "delete the contents of a non-empty --out run folder first"}),
    ("nnodes", ("--nnodes",), {"help": "nodes in the job, or MIN:MAX for an elastic one (torchrun "
                                                     "rendezvous)"}),
    ("node_rank", ("--node-rank",), {"type": int}),
    ("rdzv_endpoint", ("--rdzv-endpoint",), {"help": "HOST:PORT of the c10d rendezvous for multi-node jobs"}),
    ("epochs", ("--epochs",), {"type": int, "help": "epochs to train (trainer.epochs)"}),
    ("seed", ("--seed",), {"type": int, "help": "seed of weights, data order and augmentation"}),
    ("resume", ("--resume",), {"help": "auto (continue --out from its newest checkpoint) or a checkpoint"}),
    ("max_restarts", ("--max-restarts",), {"type": int, "help": "torchrun elastic restarts"}),
]
"""(dest, option strings, add_argument keywords) of every run flag, as train documents them."""


def add_run_flags(p: argparse.ArgumentParser, command: str, *, own: Collection[str] = (),
                  hidden: Collection[str] = ()) -> None:
    """Every run flag of train on ``p``, except those in ``own`` (the command defined them with its own meaning).

    Flags the command refuses, and ``hidden`` ones, stay out of its --help. ``--seed`` and the rest are parsed
    either way, so that :func:`refuse_flags` can answer with the reason instead of argparse's "unrecognized".
    """
    refused = REFUSED.get(command, {})
    for dest, names, keywords in DEFINITIONS:
        if dest in own:
            continue
        if dest in refused or dest in hidden:
            keywords = {**keywords, "help": argparse.SUPPRESS}
        p.add_argument(*names, dest=dest, **keywords)
    p.set_defaults(run_flags_of=command, own_run_flags=tuple(own))


def refuse_flags(args: argparse.Namespace) -> None:
    """One line naming the first given run flag that means nothing to this command, and why."""
    command = getattr(args, "run_flags_of", None)
    for dest, why in REFUSED.get(command or "", {}).items():
        if getattr(args, dest, None) is not None:
            raise ValueError(f"--{dest.replace('_', '-')} does not apply to gputrain {command}: {why}")


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """Config overrides of the run flags given to a tool (plan, doctor, parity, bench), as train passes them: those
    it defines itself, those it refuses and the common ones (``--data-root``, ``--accelerator``: the parser's
    ``common_overrides``, for every command) excepted."""
    own, refused = getattr(args, "own_run_flags", ()), REFUSED.get(getattr(args, "run_flags_of", "") or "", {})
    return [item for dest, key in CONFIG_FIELD.items()
            if dest not in ("data_root", "accelerator") and dest not in own and dest not in refused
            and getattr(args, dest, None) is not None for item in field_overrides(dest, key, getattr(args, dest))]


def field_overrides(dest: str, key: str, value: Any) -> list[str]:
    """The overrides one run flag's value stands for (``--nnodes 1:2`` sets two fields)."""
    return node_overrides(value) if dest == "nnodes" else [f"{key}={value}"]


FLAG_ELSEWHERE = {"--checkpoint": "gputrain train continues a checkpoint with --resume PATH (or --resume auto --out "
                                  "RUN); eval, predict and export take --checkpoint"}
"""Flags of another command a user is likely to give this one, and where they belong."""


def unrecognized(command: str, bad: list[str]) -> str:
    """The one line for flags ``command`` does not take: which command takes each, where one does, and its help."""
    names = [flag.split("=", 1)[0] for flag in bad]
    hints = [FLAG_ELSEWHERE[name] for name in names if name in FLAG_ELSEWHERE]
    run_flags = [name for name in names if name.lstrip("-").replace("-", "_") in CONFIG_FIELD]
    if run_flags and not hints:
        hints.append(f"{', '.join(run_flags)} {'is a flag' if len(run_flags) == 1 else 'are flags'} of gputrain "
                     f"train and the commands that run a recipe, not of gputrain {command}")
    return (f"unrecognized arguments: {' '.join(bad)}" + (f" ({'; '.join(hints)})" if hints else "")
            + f"; see gputrain {command} --help")
