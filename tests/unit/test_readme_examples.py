"""The README's tour finishes in minutes on a CPU and says what to expect (issue 43 item 4).

A new user ran the README's model-parallel line and waited 10 epochs of ResNet-50 (4-8 minutes each on 2 cores)
for a throughput tutorial, and ran `data make` into the folder `make demo` had just made. Each `gputrain train`
line of the tour trains a recipe whose epochs are short here, or at most one epoch of one whose epochs are not,
and says what it shows; the sample-data line says when to skip it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONG_EPOCHS = {"imagefolder-resnet50", "resnet50-model-parallel", "ade20k-deeplabv3plus", "coco-maskrcnn",
               "cifar10-resnet18"}
"""Recipes whose epoch takes minutes on 2 CPU cores at their own settings."""


def _tour() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("source .venv/bin/activate", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip().startswith("gputrain ")]


def test_each_train_line_of_the_tour_is_short_on_a_cpu_and_says_what_it_shows():
    trains = [line for line in _tour() if line.startswith("gputrain train ")]
    assert len(trains) >= 4
    for line in trains:
        argv = shlex.split(line.split("#", 1)[0])
        recipe = argv[2]
        if recipe in LONG_EPOCHS:
            assert "--epochs" in argv and int(argv[argv.index("--epochs") + 1]) <= 1, line
            assert "#" in line, f"say what this run shows and how long it takes: {line}"


def test_the_sample_data_line_of_the_demo_folder_says_to_skip_it_after_make_demo():
    (frames,) = [line for line in _tour() if line.startswith("gputrain data make imagefolder --out data/frames")]
    assert "make demo" in frames.split("#", 1)[1]
