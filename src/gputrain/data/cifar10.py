"""CIFAR-10 from its python-pickle batch files, checksummed before anything is unpickled.

Unpickling runs code chosen by whoever wrote the file, so every file is first checked against a known
md5 — the published sums (read from ``torchvision.datasets.CIFAR10``, not retyped here) or, for a set
made by :func:`make_cifar10`, the ``MANIFEST.md5`` the generator wrote next to it. Only after *all*
files of the split and the meta file matched is any of them unpickled, and then with an unpickler
that can only build the dicts, lists and numpy arrays the format consists of.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torchvision
from torch import Tensor
from torch.utils.data import Dataset

from gputrain.data.images import DataError, PathLike, draw_class_image, normalize_transform

_TV = torchvision.datasets.CIFAR10
TRAIN_FILES: tuple[str, ...] = tuple(name for name, _ in _TV.train_list)
TEST_FILES: tuple[str, ...] = tuple(name for name, _ in _TV.test_list)
META_FILE: str = _TV.meta["filename"]
MANIFEST = "MANIFEST.md5"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
LABEL_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

Verify = Literal["auto", "published", "manifest"]
Transform = Callable[[Tensor], Any]


def published_md5s() -> dict[str, str]:
    """File name → md5 of the official ``cifar-10-batches-py`` files, as torchvision publishes them."""
    sums = {name: md5 for name, md5 in (*_TV.train_list, *_TV.test_list)}
    sums[_TV.meta["filename"]] = _TV.meta["md5"]
    return sums


def file_md5(path: Path) -> str:
    """Hex md5 of a file, read in chunks so a 30 MB batch is never held twice."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> dict[str, str]:
    """Parse a manifest in ``md5sum`` format (``<md5>  <file name>`` a line) into file name → md5."""
    sums: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or len(parts[0]) != 32:
            raise DataError(
                f"{path}:{lineno} is not '<md5>  <file name>'; regenerate the set with make_cifar10"
            )
        sums[parts[1].strip().lstrip("*")] = parts[0].lower()
    return sums


def verify_files(folder: Path, names: tuple[str, ...], verify: Verify = "auto") -> str:
    """Check that every file in ``names`` exists in ``folder`` and matches its md5; return the source used.

    ``verify="auto"`` uses ``MANIFEST.md5`` when the folder has one and the published sums otherwise.
    Raises :class:`DataError` naming the first missing or mismatching file.
    """
    manifest = folder / MANIFEST
    if verify == "auto":
        verify = "manifest" if manifest.is_file() else "published"
    if verify == "manifest":
        if not manifest.is_file():
            raise DataError(
                f"{manifest} does not exist; use verify='published' for the official files "
                "or regenerate the sample set with make_cifar10"
            )
        expected, source = read_manifest(manifest), str(manifest)
        fix = "regenerate the set with gputrain.data.cifar10.make_cifar10"
    elif verify == "published":
        expected, source = published_md5s(), "the published CIFAR-10 md5 sums"
        fix = (
            "download cifar-10-python.tar.gz again from https://www.cs.toronto.edu/~kriz/cifar.html "
            "(or torchvision.datasets.CIFAR10(download=True)); for a generated set keep its MANIFEST.md5"
        )
    else:
        raise ValueError(f"verify={verify!r}; use 'auto', 'published' or 'manifest'")
    for name in names:  # report every missing file before hashing anything
        if not (folder / name).is_file():
            raise DataError(f"CIFAR-10 file {folder / name} is missing; {fix}")
    for name in names:
        if name not in expected:
            raise DataError(f"{source} has no md5 for {name}; {fix}")
        got = file_md5(folder / name)
        if got != expected[name]:
            raise DataError(
                f"{folder / name} has md5 {got} but {source} expects {expected[name]}: the file is "
                f"corrupt or not the one named; it was not unpickled; {fix}"
            )
    return source


class _FormatUnpickler(pickle.Unpickler):
    """Builds only what CIFAR batches contain: containers, bytes/str, and numpy arrays."""

    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # protocol-2 pickles written by Python 3 encode bytes this way
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of the CIFAR format")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict[str, Any]:
    """Unpickle a verified batch file; keys are normalised to ``str`` (real files load with either)."""
    try:
        with open(path, "rb") as f:  # latin1, as torchvision: the official files are Python 2 pickles
            obj = _FormatUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise DataError(
            f"{path} passed its checksum but is not a CIFAR batch ({e}); regenerate or re-download it"
        ) from e
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not the dict of a CIFAR batch; re-download it")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def batches_folder(root: PathLike) -> Path:
    """The folder holding the batch files: ``root`` itself or its ``cifar-10-batches-py`` child."""
    root = Path(root)
    nested = root / _TV.base_folder
    return nested if nested.is_dir() and not (root / META_FILE).exists() else root


