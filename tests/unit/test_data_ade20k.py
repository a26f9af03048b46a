"""ADE20K-layout segmentation: label mapping, joint transforms, and the errors of broken pairs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torchcodec.encoders import JpegEncoder, PngEncoder

from gputrain.data.ade20k import ADE20K, IGNORE_INDEX, make_ade20k, segmentation_transform
from gputrain.data.images import IMAGENET_MEAN, IMAGENET_STD, DataError, read_mask


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ade20k(tmp_path_factory.mktemp("ade") / "set", num_classes=5, train=6, val=3, size=32, seed=0)


@pytest.fixture
def copy(generated: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(generated, tmp_path / "set"))


def test_loads_and_maps_labels(generated: Path) -> None:
    ds = ADE20K(generated, split="training", num_classes=5)
    assert len(ds) == 6 and len(ADE20K(generated, split="validation", num_classes=5)) == 3
    seen: set[int] = set()
    for i in range(len(ds)):
        image, mask = ds[i]
        assert image.shape == (3, 32, 32) and image.dtype == torch.float32
        assert mask.shape == (32, 32) and mask.dtype == torch.int64 and type(mask) is torch.Tensor
        raw = read_mask(ds.samples[i][1])
        assert torch.equal(mask, torch.where(raw == 0, IGNORE_INDEX, raw - 1))  # 0 -> 255, v -> v - 1
        seen |= set(mask.unique().tolist())
    assert IGNORE_INDEX in seen and seen <= {0, 1, 2, 3, 4, IGNORE_INDEX} and len(seen) >= 3
    ds.validate()


def test_label_above_num_classes_names_file_and_value(copy: Path) -> None:
    mask_path = copy / "annotations" / "training" / "ADE_train_00000002.png"
    raw = read_mask(mask_path)
    raw[0, 0] = 9
    PngEncoder(raw.to(torch.uint8)[None]).to_file(mask_path)
    ds = ADE20K(copy, num_classes=5)
    with pytest.raises(DataError, match=r"ADE_train_00000002\.png has label value 9 .*data\.num_classes"):
        ds[1]
    with pytest.raises(DataError, match="label value 9"):
        ds.validate()
    ADE20K(copy, num_classes=9)[1]  # the fix the message suggests works


def test_mask_size_mismatch_names_both_files(copy: Path) -> None:
    mask_path = copy / "annotations" / "training" / "ADE_train_00000003.png"
    PngEncoder(torch.zeros(1, 20, 30, dtype=torch.uint8)).to_file(mask_path)
    ds = ADE20K(copy, num_classes=5)
    with pytest.raises(DataError) as err:
        ds[2]
    message = str(err.value)
    assert str(mask_path) in message and "ADE_train_00000003.jpg" in message
    assert "30x20" in message and "32x32" in message
    with pytest.raises(DataError, match="30x20"):
        ds.validate()


def test_missing_annotation_names_image(copy: Path) -> None:
    (copy / "annotations" / "validation" / "ADE_val_00000002.png").unlink()
    with pytest.raises(DataError, match=r"ADE_val_00000002\.jpg needs .*ADE_val_00000002\.png"):
        ADE20K(copy, split="validation", num_classes=5)


def test_bad_split_and_missing_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="split"):
        ADE20K(tmp_path, split="train")
    with pytest.raises(DataError, match=r"images/training"):
        ADE20K(tmp_path)


def test_train_transform_moves_image_and_mask_together(tmp_path: Path) -> None:
    # A grey image (JPEG keeps luminance sharp) whose brightness encodes its label in large blocks:
    # after random scale/crop/flip the two must still agree wherever the mask is not padding.
    root = tmp_path / "blocks"
    (root / "images" / "training").mkdir(parents=True)
    (root / "annotations" / "training").mkdir(parents=True)
    blocks = torch.arange(4).repeat_interleave(16)
    stored = (blocks[None, :] + 3 * blocks[:, None]) % 6  # 0..5, asymmetric left-right
    image = (stored * 40).to(torch.uint8).expand(3, -1, -1).contiguous()
    JpegEncoder(image).to_file(root / "images" / "training" / "a.jpg", quality=100)
    PngEncoder(stored.to(torch.uint8)[None]).to_file(root / "annotations" / "training" / "a.png")
    torch.manual_seed(0)
    ds = ADE20K(root, num_classes=5, transform=segmentation_transform(40, train=True, scale=(0.8, 1.5)))
    for _ in range(6):
        x, mask = ds[0]
        assert x.shape == (3, 40, 40) and mask.shape == (40, 40) and mask.dtype == torch.int64
        red = (x[0] * IMAGENET_STD[0] + IMAGENET_MEAN[0]) * 255
        label_from_red = torch.where((red / 40).round() == 0, IGNORE_INDEX, (red / 40).round().long() - 1)
        # Compare away from label edges, where resampling the image blends neighbouring blocks.
        m = mask[None, None].float()
        interior = (
            torch.nn.functional.max_pool2d(m, 5, 1, 2) == -torch.nn.functional.max_pool2d(-m, 5, 1, 2)
        )[0, 0]
        valid = (mask != IGNORE_INDEX) & interior
        agree = (label_from_red[valid] == mask[valid]).float().mean().item()
        assert valid.sum() > 100 and agree > 0.98, agree
    eval_ds = ADE20K(root, num_classes=5, transform=segmentation_transform(24, train=False))
    x, mask = eval_ds[0]
    assert x.shape == (3, 24, 24) and mask.shape == (24, 24)
