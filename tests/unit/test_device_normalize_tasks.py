"""``data.normalize_on_device`` for segmentation, the autoencoder and detection: uint8 from the workers, the same bits.

Classification's side is in ``test_device_normalize.py``. Each task's batch made float on the device must equal
the batch its workers make (``torch.equal``), and a run with it must train the same weights as a run without.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from gputrain import Trainer
from gputrain.config import load_config
from gputrain.data.ade20k import make_ade20k
from gputrain.data.coco_sample import make_coco
from gputrain.data.device_normalize import PixelBatch
from gputrain.data.imagefolder import make_frames
from gputrain.data.samplers import SeededSamples
from gputrain.strategies.base import move_to_device
from gputrain.tasks import build_task

CPU = torch.device("cpu")
QUIET = ("trainer.epochs=1", "trainer.strategy=single", "trainer.progress_bar=false", "trainer.loggers=[]",
         "trainer.enable_checkpointing=false", "trainer.pictures=0", "trainer.precision=32", "scheduler.warmup_steps=0")
SMALL = {
    "ade20k-deeplabv3plus": ("data.num_classes=5", "data.image_size=32", "model.kwargs.backbone=resnet18",
                             "trainer.sync_batchnorm=false", "trainer.batch_size=4"),
    "autoencoder": ("data.image_size=40", "trainer.batch_size=4"),  # the autoencoder pools by 20
    "coco-maskrcnn": ("model.kwargs={backbone: resnet18, min_size: 64, max_size: 64}", "trainer.batch_size=2",
                      "trainer.grad_clip_norm=0", "scheduler.name=constant", "optim.lr=0.01"),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("sets")
    return {"ade20k-deeplabv3plus": make_ade20k(base / "ade", num_classes=5, train=6, val=2, size=40, seed=0),
            "autoencoder": make_frames(base / "frames", count=8, size=40, videos=2, seed=0),
            "coco-maskrcnn": make_coco(base / "coco", num_images=8, size=64, seed=0)}


def _cfg(roots, recipe, on_device, *extra):
    return load_config(recipe, [f"data.root={roots[recipe]}", f"data.normalize_on_device={on_device}", *QUIET,
                                *SMALL[recipe], *extra])


def _batch(cfg, count=4):
    spec = build_task(cfg)
    samples = SeededSamples(spec.train_data, seed=0)
    collate = spec.task.collate_fn() or default_collate
    return spec, collate([samples[(0, i)] for i in range(count)])


def test_segmentation_images_made_float_on_the_device_equal_the_workers_and_masks_are_unchanged(roots):
    _, (usual, masks) = _batch(_cfg(roots, "ade20k-deeplabv3plus", False))
    spec, (pixels, same_masks) = _batch(_cfg(roots, "ade20k-deeplabv3plus", True))
    assert spec.task.normalizes_on_device and isinstance(pixels, PixelBatch) and pixels.pixels.dtype == torch.uint8
    assert pixels.pixels.nbytes * 4 == usual.nbytes  # what crosses from a worker: a quarter of the float batch
    assert torch.equal(pixels.to_device(CPU), usual)  # the random scale, crop and flip too: the same seeds
    assert same_masks.dtype == torch.int64 and torch.equal(masks, same_masks)
    assert spec.val_data[0][0].dtype == torch.float32  # validation is made float in the workers, as before


def test_the_autoencoders_one_uint8_batch_is_both_its_inputs_and_its_targets(roots):
    _, usual = _batch(_cfg(roots, "autoencoder", False))
    spec, pixels = _batch(_cfg(roots, "autoencoder", True))
    assert spec.task.normalizes_on_device and isinstance(pixels, PixelBatch) and pixels.pixels.dtype == torch.uint8
    inputs, targets = spec.task.split_batch(pixels)
    inputs, targets = move_to_device(inputs, CPU), move_to_device(targets, CPU)  # as the training loop moves them
    assert inputs is targets and torch.equal(inputs, usual)  # one conversion serves both
    assert spec.val_data[0].dtype == torch.float32 and spec.example_input.dtype == torch.float32


def test_detection_images_are_divided_by_255_on_the_device_as_in_the_workers(roots):
    _, (usual, targets) = _batch(_cfg(roots, "coco-maskrcnn", False))
    spec, (pixels, same_targets) = _batch(_cfg(roots, "coco-maskrcnn", True))
    assert spec.task.normalizes_on_device and isinstance(pixels, PixelBatch) and len(pixels) == len(usual) == 4
    assert all(p.dtype == torch.uint8 for p in pixels.pixels)
    made = pixels.to_device(CPU)  # a list: the model batches images of different sizes itself
    assert isinstance(made, list) and all(torch.equal(a, b) for a, b in zip(made, usual, strict=True))
    for a, b in zip(targets, same_targets, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor)
                                            else a[k] == b[k] for k in a)


@pytest.mark.parametrize("recipe", ["coco-maskrcnn", "autoencoder"])
def test_uint8_batches_of_lists_and_lone_images_cross_from_worker_processes(roots, recipe):
    spec = build_task(_cfg(roots, recipe, True))
    loader = DataLoader(SeededSamples(spec.train_data, seed=0), batch_size=2, num_workers=1,
                        collate_fn=spec.task.collate_fn(), sampler=[(0, i) for i in range(2)])
    batch = next(iter(loader))
    pixels = batch[0] if recipe == "coco-maskrcnn" else batch
    assert isinstance(pixels, PixelBatch) and len(pixels) == 2
    _, usual = _batch(_cfg(roots, recipe, False), count=2)
    made, usual = pixels.to_device(CPU), usual[0] if recipe == "coco-maskrcnn" else usual
    assert all(torch.equal(a, b) for a, b in zip(made, usual, strict=True))


def _train(roots, recipe, on_device, out, *extra):
    cfg = _cfg(roots, recipe, on_device, f"trainer.out={out}", "trainer.max_steps_per_epoch=2", *extra)
    trainer = Trainer(cfg)
    trainer.prepare(for_training=True)  # the run folder first, as gputrain train does: COCO writes its split there
    torch.manual_seed(0)
    spec = build_task(cfg)
    trainer.fit(spec.model, spec.train_data, spec.val_data, task=spec.task)
    assert trainer.config_dict["data"]["normalize_on_device"] is on_device  # config.yaml says what ran
    return {k: v.clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.parametrize("recipe", ["ade20k-deeplabv3plus", "coco-maskrcnn", "autoencoder"])
def test_training_with_uint8_batches_gives_the_weights_of_the_usual_run(roots, recipe, tmp_path):
    usual = _train(roots, recipe, False, tmp_path / "usual")
    runs = [(True, 0)] + ([(True, 2)] if recipe == "ade20k-deeplabv3plus" else [])  # 2: across worker processes
    for on_device, workers in runs:
        weights = _train(roots, recipe, on_device, tmp_path / f"on{workers}", f"data.num_workers={workers}")
        assert weights.keys() == usual.keys() and all(torch.equal(usual[k], weights[k]) for k in usual), recipe
    start = build_task(_cfg(roots, recipe, False)).model.state_dict()  # the weights moved: the test means something
    assert any(not torch.equal(start[k], usual[k]) for k in usual if usual[k].is_floating_point())


@pytest.mark.parametrize("recipe", ["ade20k-deeplabv3plus", "coco-maskrcnn", "autoencoder"])
def test_auto_keeps_the_usual_path_on_a_cpu(roots, recipe):
    assert not build_task(_cfg(roots, recipe, "auto", "trainer.accelerator=cpu")).task.normalizes_on_device


def test_a_task_of_your_own_refuses_true_in_one_line(roots):
    from gputrain.tasks import TASKS

    assert all(task.uint8_batches for task in TASKS.values())  # every built-in task takes part
    mine = load_config("autoencoder", ["task=mypkg.tasks:build", "data.normalize_on_device=true"])
    with pytest.raises(ValueError, match=r"^data.normalize_on_device=true changes the batches of the built-in tasks "
                                         r".*task mypkg.tasks:build makes its own; set data.normalize_on_device=auto"):
        build_task(mine)  # before its module is imported (the launcher checks the same in preflight)
    assert load_config("autoencoder", ["task=mypkg.tasks:build", "data.normalize_on_device=auto"])
