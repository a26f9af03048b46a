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
