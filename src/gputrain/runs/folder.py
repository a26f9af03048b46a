"""Run folders: a new dated folder per run, never a silent overwrite, and ``runs/latest``.

A run writes config, metrics, checkpoints and summary into one folder. Writing a second run into
a folder that holds a first one would mix their files (old ``epoch_NNNN.pt`` beside new ones), so
a non-empty folder is refused unless the user asked to continue it (``--resume``) or to replace
it (``--overwrite``). The functions here do only what they are named for; the command line calls
them in the launcher, before any worker starts, and the Trainer on rank 0 for Python-API runs.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import uuid
from datetime import datetime
from pathlib import Path

MANIFEST = "manifest.json"
"""A checkpoint folder's manifest (:mod:`gputrain.checkpoint.manifest`, named here without importing torch)."""
TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]+\.tmp$")
"""A checkpoint's temporary, as :data:`gputrain.checkpoint.files.TEMPORARY` names them."""

LATEST = "latest"
"""Name of the symlink, beside the dated folders, that points to the newest one."""

RUN_MARKER = ".gputrain"
"""Written into every folder gputrain creates for a run (and a benchmark's runs): what ``--overwrite`` looks for."""

OWNED_FILES = frozenset({RUN_MARKER, "config.yaml", "metrics.jsonl", "metrics.csv", "summary.json", "memory.json", "eval.json",
                         "predictions.json", "curves.png", "samples.png", "scale.json", "scale.md", "scale.png",
                         "throughput.json"})
"""The files gputrain writes at the top of a run folder (and of ``bench`` folders)."""
OWNED_TREES = frozenset({"tensorboard", "wandb", "splits", "nonfinite"})
"""Folders gputrain, or a logger it runs, fills whole: everything inside is theirs."""
CHECKPOINTS = "checkpoints"


def _slug(name: str) -> str:
    """A folder-name-safe form of a recipe or task name (``my/recipe.yaml`` -> ``recipe``)."""
    stem = Path(name.split(":")[-1]).stem if name.endswith((".yaml", ".yml")) else name.split(":")[-1]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "run"


def run_name(recipe: str, task: str) -> str:
    """What a run of ``recipe`` is named after: the recipe (a file's stem); a saved ``config.yaml`` run as a recipe,
    its task."""
    stem = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    return task if stem == "config" else stem


