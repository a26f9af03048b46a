"""16-bit PNGs on every loader: floats in [0, 1] (``x / 65535``), or ``uint8`` (``round(x / 257)``) where the device
makes them float (data.normalize_on_device); 8-bit images keep their exact tensors; 16-bit masks keep their ids.

Each set is made by its generator, then one picture is rewritten as a 16-bit PNG of the same picture: ``v * 257``
plus noise of at most 64 (so ``round(x / 257)`` gives ``v`` back and ``x / 65535`` is within 1/255 of ``v / 255``).
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch import Tensor

from gputrain.data.ade20k import ADE20K, make_ade20k, reduce_zero_label, segmentation_transform
from gputrain.data.classfolder import ClassFolder, classification_transform, make_classfolder
from gputrain.data.coco import COCODetection, detection_collate
from gputrain.data.coco_sample import make_coco
from gputrain.data.device_normalize import PixelBatch, PixelCollate
from gputrain.data.imagefolder import ImageFiles, list_images, make_frames
from gputrain.data.images import IMAGENET_MEAN, IMAGENET_STD, read_image_rgb, read_mask
from gputrain.tasks import autoencoder, detection

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools

CPU = torch.device("cpu")
S = 16
TOL = 1 / 255 + 1e-5
MEAN, STD = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)


def _write_png16(path: Path, pixels: Tensor) -> None:
    """``(3, H, W)`` ``uint16`` as a 16-bit RGB PNG (torchvision's and TorchCodec's encoders write 8 bits only)."""
    _, h, w = pixels.shape
    rows = pixels.permute(1, 2, 0).numpy().astype(">u2").reshape(h, w * 3)
    raw = b"".join(b"\0" + row.tobytes() for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))
                     + chunk(b"IEND", b""))


def _deepen(src: Path, dst: Path) -> Tensor:
    """Write ``dst`` as a 16-bit PNG of ``src``'s picture; returns that picture as decoded from ``src`` (8-bit)."""
    p8 = read_image_rgb(src)
    noise = torch.randint(-64, 65, p8.shape, generator=torch.Generator().manual_seed(0))
    _write_png16(dst, (p8.to(torch.int32) * 257 + noise).clamp(0, 65535).to(torch.uint16))
    assert read_image_rgb(dst).dtype == torch.uint16
    return p8


def _unit(x: Tensor, p8: Tensor, tol: float = TOL) -> None:
    """``x`` is float32 in [0, 1] and the 8-bit picture ``p8`` within ``tol``."""
    assert x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1
    assert (x - p8.float() / 255).abs().max() <= tol


def _unnormalized(x: Tensor) -> Tensor:
    return (x * STD + MEAN).clamp(0, 1)  # clamp: the float error of undoing the normalization


def _old_unit(p8: Tensor) -> Tensor:
    return p8.to(torch.float32) / 255  # what COCO and image folders always gave


def _old_normalized(p8: Tensor) -> Tensor:
    return TF.normalize(TF.to_dtype(p8, torch.float32, scale=True), list(IMAGENET_MEAN), list(IMAGENET_STD))


def _batch_check(batch: object, floats: list[Tensor], p8: Tensor, *, normalized: bool) -> None:
    """The uint8 batch of ``[16-bit sample, 8-bit sample]`` made float: within 1/255, and bit for bit."""
    assert isinstance(batch, PixelBatch)
    pixels = batch.pixels if isinstance(batch.pixels, list) else list(batch.pixels)
    assert all(p.dtype == torch.uint8 for p in pixels)
    made = list(batch.to_device(CPU))
    _unit(_unnormalized(made[0]) if normalized else made[0], p8, TOL + 1e-5)
    assert torch.equal(made[1], floats[1])


def test_class_folder(tmp_path: Path) -> None:
    root = make_classfolder(tmp_path / "set", classes=2, per_class=4, size=S, seed=0)
    deep, flat = sorted(root.rglob("*.png"))
    p8 = _deepen(deep, deep)
    ds = ClassFolder(root, transform=classification_transform(S, train=False))
    i16, i8 = (next(i for i, (p, _) in enumerate(ds.samples) if Path(p) == f) for f in (deep, flat))
    floats = [ds[i16][0], ds[i8][0]]
    _unit(_unnormalized(floats[0]), p8, TOL + 1e-5)
    expected8 = _old_normalized(torch.from_numpy(np.array(Image.open(flat).convert("RGB"))).permute(2, 0, 1))
    assert torch.equal(floats[1], expected8)

    ds8 = ClassFolder(root, transform=classification_transform(S, train=False, normalize=False))
    assert torch.equal(ds8[i16][0], p8) and torch.equal(ds8[i8][0], read_image_rgb(flat))
    batch, labels = PixelCollate(IMAGENET_MEAN, IMAGENET_STD)([ds8[i16], ds8[i8]])
    _batch_check(batch, floats, p8, normalized=True)


