"""The command line's shared flags (issue 15 item 7) and its start-up without torch (item 9)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gputrain.cli.main import parse_args
from gputrain.cli.parser import COMMON_FLAGS, PARITY_MODES

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "GPUTRAIN_DEBUG"):
    ENV.pop(_name, None)

# Runs the CLI like `python -m gputrain` and reports, at exit, whether torch was imported.
TORCH_PROBE = ("import atexit, runpy, sys\n"
               "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, file=sys.stderr))\n"
               "sys.argv = ['gputrain', *sys.argv[1:]]\n"
               "runpy.run_module('gputrain', run_name='__main__', alter_sys=True)\n")

RECIPE_COMMANDS = {
    "train": ["train", "autoencoder"],
    "eval": ["eval", "--checkpoint", "last.pt"],
    "parity": ["parity", "autoencoder"],
    "doctor": ["doctor", "autoencoder"],
    "bench scale": ["bench", "scale", "autoencoder"],
    "export onnx": ["export", "onnx", "--checkpoint", "last.pt", "--out", "m.onnx"],
}
"""Every command that runs a recipe, with its required arguments."""


def _probe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TORCH_PROBE, *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=120)


@pytest.mark.parametrize("command", list(RECIPE_COMMANDS))
def test_every_recipe_command_takes_every_common_flag_as_its_config_field(command):
    args = parse_args([*RECIPE_COMMANDS[command], "--data-root", "my data/it's", "--accelerator", "cpu",
                       "optim.lr=0.5"])
    assert args.overrides[:2] == ["data.root='my data/it''s'", "trainer.accelerator='cpu'"]
    assert args.overrides[-1] == "optim.lr=0.5"  # an explicit key=value comes after the flags, so it wins
    assert set(COMMON_FLAGS) == {"data_root", "accelerator"}


@pytest.mark.parametrize("command", ["parity", "doctor", "bench scale"])
def test_tools_honour_data_root_and_refuse_a_missing_one_before_any_rank(command, tmp_path):
    missing = tmp_path / "no-data"
    done = subprocess.run([sys.executable, "-m", "gputrain", *RECIPE_COMMANDS[command], "--data-root", str(missing),
                           "--accelerator", "cpu"], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"gputrain: error: data.root={missing} does not exist; make sample data with `gputrain data make "
        f"imagefolder --out {missing}` or point --data-root at your data"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run folder, no runs/


def test_parity_runs_one_mode_per_registered_strategy_with_the_strategys_own_shape():
    """A new strategy is a parity mode without editing the tool: its processes, data parallelism and micro-batching
    come from the registration and the class (known answers by hand for the built-in ones)."""
    from gputrain.strategies import STRATEGIES
    from gputrain.tools.diagnose.parity import MODES

    assert tuple(MODES) == PARITY_MODES and set(PARITY_MODES) == {*STRATEGIES, "accumulation"}
    shapes = {name: (m.processes, m.dp, m.micro_batched, m.batch_size(8)) for name, m in MODES.items()}
    assert shapes == {"single": (1, 1, False, 8), "accumulation": (1, 1, True, 4), "ddp": (2, 2, False, 4),
                      "dp": (1, 1, False, 8), "pipeline": (2, 1, True, 8), "fsdp": (2, 2, False, 4),
                      "model_parallel": (1, 1, True, 8)}


@pytest.mark.parametrize("argv,code,first", [
    (["--help"], 0, "usage: gputrain"),
    (["--version"], 0, "gputrain 0.1.0 (torch "),
    (["train", "--help"], 0, "usage: gputrain train"),
    (["train", "autoencoder", "optim.lr=1e39"], 2, "gputrain: error: optim.lr=1e+39 must be in (0, 100]"),
    (["train", "no-such-recipe"], 2, "gputrain: error: unknown recipe 'no-such-recipe'"),
    (["train", "autoencoder", "--no-such-flag"], 2, "usage: gputrain"),
], ids=["help", "version", "train-help", "lr-1e39", "unknown-recipe", "unknown-flag"])
def test_help_version_and_usage_errors_answer_without_importing_torch(argv, code, first, tmp_path):
    done = _probe(*argv, cwd=tmp_path)
    assert done.returncode == code, done.stderr
    assert (done.stdout + done.stderr).lstrip().startswith(first)
    assert done.stderr.strip().splitlines()[-1] == "torch imported: False"
    assert list(tmp_path.iterdir()) == []


def test_a_command_that_runs_imports_torch_so_the_probe_can_fail(tmp_path):
    done = _probe("env", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "torch imported: True"
