"""CheckpointStore and the checkpoint file layer on real files: permissions, temporaries, manifest, rotation, best,
and the states a save refuses. Damaged, foreign and malicious files: test_checkpoint_damage.py."""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from checkpoint_states import _manifest, _saved_step, _state
from gputrain.checkpoint import (
    CheckpointStore,
    atomic_save,
    load_checkpoint,
    remove_stale_temporaries,
)


@pytest.fixture
def umask():
    def set_umask(mask: int) -> None:
        os.umask(mask)

    old = os.umask(0o022)
    yield set_umask
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_files_get_the_permissions_a_plain_write_gets(tmp_path, umask, mask, mode):
    umask(mask)
    with open(tmp_path / "plain.txt", "w"):
        pass
    assert (tmp_path / "plain.txt").stat().st_mode & 0o777 == mode
    atomic_save(_state(1), tmp_path / "atomic.pt")
    store = CheckpointStore(tmp_path / "ck", monitor="val/loss")
    store.save(_state(1), name="epoch_0001", metrics={"val/loss": 1.0})
    written = [tmp_path / "atomic.pt"] + sorted((tmp_path / "ck").iterdir())
    assert [p.name for p in written] == ["atomic.pt", "best.pt", "epoch_0001.pt", "last.pt", "manifest.json"]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {p.name: oct(mode) for p in written}


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    stale = [".last.pt.k2j4_x9a.tmp", ".step_000120.pt.3fa9c2d1.tmp", ".manifest.json.0a1b2c3d.tmp"]
    kept = ["last.pt", "manifest.json", "notes.tmp", ".hidden", "a.pt.tmp"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_temporaries(tmp_path) == sorted(tmp_path / n for n in stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert remove_stale_temporaries(tmp_path / "absent") == []


def _records_crc32(path: Path) -> str:
    """The manifest's zip_crc32 recomputed: each record's bytes against the CRC-32 torch stored for it, then the
    CRC-32 of the central directory's listing."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            assert zlib.crc32(archive.read(info)) == info.CRC, info.filename  # read() checks too; say which
        listing = "".join(f"{i.filename}\t{i.CRC:08x}\t{i.file_size}\t{i.compress_size}\t{i.compress_type}\t"
                          f"{i.header_offset}\n" for i in archive.infolist())
    return f"{zlib.crc32(listing.encode()):08x}"


def test_save_writes_numbered_last_and_a_manifest_of_sizes_and_checksums(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(_state(120), name="step_000120", metrics={"train/loss": 0.5, "val/loss": float("nan")})
    assert path == tmp_path / "step_000120.pt"
    assert (tmp_path / "last.pt").read_bytes() == path.read_bytes()
    files = _manifest(tmp_path)["files"]
    assert set(files) == {"step_000120.pt", "last.pt"}
    for name, entry in files.items():
        data = (tmp_path / name).read_bytes()
        assert entry["size"] == len(data)
        assert entry["zip_crc32"] == _records_crc32(tmp_path / name)  # the checksum of the bytes on disk, as written
        assert (entry["step"], entry["epoch"]) == (120, 12)
        assert entry["metrics"] == {"train/loss": 0.5, "val/loss": None}  # NaN is not JSON: null
    assert files["last.pt"]["same_as"] == "step_000120.pt"
    assert torch.equal(load_checkpoint(tmp_path / "last.pt")["model"]["w"], torch.full((1000,), 120.0))
    assert store.latest_valid() == path


def test_an_empty_name_writes_only_last(tmp_path):
    store = CheckpointStore(tmp_path)
    assert store.save(_state(1), name="") == tmp_path / "last.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "manifest.json"]
    with pytest.raises(ValueError, match="checkpoint name 'last'"):
        store.save(_state(2), name="last")
    with pytest.raises(ValueError, match="checkpoint name '../x'"):
        store.save(_state(2), name="../x")


def test_keep_last_keeps_the_newest_numbered_by_save_order(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        store.save(_state(step), name=f"step_{step:06d}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "manifest.json", "step_000030.pt",
                                                         "step_000040.pt"]
    assert set(_manifest(tmp_path)["files"]) == {"last.pt", "step_000030.pt", "step_000040.pt"}
    # Resumed from step 30 after step 40 went bad: the new saves are the newest, whatever their step.
    store.save(_state(35), name="step_000035")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000035.pt", "step_000040.pt"]
    assert store.latest_valid() == tmp_path / "step_000035.pt"
    store.save(_state(35), name="step_000035")  # saved again under the same name (an interrupt, say)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000035.pt", "step_000040.pt"]


@pytest.mark.parametrize("keep", [1, 0, -1])
def test_keep_last_below_two_is_refused(tmp_path, keep):
    with pytest.raises(ValueError, match=f"trainer.keep_last={keep} is too few.*at least 2"):
        CheckpointStore(tmp_path, keep_last=keep)
    with pytest.raises(ValueError, match="trainer.monitor_mode='lowest' is neither"):
        CheckpointStore(tmp_path, monitor="val/loss", monitor_mode="lowest")


@pytest.mark.parametrize("mode, values, best", [("min", [3.0, 1.0, 2.0, float("nan")], 2),
                                                ("max", [0.5, 0.9, 0.7, float("inf")], 2)])
def test_best_follows_the_monitored_metric(tmp_path, mode, values, best):
    store = CheckpointStore(tmp_path, keep_last=2, monitor="val/metric", monitor_mode=mode)
    for i, value in enumerate(values, start=1):
        store.save(_state(i), name=f"epoch_{i:04d}", metrics={"val/metric": value})
    store.save(_state(9), name="step_000009")  # no metrics: best.pt untouched
    assert _saved_step(tmp_path / "best.pt") == best  # its numbered twin was rotated away; best.pt stays
    assert not (tmp_path / f"epoch_{best:04d}.pt").exists()
    entry = _manifest(tmp_path)["files"]["best.pt"]
    assert (entry["metrics"]["val/metric"], entry["monitor_mode"]) == (values[best - 1], mode)


def test_state_that_weights_only_would_refuse_is_refused_at_save(tmp_path):
    import numpy as np

    store = CheckpointStore(tmp_path)
    bad = _state(1) | {"rng": {"0": {"numpy": np.random.get_state()}}}
    with pytest.raises(ValueError, match=r"entry state\['rng'\]\['0'\]\['numpy'\]\[1\] is a numpy.ndarray"):
        store.save(bad, name="step_000001")
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary
    ok = _state(1) | {"extra": [(1, 2.5, None, "s", {3}), torch.Size([2]), torch.float16, torch.device("cpu")]}
    store.save(ok, name="step_000001")
    assert load_checkpoint(tmp_path / "step_000001.pt")["extra"][0] == (1, 2.5, None, "s", {3})


def test_an_object_refused_twice_is_named_where_the_check_met_it(tmp_path):
    """The check walks without building names and names the refused entry only then, by the same walk."""
    bad = object()
    with pytest.raises(ValueError, match=r"^checkpoint entry state\['b'\] is a builtins\.object"):
        CheckpointStore(tmp_path).save({"model": {}, "a": bad, "b": bad}, name="step_000001")


def test_a_sharded_save_never_committed_leaves_no_folder_after_the_next_start(tmp_path):
    """A node killed in a sharded save leaves its step's DCP folder half written (a lost rank's shard in it) and no
    checkpoint file naming it. The next run removes it on rank 0 before its first save, so the step saved again
    goes into a new folder; a committed save's folder, and a damaged file's, are kept."""
    from gputrain.checkpoint.checkpointer import Checkpointer
    from gputrain.config.schema import TrainerConfig
    from gputrain.dist import DistInfo

    folder = tmp_path / "checkpoints"
    for step in (4, 6, 8):
        (folder / f"step_{step:06d}.dcp").mkdir(parents=True)
        (folder / f"step_{step:06d}.dcp" / "__1_0.distcp").write_bytes(b"a shard")
    torch.save({"sharded": "step_000004.dcp"}, folder / "step_000004.pt")
    (folder / "step_000008.pt").write_bytes(b"damaged")
    Checkpointer(folder, TrainerConfig(), DistInfo(rank=1, world_size=2), sharded=True)  # not rank 0: nothing
    assert (folder / "step_000006.dcp").is_dir()
    Checkpointer(folder, TrainerConfig(), DistInfo(), sharded=False)  # full checkpoints: no DCP folders of its own
    assert (folder / "step_000006.dcp").is_dir()
    Checkpointer(folder, TrainerConfig(), DistInfo(), sharded=True)
    assert sorted(p.name for p in folder.iterdir()) == ["step_000004.dcp", "step_000004.pt", "step_000008.dcp",
                                                        "step_000008.pt"]