def default_run_dir(name: str, root: str | Path = "runs", now: datetime | None = None) -> Path:
    """Create and return a new, empty folder ``root/NAME-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... if taken).

    The folder is created here, with ``mkdir`` that fails if it exists, so two runs started in the
    same second (or two processes racing) each get their own folder.
    """
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = f"{_slug(name)}-{stamp}"
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = root / (base if n == 1 else f"{base}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("unreachable")


def _is_file(path: Path) -> bool:
    return path.exists() and not path.is_dir()


def check_run_folder(path: str | Path, *, resume: str, overwrite: bool, api: bool = False) -> None:
    """Refuse a run folder that would mix two runs; raises ``ValueError`` with one line naming the ways out.

    Allowed: a folder that does not exist or is empty; a non-empty one that the run continues
    (``resume="auto"``, or a checkpoint inside the folder), or one to be cleared first
    (``overwrite``, when it looks like a gputrain run). A checkpoint path from elsewhere starts a
    new run, so it needs an empty folder like any new run. ``api``: the ways out are named as the ``Trainer``'s
    arguments (``resume="auto"``), not the command line's flags.
    """
    out, again, clear = ("out", 'resume="auto"', "overwrite=True") if api else ("--out", "--resume auto", "--overwrite")
    path = Path(path)
    if _is_file(path):
        raise ValueError(f"--out {path} is a file, not a folder; give a folder for the run (config.yaml, "
                         "checkpoints/, metrics.jsonl go inside it)")
    inside = bool(resume) and resume != "auto" and Path(resume).resolve().is_relative_to(path.resolve())
    if overwrite and resume == "auto":
        raise ValueError(f"--overwrite would delete the run in {path} that --resume auto continues; choose one")
    if overwrite and inside:
        raise ValueError(f"--overwrite would delete {resume}, the checkpoint --resume starts from; copy it out "
                         "of the run folder first, or choose another --out")
    if not path.is_dir() or not any(path.iterdir()) or resume == "auto" or inside:
        return
    if overwrite:
        _check_clearable(path)
        return
    raise ValueError(f"run folder {path} is not empty; continue that run with {again}, or replace it with "
                     f"{clear} (deletes its contents), or choose another {out}")


def _check_clearable(path: Path) -> None:
    """Refuse to clear anything but a folder that holds gputrain's files and nothing else.

    ``--overwrite`` removes only what gputrain wrote: a folder holding one file of anyone else (a project's
    ``train.py``, another tool's checkpoint) is refused, naming that file, and nothing is removed.
    """
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve() or cwd.is_relative_to(resolved):
        raise ValueError(f"--overwrite will not clear {path}: it is the working folder, one above it, the home "
                         "folder or the root; choose a run folder for --out")
    if not (path / RUN_MARKER).is_file() and not (path / CHECKPOINTS / MANIFEST).is_file():
        raise ValueError(f"--overwrite will not clear {path}: it holds no gputrain run (no {RUN_MARKER} or "
                         f"{CHECKPOINTS}/{MANIFEST}); choose another --out, or empty the folder yourself")
    foreign = foreign_file(path)
    if foreign is not None:
        raise ValueError(f"--overwrite will not clear {path}: {foreign} was not written by gputrain; move it out "
                         "of the folder (or empty the folder yourself), or choose another --out")


def foreign_file(run: Path) -> Path | None:
    """The first file or folder under ``run`` that gputrain did not write (None when every entry is its own)."""
    for entry in sorted(run.iterdir()):
        name = entry.name
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            return entry
        if entry.is_file() and name in OWNED_FILES or entry.is_dir() and name in OWNED_TREES:
            continue
        if entry.is_dir() and name == CHECKPOINTS:
            found = _foreign_checkpoint(entry)
        elif entry.is_dir() and (name == "eval" or (entry / RUN_MARKER).is_file()):  # eval/, a benchmark's runs
            found = foreign_file(entry)
        else:
            found = _first_file(entry)
        if found is not None:
            return found
    return None


def _first_file(entry: Path) -> Path:
    """A file inside a foreign folder (the first by name), to name in the refusal; the folder when it is empty."""
    if entry.is_dir() and not entry.is_symlink():
        inside = sorted(p for p in entry.rglob("*") if not p.is_dir())
        return inside[0] if inside else entry
    return entry


def _foreign_checkpoint(folder: Path) -> Path | None:
    """The first entry of a checkpoint folder that its manifest does not account for."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        listed = {*manifest.get("files", {}), *manifest.get("pending", {}), *manifest.get("retire", [])}
    except (OSError, ValueError, AttributeError, TypeError):  # none, or damaged: it accounts for nothing
        listed = set()
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink():
            return entry
        if entry.is_file() and (entry.name == MANIFEST or entry.name in listed or TEMPORARY.match(entry.name)):
            continue
        if entry.is_dir() and entry.suffix == ".dcp":  # a sharded checkpoint: torch.distributed.checkpoint's files
            odd = [f for f in sorted(entry.iterdir()) if not (f.is_file() and (f.name == ".metadata"
                                                                              or f.suffix == ".distcp"))]
            if odd:
                return _first_file(odd[0])
            continue
        return _first_file(entry)
    return None


def mark_run_folder(path: str | Path) -> None:
    """Write the run marker into ``path`` (created if needed), so a later ``--overwrite`` knows the folder is ours."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    marker = path / RUN_MARKER
    if not marker.exists():
        marker.write_text("This folder was written by gputrain; `--overwrite` removes only gputrain's files.\n")


def clear_run_folder(path: str | Path) -> None:
    """Delete everything inside ``path`` (a gputrain run folder holding only gputrain's files), keeping the folder.

    The folder stays so that a ``runs/latest`` link to it, or a shell sitting in it, stays valid.
    """
    path = Path(path)
    if not path.is_dir():
        return
    _check_clearable(path)
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def point_latest(path: str | Path) -> bool:
    """Make ``path.parent/latest`` a relative symlink to ``path``, replaced atomically.

    Returns False (and changes nothing) when ``latest`` exists and is not a symlink, e.g. a real
    folder written by an older gputrain whose default output folder was ``runs/latest``.
    """
    path = Path(path)
    link = path.parent / LATEST
    if link.exists() and not link.is_symlink():
        return False
    tmp = path.parent / f".{LATEST}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    os.symlink(path.name, tmp, target_is_directory=True)
    try:
        os.replace(tmp, link)  # rename(2) over the old link: readers see the old target or the new one
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return True


def latest_target(path: str | Path) -> str | None:
    """Where ``latest`` beside ``path`` points now (None: no such link)."""
    link = Path(path).parent / LATEST
    return os.readlink(link) if link.is_symlink() else None


UNTRAINED = frozenset({RUN_MARKER, "config.yaml", "splits"})
"""All a new run folder holds when its run stopped before its first step: the marker, the config, the data split."""


def forget_untrained_run(path: str | Path, latest_before: str | None) -> bool:
    """Remove the new dated folder ``path`` of a run that failed before it trained (nothing in it but
    :data:`UNTRAINED`), and point ``latest`` back to ``latest_before`` if it still points to ``path``: a refused
    run must not leave ``runs/latest`` on an empty folder. Anything more (metrics, checkpoints, a non-finite
    bundle) keeps the folder."""
    path = Path(path)
    if not path.is_dir() or any(child.name not in UNTRAINED for child in path.iterdir()):
        return False
    shutil.rmtree(path)
    link = path.parent / LATEST
    if link.is_symlink() and os.readlink(link) == path.name:
        if latest_before and (path.parent / latest_before).is_dir():
            point_latest(path.parent / latest_before)
        else:
            link.unlink()
    return True


def check_output_file(path: str | Path, *, overwrite: bool, flag: str = "--out") -> Path:
    """A file a command is about to write (``model.onnx``): not a folder, and not replaced unless asked."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path, e.g. {path / 'model.onnx'}")
    if path.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists; pass --overwrite to replace it, or choose another {flag}")
    return path


def check_eval_folder(path: str | Path, *, overwrite: bool) -> Path:
    """The folder ``gputrain eval`` writes ``eval.json`` into: a folder, whose earlier results are kept unless asked."""
    path = Path(path)
    if _is_file(path):
        raise ValueError(f"--out {path} is a file, not a folder; give a folder for eval.json")
    if (path / "eval.json").exists() and not overwrite:
        raise ValueError(f"{path} already holds eval.json; pass --overwrite to replace it, or choose another --out")
    return path


def eval_dir_for(checkpoint: str | Path, name: str) -> Path:
    """Where ``gputrain eval`` writes by default: ``RUN/eval`` for a checkpoint in ``RUN/checkpoints``.

    Any other checkpoint gets a new dated folder ``runs/NAME-eval-...``.
    """
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "eval"
    return default_run_dir(f"{_slug(name)}-eval")
