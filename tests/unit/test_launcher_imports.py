"""The launcher's checks of a built-in recipe import neither torch nor torchvision (issue 39).

``gputrain train RECIPE --devices N`` starts its ranks before it imports torch, so that the ranks' imports and its
own run at once (tests/e2e/test_faults.py checks that with the autoencoder). The checks before the start must keep
it that way for every recipe: checking a torchvision model's name under ddp once imported torchvision (2-3 s of CPU)
and torch in the launcher, while the ranks had not yet started.
"""

from __future__ import annotations

import subprocess
import sys

from gputrain.config.load import builtin_recipes

CHECKS = """
import sys
from gputrain.cli import preflight
from gputrain.config import load_config

for recipe in sys.argv[1:]:
    cfg = load_config(recipe, ["trainer.strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu"])
    preflight.check_packages(cfg)
    preflight.check_model(cfg)
    preflight.devices_note(cfg.trainer.strategy, cfg.trainer.devices, cfg.trainer.accelerator)
print(sorted(name for name in ("torch", "torchvision") if name in sys.modules))
"""


def test_the_checks_before_the_ranks_start_import_no_torch_for_any_built_in_recipe():
    done = subprocess.run([sys.executable, "-c", CHECKS, *builtin_recipes()], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


USER_MODEL = """
import sys, torch
from gputrain import Trainer

data = [(torch.randn(4), torch.randn(1)) for _ in range(8)]
Trainer(accelerator="cpu", epochs=1, batch_size=4, progress_bar=False, pictures=0, loggers=[]).fit(
    torch.nn.Linear(4, 1), data, loss=torch.nn.functional.mse_loss)
print(sorted(name for name in ("torchvision", "torchcodec") if name in sys.modules))
"""


def test_training_a_model_of_ones_own_on_tensors_imports_neither_torchvision_nor_torchcodec(tmp_path):
    """torchvision's import is about 1 s of CPU per process (its models, its ops and torch._dynamo's import through
    them), TorchCodec's a little more: a run that reads no image and builds no torchvision model pays neither."""
    done = subprocess.run([sys.executable, "-c", USER_MODEL], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
