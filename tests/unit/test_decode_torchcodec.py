"""Decoding on TorchCodec (issue 31): the pixels torchvision.io gave, for the generated sets and hand-made files.

The old path is called here on purpose, as the reference: ``torchvision.io.decode_image(read_file(p), RGB)``
is what :func:`~gputrain.data.images.read_image_rgb` returned before issue 31. Where TorchCodec differs on
purpose (it applies the EXIF orientation), the expected pixels are the old ones turned as the EXIF spec says.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch import Tensor
from torchcodec.encoders import JpegEncoder, PngEncoder

from gputrain.data.device_decode import EncodedImage, decode_batch, read_encoded
from gputrain.data.images import DECODABLE_SUFFIXES, DataError, image_size, read_image_rgb, read_mask
from gputrain.tools.make_data import make_dataset


def _old(call: Callable[[], Tensor]) -> Tensor:
    with warnings.catch_warnings():  # torchvision 0.29's deprecation of its own decoders: expected here
        warnings.simplefilter("ignore", DeprecationWarning)
        return call()


def old_decode(path: Path) -> Tensor:
    from torchvision.io import ImageReadMode, decode_image, read_file

    return _old(lambda: decode_image(read_file(str(path)), mode=ImageReadMode.RGB))


def assert_same_pixels(path: Path) -> None:
    old, new = old_decode(path), read_image_rgb(path)
    assert old.dtype == new.dtype and old.shape == new.shape, path
    assert torch.equal(old, new), path


@pytest.mark.parametrize("kind", ["imagefolder", "classfolder", "ade20k", "coco"])
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools vs numpy 2
def test_generated_sets_decode_to_the_pixels_torchvision_gave(kind: str, tmp_path: Path) -> None:
    if kind == "coco":
        pytest.importorskip("pycocotools")
    root = make_dataset(kind, tmp_path / kind, count=40, size=48, seed=1)
    files = sorted(p for p in root.rglob("*") if p.suffix in DECODABLE_SUFFIXES and "annotations" not in p.parts)
    assert {p.suffix for p in files} == ({".jpg"} if kind in ("ade20k", "coco") else {".jpg", ".png"})
    for path in files:
        assert_same_pixels(path)


def _save(folder: Path, name: str, image: Image.Image, **kw: object) -> Path:
    path = folder / name
    image.save(path, **kw)
    return path


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hand_made")
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    rgba = np.array(rgb.convert("RGBA"))
    rgba[..., 3] = rng.integers(0, 256, (37, 53))  # a real alpha, which RGB decoding must drop, not blend
    palette = rgb.convert("P")
    return {
        "rgb.jpg": _save(folder, "rgb.jpg", rgb, quality=90),
        "progressive.jpg": _save(folder, "progressive.jpg", rgb, quality=90, progressive=True),
        "grey.jpg": _save(folder, "grey.jpg", rgb.convert("L")),
        "cmyk.jpg": _save(folder, "cmyk.jpg", rgb.convert("CMYK")),
        "rgb.png": _save(folder, "rgb.png", rgb),
        "grey.png": _save(folder, "grey.png", rgb.convert("L")),
        "grey_alpha.png": _save(folder, "grey_alpha.png", rgb.convert("LA")),
        "palette.png": _save(folder, "palette.png", palette),
        "palette_transparent.png": _save(folder, "palette_transparent.png", palette, transparency=3),
        "rgba.png": _save(folder, "rgba.png", Image.fromarray(rgba)),
        "16bit.png": _save(folder, "16bit.png", Image.fromarray(rng.integers(0, 65536, (9, 11)).astype(np.uint16))),
        "rgb.gif": _save(folder, "rgb.gif", rgb),
        "rgb.webp": _save(folder, "rgb.webp", rgb, lossless=True),
    }


@pytest.mark.parametrize("name", ["rgb.jpg", "progressive.jpg", "grey.jpg", "cmyk.jpg", "rgb.png", "grey.png",
                                  "grey_alpha.png", "palette.png", "palette_transparent.png", "rgba.png", "16bit.png",
                                  "rgb.gif", "rgb.webp"])
def test_hand_made_files_decode_to_the_pixels_torchvision_gave(hand_made: dict[str, Path], name: str) -> None:
    assert_same_pixels(hand_made[name])
    image = read_image_rgb(hand_made[name])
    assert image.shape[0] == 3 and image.dtype == (torch.uint16 if name == "16bit.png" else torch.uint8)


def test_alpha_is_dropped_and_palettes_are_expanded(hand_made: dict[str, Path]) -> None:
    for name in ("rgba.png", "palette.png", "grey.png"):
        with Image.open(hand_made[name]) as im:
            expected = np.array(im.convert("RGBA"))[..., :3] if name == "rgba.png" else np.array(im.convert("RGB"))
        assert torch.equal(read_image_rgb(hand_made[name]), torch.from_numpy(expected).permute(2, 0, 1)), name


def test_cmyk_jpeg_is_converted_not_refused(hand_made: dict[str, Path]) -> None:
    # TorchCodec converts Adobe CMYK JPEGs (inverted, as Photoshop and PIL write them) as torchvision did; the
    # known answer is PIL's own conversion back to RGB.
    with Image.open(hand_made["cmyk.jpg"]) as im:
        expected = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)
    assert (read_image_rgb(hand_made["cmyk.jpg"]).int() - expected.int()).abs().max() <= 1


#: What EXIF orientation ``o`` does to the stored pixels (EXIF 2.32, tag 0x0112), written out by hand.
ORIENTED = {
    1: lambda x: x,
    2: lambda x: x.flip(-1),  # mirrored left-right
    3: lambda x: x.flip(-1).flip(-2),  # turned 180
    4: lambda x: x.flip(-2),  # mirrored top-bottom
    5: lambda x: x.transpose(-1, -2),  # transposed
    6: lambda x: x.transpose(-1, -2).flip(-1),  # turned 90 clockwise
    7: lambda x: x.transpose(-1, -2).flip(-1).flip(-2),  # transversed
    8: lambda x: x.transpose(-1, -2).flip(-2),  # turned 90 anticlockwise
}


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_where_torchvision_ignored_it(tmp_path: Path, suffix: str, orientation: int) -> None:
    rng = np.random.default_rng(orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = _save(tmp_path, f"o{orientation}{suffix}", Image.fromarray(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)),
                 exif=exif.tobytes())
    stored = old_decode(path)  # torchvision decoded the stored grid, 6 rows by 10 columns
    assert stored.shape == (3, 6, 10)
    image = read_image_rgb(path)
    assert torch.equal(image, ORIENTED[orientation](stored))
    with Image.open(path) as im:  # the picture as a viewer shows it
        assert torch.equal(image, torch.from_numpy(np.array(ImageOps.exif_transpose(im))).permute(2, 0, 1))
    assert image_size(path) == tuple(image.shape[1:])  # header checks see the decoded size


def test_device_decode_cpu_fallback_decodes_as_the_workers(hand_made: dict[str, Path]) -> None:
    names = ("rgb.jpg", "rgb.png", "grey.jpg", "palette.png")
    decoded = decode_batch([read_encoded(str(hand_made[n])) for n in names], torch.device("cpu"))
    for name, pixels in zip(names, decoded, strict=True):
        assert torch.equal(pixels, read_image_rgb(hand_made[name])), name


@pytest.mark.cuda
def test_device_decode_on_cuda_is_nvjpeg_within_a_few_grey_levels(tmp_path: Path) -> None:
    # Smooth pictures: nvJPEG and libjpeg differ in IDCT and chroma upsampling, which noise would magnify.
    ys, xs = np.mgrid[0:40, 0:56]
    smooth = np.stack([xs * 4, ys * 6, (xs + ys) * 2], axis=-1).astype(np.uint8)
    files = [_save(tmp_path, "baseline.jpg", Image.fromarray(smooth), quality=95),
             _save(tmp_path, "progressive.jpg", Image.fromarray(smooth), quality=95, progressive=True),
             _save(tmp_path, "grey.jpg", Image.fromarray(smooth[..., 0])), _save(tmp_path, "a.png", Image.fromarray(smooth))]
    device = torch.device("cuda")
    decoded = decode_batch([read_encoded(str(f)) for f in files], device)
    for path, pixels in zip(files, decoded, strict=True):
        reference = read_image_rgb(path)
        assert pixels.device.type == "cuda" and pixels.dtype == torch.uint8 and pixels.shape == reference.shape, path
        # Measured on an H200 (torch 2.11, TorchCodec 0.17, 2026-11-29): 1.23 grey levels on average for the
        # baseline JPEG, whose chroma nvJPEG upsamples its own way; a wrong colour space or a shifted row is tens.
        assert (pixels.cpu().float() - reference.float()).abs().mean() <= 2.0, path
    cut = EncodedImage(files[0].read_bytes()[:100], "cut.jpg", 0)  # ends inside the quantization tables
    with pytest.raises(DataError, match="image cut.jpg is unreadable"):
        decode_batch([read_encoded(str(files[0])), cut], device)


def test_palette_masks_stay_indices(tmp_path: Path) -> None:
    indices = np.random.default_rng(0).integers(0, 20, (7, 9)).astype(np.uint8)
    mask = Image.fromarray(indices, "L").convert("P")
    mask.putpalette([v for k in range(256) for v in ((k * 37) % 256, (k * 91) % 256, (k * 13) % 256)])
    mask.putdata(indices.flatten().tolist())
    mask.save(tmp_path / "mask.png")
    raw = read_mask(tmp_path / "mask.png")
    assert raw.shape == (7, 9) and torch.equal(raw, torch.from_numpy(indices.astype(np.int64)))


@pytest.mark.parametrize("cut", ["truncated", "header_only", "garbage", "empty", "missing"])
def test_unreadable_files_are_one_line_naming_the_file(hand_made: dict[str, Path], tmp_path: Path, cut: str) -> None:
    good = hand_made["rgb.jpg"].read_bytes()
    data = {"truncated": good[: len(good) // 2], "header_only": good[:20], "garbage": b"not an image" * 9, "empty": b""}
    path = tmp_path / f"{cut}.jpg"
    if cut != "missing":
        path.write_bytes(data[cut])
    with pytest.raises(DataError) as err:
        read_image_rgb(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message and ".cpp:" not in message  # libjpeg's warnings too


@pytest.mark.parametrize("channels", [1, 3])
def test_torchcodec_encoders_write_the_bytes_torchvision_wrote(channels: int) -> None:
    # The generators encode with TorchCodec now; the same bytes as torchvision.io keep every known answer
    # computed on generated sets (checked on the whole `gputrain data make` output when this moved).
    from torchvision.io import encode_jpeg, encode_png

    image = torch.from_numpy(np.random.default_rng(channels).integers(0, 256, (channels, 33, 47), dtype=np.uint8))
    for quality in (90, 92, 95):
        old = _old(lambda q=quality: encode_jpeg(image, quality=q))  # type: ignore[misc]
        assert bytes(JpegEncoder(image).to_tensor(quality=quality).numpy()) == bytes(old.numpy())
    assert bytes(PngEncoder(image).to_tensor().numpy()) == bytes(_old(lambda: encode_png(image)).numpy())