def test_coco(tmp_path: Path) -> None:
    root = make_coco(tmp_path / "coco", num_images=3, size=32, seed=0)
    ann = root / "annotations" / "instances.json"
    data = json.loads(ann.read_text())
    first, second = sorted(data["images"], key=lambda im: im["id"])[:2]
    src = root / "images" / first["file_name"]
    p8 = _deepen(src, src.with_suffix(".png"))
    first["file_name"] = src.with_suffix(".png").name
    ann.write_text(json.dumps(data))
    flat = read_image_rgb(root / "images" / second["file_name"])

    ds = COCODetection(root / "images", ann, train=False)
    floats = [ds[0][0], ds[1][0]]
    _unit(floats[0], p8)
    assert torch.equal(floats[1], _old_unit(flat))

    ds8 = COCODetection(root / "images", ann, train=False, uint8=True)
    assert torch.equal(ds8[0][0], p8) and torch.equal(ds8[1][0], flat)
    batch, _ = PixelCollate(collate=detection_collate)([ds8[0], ds8[1]])
    _batch_check(batch, floats, p8, normalized=False)


def test_image_folder_frames(tmp_path: Path) -> None:
    root = make_frames(tmp_path / "frames", count=8, size=S, videos=1, seed=0)
    files = list_images(root)
    deep, flat = (f for f in files if f.suffix == ".png")
    p8 = _deepen(deep, deep)
    i16, i8 = files.index(deep), files.index(flat)

    ds = ImageFiles(files)
    floats = [ds[i16], ds[i8]]
    _unit(floats[0], p8)
    expected8 = _old_unit(torch.from_numpy(np.array(Image.open(flat).convert("RGB"))).permute(2, 0, 1))
    assert torch.equal(floats[1], expected8)

    ds8 = ImageFiles(files, uint8=True)
    assert torch.equal(ds8[i16], p8) and torch.equal(ds8[i8], read_image_rgb(flat))
    _batch_check(PixelCollate()([ds8[i16], ds8[i8]]), floats, p8, normalized=False)

    # resized (data.image_size): the 16-bit picture resized, then scaled, agrees with the 8-bit one resized
    small8 = TF.resize(p8.float(), [12, 12], antialias=True)  # in floats: uint8 resizing rounds on its own
    _unit(ImageFiles(files, 12)[i16], small8)
    small = ImageFiles(files, 12, uint8=True)[i16]
    assert small.dtype == torch.uint8 and (small.float() - small8).abs().max() <= 1


def test_ade20k_images_and_16_bit_masks(tmp_path: Path) -> None:
    root = make_ade20k(tmp_path / "ade", num_classes=5, train=2, val=1, size=S, seed=0)
    images, masks = root / "images" / "training", root / "annotations" / "training"
    src = images / "ADE_train_00000001.jpg"
    p8 = _deepen(src, src.with_suffix(".png"))
    src.unlink()
    mask = masks / "ADE_train_00000001.png"
    ids = read_mask(mask)
    Image.fromarray(ids.numpy().astype(np.uint16)).save(mask)
    assert Image.open(mask).mode == "I;16" and torch.equal(read_mask(mask), ids)
    flat = read_image_rgb(images / "ADE_train_00000002.jpg")

    ds = ADE20K(root, num_classes=5)
    (deep_image, deep_mask), (flat_image, _) = ds[0], ds[1]
    _unit(_unnormalized(deep_image), p8, TOL + 1e-5)
    assert torch.equal(flat_image, _old_normalized(flat))
    assert deep_mask.dtype == torch.int64 and torch.equal(deep_mask, reduce_zero_label(ids).long())  # ids, unscaled

    ds8 = ADE20K(root, num_classes=5, transform=segmentation_transform(None, train=False, normalize=False))
    assert torch.equal(ds8[0][0], p8) and torch.equal(ds8[1][0], flat) and torch.equal(ds8[0][1], deep_mask)
    batch, batch_masks = PixelCollate(IMAGENET_MEAN, IMAGENET_STD)([ds8[0], ds8[1]])
    _batch_check(batch, [deep_image, flat_image], p8, normalized=True)
    assert torch.equal(batch_masks[0], deep_mask)


def test_predict_preprocessing_of_autoencoder_and_detection(tmp_path: Path) -> None:
    src = tmp_path / "a.png"
    p8 = torch.randint(0, 256, (3, S, S), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    Image.fromarray(p8.permute(1, 2, 0).numpy()).save(src)
    deep = tmp_path / "b.png"
    _deepen(src, deep)
    cfg = SimpleNamespace(data=SimpleNamespace(image_size=0))
    for preprocess in (detection.eval_preprocess, autoencoder.eval_preprocess(cfg)):  # type: ignore[arg-type]
        _unit(preprocess(read_image_rgb(deep)), p8)
        assert torch.equal(preprocess(p8), _old_unit(p8))
