"""Image-folder classification, image decoding errors and the seeded split."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from gputrain.data.classfolder import (
    ClassFolder,
    classification_transform,
    make_classfolder,
    split_classfolder,
)
from gputrain.data.images import DataError, read_image_rgb, read_mask, seeded_split


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_classfolder(tmp_path_factory.mktemp("clf") / "set", classes=3, per_class=4, size=32, seed=0)


@pytest.fixture
def copy(generated: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(generated, tmp_path / "set"))


def test_loads_generated_folder(generated: Path) -> None:
    ds = ClassFolder(generated)
    assert len(ds) == 12 and ds.classes == ["circle", "square", "triangle"]
    assert {Path(p).suffix for p, _ in ds.samples} == {".jpg", ".png"}
    image, label = ds[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 0
    assert ClassFolder(generated, transform=None)[0][0].dtype == torch.uint8
    resized = ClassFolder(generated, transform=classification_transform(24, train=True))
    assert resized[5][0].shape == (3, 24, 24)


def test_classes_differ_in_colour(generated: Path) -> None:
    # Learnable at a glance: the mean colour of the brightest pixels separates the classes.
    ds = ClassFolder(generated, transform=None)
    means: dict[int, list[torch.Tensor]] = {}
    for image, label in ds:
        bright = image.float().flatten(1)[:, image.amax(0).flatten() > 180]  # object pixels, not background
        means.setdefault(label, []).append(bright.mean(1))
    centres = torch.stack([torch.stack(v).mean(0) for v in means.values()])
    assert torch.cdist(centres, centres).fill_diagonal_(1e9).min() > 50


def test_truncated_jpeg_error_names_path(copy: Path) -> None:
    ds = ClassFolder(copy)
    index = next(i for i, (p, _) in enumerate(ds.samples) if p.endswith(".jpg"))
    path = Path(ds.samples[index][0])
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match="remove the file or re-export it") as err:
        ds[index]
    assert str(path) in str(err.value) and "truncated" in str(err.value)


def test_garbage_and_empty_files_name_path(tmp_path: Path) -> None:
    bad, empty = tmp_path / "bad.png", tmp_path / "empty.jpg"
    bad.write_bytes(b"this is not an image")
    empty.write_bytes(b"")
    for path in (bad, empty, tmp_path / "missing.jpg"):
        with pytest.raises(DataError, match=str(path)):
            read_image_rgb(path)


def test_undecodable_suffix_is_reported_not_skipped(copy: Path) -> None:
    Image.new("RGB", (8, 8)).save(copy / "circle" / "extra.bmp")
    with pytest.raises(DataError, match=r"extra\.bmp.*convert"):
        ClassFolder(copy)


def test_empty_class_folder(copy: Path) -> None:
    (copy / "hexagon").mkdir()
    with pytest.raises(DataError, match="hexagon"):
        ClassFolder(copy)


def test_read_mask_rejects_rgb_and_truncation(tmp_path: Path) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "rgb.png")
    with pytest.raises(DataError, match=r"rgb\.png.*one channel"):
        read_mask(tmp_path / "rgb.png")
    Image.new("L", (64, 64), 3).save(tmp_path / "ok.png")
    assert read_mask(tmp_path / "ok.png").dtype == torch.int64
    (tmp_path / "cut.png").write_bytes((tmp_path / "ok.png").read_bytes()[:40])
    with pytest.raises(DataError, match=r"cut\.png"):
        read_mask(tmp_path / "cut.png")


def test_seeded_split_is_deterministic_disjoint_and_complete() -> None:
    train, val = seeded_split(50, 0.2, seed=3)
    assert (train, val) == seeded_split(50, 0.2, seed=3)
    assert len(val) == 10 and len(train) == 40
    assert sorted(train + val) == list(range(50)) and not set(train) & set(val)
    assert seeded_split(50, 0.2, seed=4) != (train, val)
    assert seeded_split(5, 0.01, seed=0)[1] != []  # a positive fraction always validates something
    assert seeded_split(5, 0.0, seed=0) == ([0, 1, 2, 3, 4], [])
    with pytest.raises(ValueError, match="val_fraction"):
        seeded_split(5, 1.0, seed=0)


def test_split_classfolder_uses_separate_transforms(generated: Path) -> None:
    train, val = split_classfolder(generated, val_fraction=0.25, seed=0, val_transform=None)
    assert len(train) == 9 and len(val) == 3
    assert not set(train.indices) & set(val.indices)
    assert train[0][0].dtype == torch.float32 and val[0][0].dtype == torch.uint8
