"""What the plan tests run: the measured runs of tests/e2e/test_plan_measured.py (:func:`train_runs`), and a small
model and the command line in the test's own process for tests/e2e/test_plan.py (:func:`conv_chain`,
:func:`gputrain_here`).

The measured runs are several plans trained one after another by the same ranks. Each run is what a rank of
``gputrain train RECIPE OVERRIDES`` does (:func:`gputrain.tools.train.train_from_config`: the config loaded, the
seeds, the run folder, the task built, ``Trainer.fit``), in ranks that stay up for the next run: a launch of its own
would cost each run two fresh interpreters importing torch (3-4 s of CPU apiece). A run counts only what it
allocates after it starts (``trainer.measure_memory``), so the runs before it change none of its figures. Each run's
stdout goes to ``OUT.stdout`` beside its folder, where its test reads the memory line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import subprocess
import warnings
from typing import Any

from torch import nn

from gputrain.cli import main
from gputrain.config import load_config
from gputrain.engine.state import seed_everything
from gputrain.engine.trainer import Trainer
from gputrain.tasks import build_task


def train_runs(info: Any, runs: list[tuple[str, list[str], str]]) -> None:
    """One rank (``multiproc.run_ranks``) of every run ``(recipe, overrides, out)``, in order."""
    for recipe, overrides, out in runs:
        with open(f"{out}.stdout", "w") as log, contextlib.redirect_stdout(log):
            cfg = load_config(recipe, [*overrides, f"trainer.out={out}"])
            seed_everything(cfg.trainer.seed)  # as train_from_config: the same weights on every rank and run
            trainer = Trainer(cfg)
            folder = trainer.prepare(for_training=True)
            seed_everything(cfg.trainer.seed)
            spec = build_task(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, out=str(folder))))
            trainer.fit(spec.model, spec.train_data, spec.val_data, task=spec.task)


def conv_chain(num_classes: int = 10) -> nn.Sequential:
    """Three blocks (a 3x3 convolution, BatchNorm, ReLU) at the input's full size, then a linear head: activations
    far above the weights, as a vision model's (activation checkpointing pays), from a quarter of ResNet-18's
    modules (each count on fake tensors is that much shorter). A chain every strategy can split."""
    def block(inputs: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(inputs, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())

    return nn.Sequential(block(3), block(16), block(16),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes)))


def gputrain_here(*args: str) -> subprocess.CompletedProcess:
    """``gputrain ARGS`` here, as ``python -m gputrain`` runs it (that process would import torch again, 3-4 s)."""
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()) as out, \
            contextlib.redirect_stderr(io.StringIO()) as err:  # not a terminal: log lines, no bar, as from a pipe
        warnings.resetwarnings()  # Python's defaults, not pytest's: a warning is a line of stderr, as there
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", quiet)
        try:
            code = main(list(args))
        except SystemExit as exit_:  # python -m gputrain: sys.exit(main())
            code = 0 if exit_.code is None else exit_.code
    warned = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue() + warned)
