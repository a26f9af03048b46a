"""The built-in recipes shrunk to run on CPU, and the helpers that train and evaluate them through the CLI.

Shared by the recipe tests (test_recipes.py, test_recipe_maskrcnn.py) and ``benchmarks/recipes.py`` (which imports
:data:`RECIPES` and :data:`COMMON` through test_recipes.py), so the figures there describe exactly what these tests
run. Each recipe is shrunk until one run takes tens of seconds on a shared 2-core machine, and every shrinking
override says why in a comment. Every run is a ``gputrain`` process of its own (real torchrun workers where
``--devices 2``). It lives beside the tests, in tests/e2e, because the benchmark puts only that folder on its path.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gputrain.tools.make_data import make_dataset

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


COMMON = (
    "--accelerator", "cpu", "--seed", "0",
    "trainer.log_every_n_steps=1",  # every step in metrics.jsonl: the first logged loss is the untrained one
    "trainer.progress_bar=false", "trainer.loggers=[]",  # metrics.jsonl is always written; nothing else needed
    "trainer.checkpoint_every_n_epochs=0",  # last.pt only: Mask R-CNN's checkpoint is 250 MB with momentum
    "trainer.pictures=0",  # pictures are tested in tests/unit/test_report.py; here they would only cost time
)


@dataclass(frozen=True)
class RecipeRun:
    """A built-in recipe shrunk to run on CPU in tens of seconds, and the data it runs on."""

    recipe: str
    data: str
    """``gputrain data make`` kind."""
    count: int
    """Images generated (``--count``); chosen so the validation split has an odd size."""
    size: int
    """Image side generated (``--size``; 0: the kind's default)."""
    val_size: int
    """Validation images that ``count`` yields (the kind's or the recipe's split)."""
    devices: int
    """Processes of the training run."""
    args: tuple[str, ...]
    """Flags and overrides, besides data root, output folder and devices."""

    def settings(self) -> str:
        """One line for reports: data and every non-common argument."""
        return f"data make {self.data} --count {self.count} --size {self.size or 'default'}; {' '.join(self.args)}"


CIFAR10 = RecipeRun(
    recipe="cifar10-resnet18", data="cifar10", count=600, size=0, val_size=100, devices=1,
    args=(
        "--epochs", "3", "--batch-size", "32",
        # The CIFAR stem keeps 32x32 maps into layer1, about 16x the FLOPs of the ImageNet
        # stem; the generated shapes are learnable from 8x8 maps too, and that fits in seconds.
        "model.kwargs.cifar_stem=false",
        # The recipe's lr 0.05 is for batch 128; scaled linearly to batch 32 (at 0.05 the
        # loss of this short run jumps around instead of falling).
        "optim.lr=0.0125",
    ),
)


IMAGEFOLDER = RecipeRun(
    recipe="imagefolder-resnet50", data="classfolder", count=164, size=32, val_size=33, devices=1,
    args=(
        "--epochs", "6", "--batch-size", "16",
        "data.image_size=32",  # 224 px ResNet-50 runs at about 1 image/s on one CPU core
        # The recipe's lr 0.1 is for a global batch of 32 x its device count; at 16 on 1 device
        # it diverges, and its 100 warm-up steps are more than this whole run (48 steps).
        "optim.lr=0.005", "scheduler.warmup_steps=8",
        # At 32 px layer4's maps are 1x1, so the epoch's 3-image tail batch would have its
        # BatchNorm normalise over 3 values; that step alone undoes much of the epoch.
        "trainer.drop_last=true",
        # RandomResizedCrop keeps as little as 8% of the image: at 32 px a 9 px patch that often
        # misses the shape. Without it the loss falls steadily over seeds; at 224 px it is fine.
        "data.augment=false",
    ),
)


ADE20K = RecipeRun(
    recipe="ade20k-deeplabv3plus", data="ade20k", count=85, size=64, val_size=17, devices=2,
    args=(
        "--epochs", "6", "--batch-size", "8",
        "data.num_classes=8",  # the generated set has 8 classes (the recipe's 150 are ADE20K's)
        "data.image_size=64",
        # No --precision: the recipe's `mixed` must resolve to 32 on a CPU, where 16-bit autocast
        # convolutions have no fast kernels (about 100 s an epoch with 16-mixed).
        # ResNet-18 instead of 50; torchvision's BasicBlock cannot dilate, so DeepLabV3Plus runs
        # it at output stride 32 by default (it raises for 8 or 16).
        "model.kwargs.backbone=resnet18",
        # 64 channels in ASPP and decoder instead of 256: the decoder's 3x3 convs at stride 4
        # otherwise cost more than the whole backbone at 64 px.
        "model.kwargs.aspp_channels=64", "model.kwargs.decoder_channels=64",
        # trainer.sync_batchnorm=true comes from the recipe: on 2 CPU ranks it is our CpuSyncBatchNorm.
    ),
)


COCO = RecipeRun(
    recipe="coco-maskrcnn", data="coco", count=35, size=64, val_size=7, devices=2,
    args=(
        "--epochs", "4", "--batch-size", "2",
        # ResNet-18-FPN instead of ResNet-50-FPN, and the images at their generated 64 px
        # instead of resized to 512.
        "model.kwargs.backbone=resnet18", "model.kwargs.min_size=64", "model.kwargs.max_size=64",
        # The mask head (four 256-channel 3x3 convs per RoI) dominates on CPU: sample 16 RoIs
        # per image (4 positive) instead of 512, and keep at most 10 detections per image in
        # eval (the images hold at most 4 objects) instead of 100.
        "model.kwargs.box_batch_size_per_image=16", "model.kwargs.box_detections_per_img=10",
        # Fewer RPN proposals than the defaults (2000/1000) meant for 800 px images.
        "model.kwargs.rpn_pre_nms_top_n_train=300", "model.kwargs.rpn_post_nms_top_n_train=100",
        "model.kwargs.rpn_pre_nms_top_n_test=300", "model.kwargs.rpn_post_nms_top_n_test=100",
        "model.kwargs.rpn_batch_size_per_image=64",
        # lr 0.02 is for a global batch of 16; this run's is 4. The recipe's 100 warm-up
        # steps are more than this whole run (28 steps), and its decay (x0.1 after 16 of 26
        # epochs) comes after 3 of 4 here: without it the last epoch's mAP swings widely.
        "optim.lr=0.01", "scheduler.warmup_steps=5", "scheduler.step_epochs=3",
    ),
)


RECIPES: dict[str, RecipeRun] = {r.recipe: r for r in (CIFAR10, IMAGEFOLDER, ADE20K, COCO)}


def _checked(args: tuple[str, ...], done: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and done.returncode != 0:
        raise AssertionError(f"gputrain {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done


def gputrain(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """A ``gputrain`` process of its own, forked from the test worker's preloaded server (tests/forked_cli.py;
    imported here, not above: benchmarks/recipes.py imports this module without tests/ on its path)."""
    from forked_cli import run_gputrain

    return _checked(args, run_gputrain(args, env=ENV), check)


def gputrain_concurrently(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Run several ``gputrain`` commands at once, each a process of its own (:func:`gputrain`)."""
    from forked_cli import start_gputrain

    started = [start_gputrain(args, env=ENV) for args in commands]
    return [_checked(args, run.wait(), True) for args, run in zip(commands, started, strict=True)]


def make_data(spec: RecipeRun, out: Path, *, cli: bool = False) -> Path:
    """``gputrain data make`` with the spec's arguments; in this process (the same function, without
    the command's ~4 s of imports) unless ``cli``."""
    if cli:
        gputrain("data", "make", spec.data, "--out", str(out), "--count", str(spec.count),
             *(("--size", str(spec.size)) if spec.size else ()))
        return out
    return make_dataset(spec.data, out, count=spec.count, size=spec.size)


@dataclass(frozen=True)
class Trained:
    """A finished training run of a :class:`RecipeRun` and the data it read."""

    data: Path
    run: Path
    done: subprocess.CompletedProcess

    @property
    def checkpoint(self) -> Path:
        return self.run / "checkpoints" / "last.pt"


def train(spec: RecipeRun, data: Path, out: Path) -> Trained:
    done = gputrain("train", spec.recipe, "--devices", str(spec.devices), "--data-root", str(data),
                    "--out", str(out), *COMMON, *spec.args)
    return Trained(data, out, done)


def evaluate_on_1_and_2(spec: RecipeRun, trained: Trained, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``gputrain eval`` of the trained run's last checkpoint on 1 and on 2 processes: both eval.json."""
    commands = [("eval", spec.recipe, "--checkpoint", str(trained.checkpoint), "--devices", str(devices),
                 "--data-root", str(trained.data), "--out", str(out / f"eval{devices}"), *COMMON, *spec.args)
                for devices in (1, 2)]
    gputrain_concurrently(*commands)
    one, two = (json.loads((out / f"eval{d}" / "eval.json").read_text()) for d in (1, 2))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    return one, two


def records(run: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, epoch records) of a run's metrics.jsonl."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "lr" in r], [r for r in lines if "time/train_s" in r]


def assert_loss_halves(run: Path, epochs: int) -> dict[str, Any]:
    """The last epoch's mean training loss is at most half the first logged step's; returns that epoch."""
    steps, epoch_records = records(run)
    assert [r["epoch"] for r in epoch_records] == list(range(1, epochs + 1))
    assert steps[0]["step"] == 1
    first, last = steps[0]["train/loss"], epoch_records[-1]["train/loss"]
    assert last <= first / 2, f"loss fell from {first:.3f} to only {last:.3f}"
    return epoch_records[-1]


def _trained(spec: RecipeRun, tmp_path_factory: pytest.TempPathFactory, *, cli_data: bool = False) -> Trained:
    root = tmp_path_factory.mktemp(spec.recipe)
    return train(spec, make_data(spec, root / "data", cli=cli_data), root / "run")


def _epochs(spec: RecipeRun) -> int:
    return int(spec.args[spec.args.index("--epochs") + 1])


def evaluate_here_and_on_2(spec: RecipeRun, trained: Trained, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`evaluate_on_1_and_2`, with the 1-process ``gputrain eval`` run in this process (``gputrain.cli.main``:
    the same code path, without a new interpreter's seconds of imports); the 2-process one stays a real ``gputrain``
    process with real torchrun workers."""
    from gputrain.cli import main

    args = ("eval", spec.recipe, "--checkpoint", str(trained.checkpoint), "--data-root", str(trained.data), *COMMON,
            *spec.args)
    gputrain(*args, "--devices", "2", "--out", str(out / "eval2"))
    assert main([*args, "--devices", "1", "--out", str(out / "eval1")]) == 0
    one, two = (json.loads((out / f"eval{d}" / "eval.json").read_text()) for d in (1, 2))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    return one, two
