"""``data.normalize_on_device``: workers hand over uint8 images, the device normalizes; the same values bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from gputrain import Trainer
from gputrain.config import load_config
from gputrain.data.cifar10 import make_cifar10
from gputrain.data.classfolder import make_classfolder
from gputrain.data.device_normalize import PixelBatch
from gputrain.data.samplers import SeededSamples
from gputrain.tasks import build_task

CPU = torch.device("cpu")


def _cfg(root, normalize_on_device, *extra: str, recipe: str = "imagefolder-resnet50"):
    return load_config(recipe, [
        f"data.root={root}", "model.name=resnet18", f"data.normalize_on_device={normalize_on_device}",
        "trainer.batch_size=8", "trainer.epochs=1", "trainer.strategy=single", "trainer.progress_bar=false",
        "trainer.loggers=[]", "trainer.enable_checkpointing=false", "trainer.pictures=0", "scheduler.warmup_steps=0",
        *(["data.image_size=32"] if recipe == "imagefolder-resnet50" else ["model.kwargs={cifar_stem: true}"]),
        *extra])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_classfolder(tmp_path_factory.mktemp("classes"), classes=2, per_class=12, size=48, seed=0)


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    return make_cifar10(tmp_path_factory.mktemp("cifar") / "set", train_per_class=2, test_per_class=1, seed=0)


def _first_batch(cfg):
    spec = build_task(cfg)
    samples = SeededSamples(spec.train_data, seed=0)
    batch = [samples[(0, i)] for i in range(len(spec.train_data))]
    collate = spec.task.collate_fn() or default_collate
    return spec, collate(batch)


@pytest.mark.parametrize("recipe", ["imagefolder-resnet50", "cifar10-resnet18"])
def test_a_batch_normalized_on_the_device_equals_the_one_normalized_in_workers(folder, cifar, recipe):
    root = folder if recipe == "imagefolder-resnet50" else cifar
    _, (usual, labels) = _first_batch(_cfg(root, False, recipe=recipe))
    spec, (pixels, same_labels) = _first_batch(_cfg(root, True, recipe=recipe))
    assert spec.task.normalizes_on_device
    assert isinstance(pixels, PixelBatch) and pixels.pixels.dtype == torch.uint8 and len(pixels) == len(usual)
    assert pixels.pixels.nbytes * 4 == usual.nbytes  # what crosses from a worker: a quarter of the float batch
    on_device = pixels.to_device(CPU)
    assert on_device.dtype == torch.float32 and torch.equal(on_device, usual) and torch.equal(labels, same_labels)
    assert spec.val_data[0][0].dtype == torch.float32  # validation is normalized in the workers, as before


def test_uint8_batches_cross_from_worker_processes(folder):
    spec = build_task(_cfg(folder, True))
    loader = DataLoader(SeededSamples(spec.train_data, seed=0), batch_size=4, num_workers=1,
                        collate_fn=spec.task.collate_fn(), sampler=[(0, i) for i in range(4)])
    pixels, labels = next(iter(loader))
    assert isinstance(pixels, PixelBatch) and pixels.pixels.dtype == torch.uint8
    assert pixels.pixels.shape == (4, 3, 32, 32) and labels.shape == (4,)


def test_training_with_images_normalized_on_the_device_is_bit_for_bit_the_usual_run(folder, tmp_path, capsys):
    weights, lines = [], []
    for on_device, workers in ((False, 0), (True, 0), (True, 2)):  # with workers, uint8 batches cross processes
        cfg = _cfg(folder, on_device, f"trainer.out={tmp_path / f'{on_device}{workers}'}", f"data.num_workers={workers}")
        torch.manual_seed(0)
        spec = build_task(cfg)
        trainer = Trainer(cfg)
        trainer.fit(spec.model, spec.train_data, spec.val_data, task=spec.task)
        weights.append(trainer.module.state_dict())
        lines.append(capsys.readouterr().out)
        assert trainer.config_dict["data"]["normalize_on_device"] is on_device  # config.yaml says what ran
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0])
    assert "normalize_on_device" not in lines[0] and "+normalize_on_device" in lines[1]


def test_auto_keeps_the_usual_path_on_a_cpu(folder):
    spec, (images, _) = _first_batch(_cfg(folder, "auto", "trainer.accelerator=cpu"))
    assert not spec.task.normalizes_on_device and isinstance(images, torch.Tensor) and images.dtype == torch.float32
    # trainer.accelerator=auto: on exactly where the run will train on a GPU
    assert build_task(_cfg(folder, "auto")).task.normalizes_on_device is torch.cuda.is_available()


def test_decoding_on_the_device_takes_precedence(folder):
    from gputrain.data.device_decode import EncodedBatch

    spec, (images, _) = _first_batch(_cfg(folder, True, "data.decode_on_device=true"))
    assert isinstance(images, EncodedBatch) and not spec.task.normalizes_on_device


def test_a_value_other_than_auto_true_or_false_is_one_line(folder):
    with pytest.raises(ValueError, match="data.normalize_on_device='gpu' must be auto, true or false"):
        _cfg(folder, "gpu")