class CIFAR10(Dataset[tuple[Any, int]]):
    """CIFAR-10 images as ``(transform(uint8 CHW tensor), label)``.

    ``transform="default"`` gives float tensors normalized by the CIFAR-10 mean/std; ``None`` gives the
    raw ``uint8`` ``(3, 32, 32)`` tensors. See :func:`verify_files` for ``verify``.
    """

    def __init__(
        self,
        root: PathLike,
        *,
        train: bool = True,
        transform: Transform | Literal["default"] | None = "default",
        verify: Verify = "auto",
    ) -> None:
        self.folder = batches_folder(root)
        names = TRAIN_FILES if train else TEST_FILES
        self.checked_against = verify_files(self.folder, (*names, META_FILE), verify)
        # Every file matched its checksum: from here on unpickling is safe.
        meta = _unpickle(self.folder / META_FILE)
        if "label_names" not in meta:
            raise DataError(
                f"{self.folder / META_FILE} has no 'label_names' entry; regenerate or re-download it"
            )
        self.classes: list[str] = [_text(x) for x in meta["label_names"]]
        chunks: list[np.ndarray] = []
        self.targets: list[int] = []
        for name in names:
            entry = _unpickle(self.folder / name)
            data, labels = entry.get("data"), entry.get("labels")
            if (
                not isinstance(data, np.ndarray)
                or data.dtype != np.uint8
                or data.ndim != 2
                or data.shape[1] != 3072
            ):
                raise DataError(
                    f"{self.folder / name}: 'data' must be a uint8 array of shape (N, 3072); re-export it"
                )
            if labels is None or len(labels) != len(data):
                raise DataError(
                    f"{self.folder / name}: 'labels' must list one label per row of 'data'; re-export it"
                )
            bad = [int(y) for y in labels if not 0 <= int(y) < len(self.classes)]
            if bad:
                raise DataError(
                    f"{self.folder / name}: label {bad[0]} is outside 0..{len(self.classes) - 1}; re-export it"
                )
            chunks.append(data)
            self.targets.extend(int(y) for y in labels)
        # Rows are the R, G, B planes of a 32×32 image one after another, i.e. CHW flattened.
        self.data = torch.from_numpy(np.concatenate(chunks).reshape(-1, 3, 32, 32))
        if transform == "default":
            transform = normalize_transform(CIFAR10_MEAN, CIFAR10_STD)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image: Any = self.data[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[index]


def _write_batch(path: Path, images: np.ndarray, labels: np.ndarray, batch_label: str, start: int) -> None:
    entry = {
        b"batch_label": batch_label.encode(),
        b"labels": [int(y) for y in labels],
        b"data": images,
        b"filenames": [f"generated_{start + i:06d}.png".encode() for i in range(len(labels))],
    }
    with open(path, "wb") as f:
        pickle.dump(entry, f, protocol=4)


def _draw_split(rng: np.random.Generator, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.permutation(np.repeat(np.arange(len(LABEL_NAMES)), per_class))
    hwc = (
        np.stack([draw_class_image(rng, int(y), 32) for y in labels])
        if len(labels)
        else np.zeros((0, 32, 32, 3), np.uint8)
    )
    return np.ascontiguousarray(hwc.transpose(0, 3, 1, 2).reshape(len(labels), 3072)), labels


def make_cifar10(
    out: PathLike, *, train_per_class: int = 100, test_per_class: int = 20, seed: int = 0
) -> Path:
    """Write a learnable CIFAR-10-format set (5 train batches, ``test_batch``, ``batches.meta``, ``MANIFEST.md5``).

    Class ``i`` is one coloured shape (see :func:`gputrain.data.images.draw_class_image`) on a noisy
    background at a random place and size. Returns ``out``, the folder to pass to :class:`CIFAR10`.
    """
    if train_per_class < 1 or test_per_class < 1:
        raise ValueError("train_per_class and test_per_class must be at least 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    data, labels = _draw_split(rng, train_per_class)
    parts = np.array_split(np.arange(len(labels)), len(TRAIN_FILES))  # CIFAR's own split: 5 equal batches
    for i, (name, part) in enumerate(zip(TRAIN_FILES, parts, strict=True)):
        batch_label = f"training batch {i + 1} of {len(TRAIN_FILES)}"
        _write_batch(
            out / name, data[part], labels[part], batch_label, start=int(part[0]) if len(part) else 0
        )
    start = len(labels)
    test_data, test_labels = _draw_split(rng, test_per_class)
    _write_batch(out / TEST_FILES[0], test_data, test_labels, "testing batch 1 of 1", start)
    meta = {
        b"num_cases_per_batch": len(labels) // len(TRAIN_FILES),
        b"label_names": [n.encode() for n in LABEL_NAMES],
        b"num_vis": 3072,
    }
    with open(out / META_FILE, "wb") as f:
        pickle.dump(meta, f, protocol=4)
    names = (*TRAIN_FILES, *TEST_FILES, META_FILE)
    (out / MANIFEST).write_text("".join(f"{file_md5(out / n)}  {n}\n" for n in names))  # md5sum -c compatible
    return out
