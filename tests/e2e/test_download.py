"""data.download=true for CIFAR-10: a generated archive in CIFAR-10's real format served on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

import pytest
import torchvision

from forked_cli import run_gputrain
from gputrain.config import load_config
from gputrain.data.cifar10 import CIFAR10, make_cifar10
from gputrain.data.download import download_data
from local_http import serving

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


@pytest.fixture
def archive(tmp_path: Path) -> tuple[Path, str]:
    """cifar-10-python.tar.gz laid out as torchvision's (one cifar-10-batches-py folder), and its md5."""
    made = make_cifar10(tmp_path / "src" / "cifar-10-batches-py", train_per_class=2, test_per_class=1)
    served = tmp_path / "served"
    served.mkdir()
    path = served / "cifar-10-python.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(made, arcname="cifar-10-batches-py")
    return path, hashlib.md5(path.read_bytes()).hexdigest()


def _cfg(root: Path, url: str, md5: str):
    return load_config("cifar10-resnet18", [f"data.root={root}", "data.download=true", f"data.download_url={url}",
                                            f"data.download_md5={md5}"])


def test_the_archive_is_downloaded_checked_and_extracted_once(tmp_path, archive):
    path, md5 = archive
    with serving(path.parent) as (url, gets):
        cfg = _cfg(tmp_path / "data", f"{url}/{path.name}", md5)
        download_data(cfg)
        download_data(cfg)  # already there: nothing fetched again
    assert gets == [f"/{path.name}"]
    assert len(CIFAR10(tmp_path / "data", train=True)) == 20 and len(CIFAR10(tmp_path / "data", train=False)) == 10


def test_a_checksum_mismatch_is_one_line_and_leaves_no_archive(tmp_path, archive):
    path, _ = archive
    with serving(path.parent) as (url, _gets):
        cfg = _cfg(tmp_path / "data", f"{url}/{path.name}", "f" * 32)
        with pytest.raises(ValueError, match=r"^data.download: http://127.0.0.1:\d+/cifar-10-python.tar.gz does not "
                                             r"match md5 f{32}; the file was removed"):
            download_data(cfg)
    assert not (tmp_path / "data" / path.name).exists()


def test_the_default_is_torchvisions_url_and_md5_and_offline_is_one_line_before_any_worker(tmp_path):
    root = tmp_path / "data"
    done = run_gputrain(["train", "cifar10-resnet18", "--data-root", str(root), "data.download=true"], env=ENV,
                        timeout=300)
    assert done.returncode == 2, done.stderr
    tv = torchvision.datasets.CIFAR10
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gputrain: error: data.download: cannot download {tv.url} (")
    assert lines[0].endswith(f"put {tv.filename} in {root} and run again (it is checked and extracted there), or set "
                             "data.download_url to a mirror")
    assert tv.tgz_md5 == "c58f30108f718f92721af3b95e74349a"  # the published sum the default checks against


def test_two_processes_train_on_data_downloaded_once_per_node(tmp_path, archive):
    path, md5 = archive
    with serving(path.parent) as (url, gets):
        done = run_gputrain(
            ["train", "cifar10-resnet18", "--strategy", "ddp", "--devices", "2", "--epochs", "1", "--batch-size", "4",
             "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "data.download=true",
             f"data.download_url={url}/{path.name}", f"data.download_md5={md5}", "trainer.max_steps_per_epoch=1", "trainer.pictures=0", "trainer.progress_bar=false", "trainer.loggers=[]"],
            env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr
    assert gets == [f"/{path.name}"]
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_the_source_is_torchvisions_unless_a_mirror_and_its_md5_are_given():
    from gputrain.data.download import cifar10_source

    assert cifar10_source() == ("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz",
                                "c58f30108f718f92721af3b95e74349a")
    assert cifar10_source("http://mirror.example/data/c10.tgz", "0123456789abcdef0123456789abcdef") == (
        "http://mirror.example/data/c10.tgz", "c10.tgz", "0123456789abcdef0123456789abcdef")
    # A mirror of the same archive without a sum of its own is checked against torchvision's.
    assert cifar10_source("http://mirror.example/c10.tgz") == (
        "http://mirror.example/c10.tgz", "c10.tgz", "c58f30108f718f92721af3b95e74349a")


def test_a_mirrors_archive_put_by_hand_under_its_own_name_is_checked_and_extracted_offline(tmp_path, archive):
    """The refusal names the file to put in data.root; put there, it is used without any download."""
    path, md5 = archive
    root = tmp_path / "data"
    down = tmp_path / "down"
    down.mkdir()
    with serving(down) as (url, gets):  # the mirror answers 404: nothing to fetch
        cfg = _cfg(root, f"{url}/pub/c10-mirror.tgz", md5)
        with pytest.raises(ValueError) as err:
            download_data(cfg)
        assert str(err.value).startswith(f"data.download: cannot download {url}/pub/c10-mirror.tgz (")
        assert str(err.value).endswith(f"; put c10-mirror.tgz in {root} and run again (it is checked and extracted "
                                       "there), or set data.download_url to a mirror")
        root.mkdir(exist_ok=True)
        (root / "c10-mirror.tgz").write_bytes(path.read_bytes())
        download_data(cfg)
    assert gets == []
    assert len(CIFAR10(root, train=True)) == 20 and len(CIFAR10(root, train=False)) == 10
