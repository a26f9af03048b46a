"""Shared by the first-hour tests (tests/e2e/test_first_hour*.py): the tiny run's flags, a user model file, a
core install, and ways to run ``gputrain`` (a process of its own, or ``gputrain.cli.main`` in this process).

A core install (``pip install gputrain``, no extras) is made by a ``sitecustomize.py`` (:data:`CORE_ONLY`) that hides
the optional packages from the path finder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from forked_cli import run_gputrain
from gputrain.cli import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
TINY = ("--devices", "1", "--accelerator", "cpu", "--epochs", "1", "--batch-size", "4", "trainer.progress_bar=false",
        "model.name=first_hour_models:tiny_ae", "model.kwargs.width=4")  # width 4: not the builder's default 8

MODELS = '''
from torch import nn

def tiny_ae(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, 3, 3, padding=1))
'''

# A core install (`pip install gputrain`, no extras), made here by hiding the optional packages from the
# path finder: find_spec returns None and imports fail exactly as for a package that is not installed.
CORE_ONLY = '''
import sys
from importlib.machinery import PathFinder

BLOCKED = {"tensorboard", "wandb", "onnx", "onnxruntime", "onnxscript", "pycocotools", "matplotlib"}


class _CoreOnly(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_CoreOnly if finder is PathFinder else finder for finder in sys.meta_path]
'''


def gputrain(*args: str, cwd: Path, core_only: Path | None = None) -> subprocess.CompletedProcess:
    """A process of its own: a new interpreter for a core install (its ``sitecustomize.py`` runs at start-up), else
    forked from the preloaded server (tests/forked_cli.py)."""
    if core_only is None:
        return run_gputrain(args, env=ENV, cwd=cwd, timeout=600)
    env = {**ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(core_only), ENV.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-m", "gputrain", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``gputrain ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The one error line a failure ends in; before it, stderr may hold only a long tool's stage lines
    (``gputrain bench scale: [1/2] ...``, tools/progress.py), never a traceback or another error."""
    lines = err.strip().splitlines()
    stages = [line for line in lines[:-1] if not line.startswith("gputrain bench scale: [")]
    assert "Traceback" not in err and lines and not stages and lines[-1].startswith("gputrain: error: "), err
    return lines[-1]


def listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def make_workdir(root: Path) -> Path:
    """A first-hour user's folder: sample frames, a models module of their own, and a core-only site hook."""
    from gputrain.data.imagefolder import make_frames

    make_frames(root / "data" / "frames", count=16, size=32, videos=2)
    (root / "first_hour_models.py").write_text(MODELS)
    (root / "core_only").mkdir()
    (root / "core_only" / "sitecustomize.py").write_text(CORE_ONLY)
    return root

