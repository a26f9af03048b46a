"""CIFAR-10 loader: format of the generated set, checksums before unpickling, clear errors."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from gputrain.data import cifar10
from gputrain.data.cifar10 import (
    CIFAR10,
    MANIFEST,
    TEST_FILES,
    TRAIN_FILES,
    file_md5,
    make_cifar10,
    published_md5s,
)
from gputrain.data.images import DataError


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_cifar10(tmp_path_factory.mktemp("cifar") / "set", train_per_class=3, test_per_class=1, seed=0)


@pytest.fixture
def copy(generated: Path, tmp_path: Path) -> Path:
    """A private copy a test may damage."""
    return Path(shutil.copytree(generated, tmp_path / "set"))


def test_generated_files_are_real_cifar_batches(generated: Path) -> None:
    assert sorted(p.name for p in generated.iterdir()) == sorted(
        [*TRAIN_FILES, *TEST_FILES, "batches.meta", MANIFEST]
    )
    with open(generated / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="bytes")  # how the CIFAR website says to read them
    assert set(batch) == {b"data", b"labels", b"batch_label", b"filenames"}
    assert batch[b"data"].dtype.name == "uint8" and batch[b"data"].shape[1] == 3072
    assert len(batch[b"labels"]) == len(batch[b"data"]) == len(batch[b"filenames"])
    with open(generated / "batches.meta", "rb") as f:
        assert pickle.load(f, encoding="bytes")[b"label_names"][0] == b"airplane"


def test_loads_train_and_test(generated: Path) -> None:
    train = CIFAR10(generated)
    image, label = train[0]
    assert len(train) == 30 and isinstance(label, int)
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert sorted(train.targets) == sorted(list(range(10)) * 3)
    assert train.checked_against.endswith(MANIFEST)
    test = CIFAR10(generated, train=False, transform=None)
    assert len(test) == 10 and test[0][0].dtype == torch.uint8 and test.classes[9] == "truck"


def test_published_sums_come_from_torchvision() -> None:
    import torchvision

    sums = published_md5s()
    assert sums["test_batch"] == dict(torchvision.datasets.CIFAR10.test_list)["test_batch"]
    assert len(sums) == 7


def test_generated_set_fails_published_sums_with_the_file_named(generated: Path) -> None:
    with pytest.raises(DataError, match=r"data_batch_1 has md5 .* published"):
        CIFAR10(generated, verify="published")


def test_md5_mismatch_refused_before_any_unpickling(copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (copy / "data_batch_3").write_bytes(
        b"\x80\x04not a pickle at all"
    )  # unpickling this would raise otherwise

    def never(path: Path) -> None:
        raise AssertionError(f"unpickled {path} before every checksum matched")

    monkeypatch.setattr(cifar10, "_unpickle", never)
    with pytest.raises(DataError, match="data_batch_3") as err:
        CIFAR10(copy)
    assert "md5" in str(err.value) and "make_cifar10" in str(err.value)


def test_missing_file_is_named(copy: Path) -> None:
    (copy / "data_batch_2").unlink()
    with pytest.raises(DataError, match=r"data_batch_2 is missing"):
        CIFAR10(copy)
    (copy / "test_batch").unlink()
    with pytest.raises(DataError, match=r"test_batch is missing"):
        CIFAR10(copy, train=False)


def test_manifest_mode_without_manifest(copy: Path) -> None:
    (copy / MANIFEST).unlink()
    with pytest.raises(DataError, match=r"MANIFEST.md5 does not exist"):
        CIFAR10(copy, verify="manifest")


def test_pickle_globals_outside_the_format_are_refused(copy: Path) -> None:
    # Even a file whose checksum matches (someone rewrote the manifest) cannot run code.
    (copy / "data_batch_1").write_bytes(pickle.dumps({b"data": shutil.rmtree}))
    lines = [f"{file_md5(copy / n)}  {n}" for n in (*TRAIN_FILES, *TEST_FILES, "batches.meta")]
    (copy / MANIFEST).write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"data_batch_1 .*not part of the CIFAR format"):
        CIFAR10(copy)


def test_generated_data_is_learnable(tmp_path: Path) -> None:
    torch.manual_seed(0)
    root = make_cifar10(tmp_path, train_per_class=20, test_per_class=5, seed=1)
    train, test = CIFAR10(root), CIFAR10(root, train=False)
    x = torch.stack([train[i][0] for i in range(len(train))])
    y = torch.tensor(train.targets)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(4),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(15):  # a few epochs of full-batch steps
        for idx in torch.randperm(len(y)).split(50):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    xt = torch.stack([test[i][0] for i in range(len(test))])
    accuracy = (model(xt).argmax(1) == torch.tensor(test.targets)).float().mean().item()
    assert accuracy > 0.8, accuracy
