"""Each built-in classification and segmentation recipe learns on its generated data, end to end through the CLI,
on CPU.

Every run is a real ``gputrain`` process (real torchrun workers where ``--devices 2``), so these are the slowest
tests of the suite: each recipe is shrunk (recipe_runs.py) until one run takes tens of seconds on a shared 2-core
machine. The same settings drive ``benchmarks/recipes.py`` (it imports :data:`RECIPES` from here), so the figures
there describe exactly what these tests run. Mask R-CNN on COCO: test_recipe_maskrcnn.py.

What is checked per recipe: the loss halves (the first logged step against the last epoch's mean; one step of a
few images is too noisy to be "the last loss"), the task metric ends well above chance, and ``gputrain eval`` of
the final checkpoint gives the same metric on 1 and 2 processes over a validation set of odd size, counting every
sample exactly once.
"""

from __future__ import annotations

import json
import shutil

import pytest
from recipe_runs import (
    ADE20K,
    CIFAR10,
    IMAGEFOLDER,
    Trained,
    _epochs,
    _trained,
    assert_loss_halves,
    evaluate_on_1_and_2,
    gputrain,
    records,
)

# Re-exported: benchmarks/recipes.py imports the settings from this file.
from recipe_runs import COMMON as COMMON
from recipe_runs import RECIPES as RECIPES
from recipe_runs import RecipeRun as RecipeRun

pytestmark = [
    pytest.mark.slow,
    # pycocotools 2.0 under numpy 2, when make_coco decodes masks in this process; harmless.
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]


# -- cifar10-resnet18: nn.DataParallel on CPU ------------------------------------------------


@pytest.fixture(scope="module")
def cifar10(tmp_path_factory) -> Trained:
    return _trained(CIFAR10, tmp_path_factory, cli_data=True)  # covers `gputrain data make` once


def test_cifar10_resnet18_learns_with_dp_on_cpu(cifar10):
    last = assert_loss_halves(cifar10.run, _epochs(CIFAR10))
    summary = json.loads((cifar10.run / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["device"]) == ("dp", 1, "cpu")
    assert "strategy=dp on 1 device (DataParallel on a CPU is one device" in cifar10.done.stdout
    assert last["val/samples"] == CIFAR10.val_size
    assert last["val/accuracy"] >= 0.6  # chance: 0.1


def test_cifar10_batch_with_wrong_md5_is_refused_naming_the_file(cifar10, tmp_path):
    data = tmp_path / "cifar10"
    shutil.copytree(cifar10.data, data)
    victim = data / "data_batch_3"
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF  # inside the image array: the pickle itself would still load
    victim.write_bytes(bytes(raw))
    done = gputrain("train", "cifar10-resnet18", "--accelerator", "cpu", "--data-root", str(data),
                    "--out", str(tmp_path / "run"), check=False)
    assert done.returncode == 2
    assert str(victim) in done.stderr and "md5" in done.stderr
    assert "Traceback" not in done.stderr  # the message, not a stack trace


# -- imagefolder-resnet50: DDP ResNet-50 on a class folder -----------------------------------


@pytest.fixture(scope="module")
def imagefolder(tmp_path_factory) -> Trained:
    return _trained(IMAGEFOLDER, tmp_path_factory)


def test_imagefolder_resnet50_learns(imagefolder):
    last = assert_loss_halves(imagefolder.run, _epochs(IMAGEFOLDER))
    assert last["val/samples"] == IMAGEFOLDER.val_size
    assert last["val/accuracy"] >= 0.6  # chance: 0.25 (4 classes)


def test_imagefolder_eval_is_exact_on_1_and_2_processes(imagefolder, tmp_path):
    one, two = evaluate_on_1_and_2(IMAGEFOLDER, imagefolder, tmp_path)
    assert IMAGEFOLDER.val_size % 2 == 1  # the 2 shards differ in size
    assert one["val/samples"] == two["val/samples"] == IMAGEFOLDER.val_size
    assert one["val/accuracy"] == two["val/accuracy"]
    # The training run evaluated the same weights after its last epoch.
    assert one["val/accuracy"] == records(imagefolder.run)[1][-1]["val/accuracy"]


# -- ade20k-deeplabv3plus: DDP on 2 ranks with synchronised BatchNorm ------------------------


@pytest.fixture(scope="module")
def ade20k(tmp_path_factory) -> Trained:
    return _trained(ADE20K, tmp_path_factory)


def test_ade20k_deeplabv3plus_learns_on_2_processes_with_sync_batchnorm(ade20k):
    last = assert_loss_halves(ade20k.run, _epochs(ADE20K))
    summary = json.loads((ade20k.run / "summary.json").read_text())
    assert (summary["world_size"], summary["global_batch"]) == (2, 16)
    assert summary["precision"] == "32"  # the recipe's `mixed`, resolved for a CPU
    config = (ade20k.run / "config.yaml").read_text()
    assert "sync_batchnorm: true" in config and "precision: '32'" in config
    assert last["val/samples"] == ADE20K.val_size
    # Chance: a uniformly random labelling of 8 balanced classes has an IoU near 1/15 per class.
    assert last["val/mIoU"] >= 0.25


def test_ade20k_eval_is_exact_on_1_and_2_processes(ade20k, tmp_path):
    one, two = evaluate_on_1_and_2(ADE20K, ade20k, tmp_path)
    assert ADE20K.val_size % 2 == 1
    assert one["val/samples"] == two["val/samples"] == ADE20K.val_size
    assert one["val/pixels"] == two["val/pixels"] > 0
    assert one["val/mIoU"] == two["val/mIoU"]
    assert one["val/pixel_acc"] == two["val/pixel_acc"]
    assert one["val/loss"] == pytest.approx(two["val/loss"], rel=1e-6)  # pixel-weighted: independent of batching
    assert one["val/mIoU"] == records(ade20k.run)[1][-1]["val/mIoU"]
