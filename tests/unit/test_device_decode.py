"""``data.decode_on_device``: workers read bytes, the device decodes and augments; same batches, same training."""

from __future__ import annotations

import pytest
import torch

from gputrain import Trainer
from gputrain.config import load_config
from gputrain.data.classfolder import make_classfolder
from gputrain.data.device_decode import EncodedImage
from gputrain.data.images import DataError
from gputrain.data.samplers import SeededSamples
from gputrain.tasks import build_task


def _cfg(root, decode_on_device: bool, *extra: str):
    return load_config("imagefolder-resnet50", [
        f"data.root={root}", "data.image_size=32", "model.name=resnet18", f"data.decode_on_device={decode_on_device}",
        "trainer.batch_size=8", "trainer.epochs=1", "trainer.strategy=single", "trainer.progress_bar=false",
        "trainer.loggers=[]", "trainer.enable_checkpointing=false", "trainer.pictures=0", "scheduler.warmup_steps=0",
        *extra])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_classfolder(tmp_path_factory.mktemp("classes"), classes=2, per_class=12, size=48, seed=0)


def test_workers_return_bytes_and_the_seed_of_their_sample(folder):
    spec = build_task(_cfg(folder, True))
    samples = SeededSamples(spec.train_data, seed=0)
    image, label = samples[(0, 3)]
    assert isinstance(image, EncodedImage) and image.data[:2] in (b"\xff\xd8", b"\x89P")  # a JPEG's or PNG's bytes
    assert image.seed == samples[(0, 3)][0].seed != samples[(1, 3)][0].seed  # a function of (seed, epoch, index)
    assert isinstance(label, int)
    assert isinstance(spec.val_data[0][0], torch.Tensor)  # validation decodes in the workers as before


def test_a_batch_decoded_on_the_device_equals_the_one_decoded_in_workers(folder):
    """On a CPU the same decoder and the same per-sample seed: the batches are equal bit for bit (JPEG and PNG)."""
    keys = [(0, i) for i in range(len(build_task(_cfg(folder, False)).train_data))]
    batches = []
    for on_device in (False, True):
        spec = build_task(_cfg(folder, on_device))
        samples = SeededSamples(spec.train_data, seed=0)
        batch = spec.task.collate_fn()([samples[k] for k in keys]) if spec.task.collate_fn() else None
        if on_device:
            images, labels = batch
            images = images.to_device(torch.device("cpu"))
        else:
            images = torch.stack([samples[k][0] for k in keys])
            labels = torch.tensor([samples[k][1] for k in keys])
        batches.append((images, labels))
    (a, la), (b, lb) = batches
    assert a.shape == b.shape == (len(keys), 3, 32, 32) and torch.equal(la, lb)
    assert torch.equal(a, b)


def test_training_with_images_decoded_on_the_device_is_bit_for_bit_the_usual_run(folder, tmp_path):
    weights = []
    for on_device, workers in ((False, 0), (True, 0), (True, 2)):  # with workers, the bytes cross processes
        cfg = _cfg(folder, on_device, f"trainer.out={tmp_path / f'{on_device}{workers}'}", f"data.num_workers={workers}")
        torch.manual_seed(0)  # the same initial weights
        spec = build_task(cfg)
        trainer = Trainer(cfg)
        trainer.fit(spec.model, spec.train_data, spec.val_data, task=spec.task)
        weights.append(trainer.module.state_dict())
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0])


def test_a_corrupt_jpeg_is_one_line_naming_the_file(folder, tmp_path):
    import shutil

    copy = tmp_path / "classes"
    shutil.copytree(folder, copy)
    bad = sorted(copy.glob("*/*.jpg"))[0]
    bad.write_bytes(bad.read_bytes()[:200])  # truncated mid-scan, as an interrupted copy leaves it
    spec = build_task(_cfg(copy, True))
    index = [p for p, _ in spec.train_data.dataset.samples].index(str(bad))
    collate = spec.task.collate_fn()
    with pytest.raises(DataError, match=f"image {bad} is unreadable, truncated or corrupt"):
        collate([spec.train_data.dataset[index]])[0].to_device(torch.device("cpu"))


def test_decoding_on_the_device_is_refused_for_data_it_does_not_read(tmp_path):
    with pytest.raises(ValueError, match="data.decode_on_device=true decodes class-folder images"):
        load_config("autoencoder", [f"data.root={tmp_path}", "data.decode_on_device=true"])
