"""Damaged checkpoints on real files: each kind of damage is named, refused and skipped by ``--resume auto``,
including what torch.load alone would accept; files no manifest lists, manifests of older versions, malicious
pickles, and a folder whose every checkpoint is damaged."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from checkpoint_states import _manifest, _saved_step, _state
from gputrain.checkpoint import (
    CheckpointStore,
    atomic_save,
    load_checkpoint,
    model_weights,
)


def _truncate(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    return f"truncated: {size - 100} of {size} bytes"


def _flip(path: Path) -> str:
    with open(path, "r+b") as f:  # in place: last.pt, a hard link of the same file, is damaged too
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x04]))
    return "checksum mismatch"


def _empty(path: Path) -> str:
    with open(path, "r+b") as f:
        f.truncate(0)
    return "0 bytes"


@pytest.mark.parametrize("damage", [_truncate, _flip, _empty])
def test_damaged_checkpoints_are_named_refused_and_skipped(tmp_path, damage, capsys):
    store = CheckpointStore(tmp_path)
    for step in (10, 20, 30):
        store.save(_state(step), name=f"step_{step:06d}")
    newest = tmp_path / "step_000030.pt"
    reason = damage(newest)
    for path in (newest, tmp_path / "last.pt"):
        with pytest.raises(ValueError, match=f"checkpoint {path} is damaged \\({reason}.*--resume auto skips it"):
            load_checkpoint(path)
    with pytest.raises(ValueError, match=reason):
        model_weights(newest)
    assert store.latest_valid() == tmp_path / "step_000020.pt"
    assert [(p.name, reason in why) for p, why in store.skipped] == [("step_000030.pt", True), ("last.pt", True)]
    assert f"skipping checkpoint {newest}: {reason}" in capsys.readouterr().err
    assert _saved_step(tmp_path / "step_000020.pt") == 20


def test_bit_flip_that_torch_load_accepts_is_caught(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(_state(1), name="step_000001")
    data = bytearray(path.read_bytes())
    data[data.find(torch.full((1,), 1.0).numpy().tobytes()) + 200] ^= 0x10  # inside the tensor's bytes
    path.unlink()  # a new file, so last.pt (a hard link of the old one) keeps the good bytes
    path.write_bytes(bytes(data))
    assert (torch.load(path, weights_only=True)["model"]["w"] != 1.0).sum() == 1  # torch alone would not notice
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_checkpoint(path)
    assert store.latest_valid() == tmp_path / "last.pt"


def test_a_damaged_copy_outside_its_run_folder_is_refused_by_its_own_crcs(tmp_path):
    """issue 28 item 9: a flipped byte in a shared copy of last.pt loaded silently (no manifest beside it)."""
    store = CheckpointStore(tmp_path / "run")
    path = store.save(_state(1), name="step_000001")
    data = bytearray(path.read_bytes())
    data[data.find(torch.full((1,), 1.0).numpy().tobytes()) + 200] ^= 0x10  # inside the tensor's bytes
    copy = tmp_path / "shared" / "last.pt"
    copy.parent.mkdir()
    copy.write_bytes(bytes(data))
    assert (torch.load(copy, weights_only=True)["model"]["w"] != 1.0).sum() == 1  # torch alone would not notice
    for load in (load_checkpoint, model_weights):
        with pytest.raises(ValueError, match=f"checkpoint {copy} is damaged \\(zip CRC mismatch in record "):
            load(copy)
    legacy = tmp_path / "legacy.pt"  # torch's format before 1.6 has no CRCs: loaded as torch.load decides
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    assert model_weights(legacy)["w"].sum() == 3


def test_files_no_manifest_lists_load_unchecked_and_are_still_found(tmp_path, capsys):
    store = CheckpointStore(tmp_path / "run")
    store.save(_state(5), name="step_000005")
    copy = tmp_path / "elsewhere" / "step_000005.pt"
    copy.parent.mkdir()
    shutil.copyfile(tmp_path / "run" / "step_000005.pt", copy)
    assert _saved_step(copy) == 5
    # A folder written before manifests existed: newest by modification time, damage found by torch's zip CRCs.
    legacy = tmp_path / "legacy"
    atomic_save(_state(1), legacy / "epoch_0001.pt")
    atomic_save(_state(2), legacy / "last.pt")
    os.utime(legacy / "epoch_0001.pt", (1, 1))
    assert CheckpointStore(legacy).latest_valid() == legacy / "last.pt"
    _flip(legacy / "last.pt")
    found = CheckpointStore(legacy)
    assert found.latest_valid() == legacy / "epoch_0001.pt"
    assert "zip CRC mismatch" in found.skipped[0][1]
    # An unreadable manifest is reported, and the checkpoints are still found.
    (tmp_path / "run" / "manifest.json").write_text("{not json")
    store = CheckpointStore(tmp_path / "run")
    assert store.latest_valid() == tmp_path / "run" / "step_000005.pt"
    assert store.skipped[0][0].name == "manifest.json"
    assert "manifest.json is not valid JSON" in capsys.readouterr().err
    (tmp_path / "run" / "manifest.json").write_text('{"files": {"last.pt": {"size": "12"}}}')
    assert store.latest_valid() == tmp_path / "run" / "step_000005.pt"
    assert "entry 'last.pt' lacks size, crc32 or seq" in store.skipped[0][1]
    store.save(_state(6), name="step_000006")  # a new manifest replaces the broken one
    assert _manifest(tmp_path / "run")["files"]["step_000006.pt"]["step"] == 6


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    sentinel = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    # One file per folder: which of two unlisted files is "newest" would depend on their modification times.
    raw, zipped = tmp_path / "raw" / "raw.pt", tmp_path / "zipped" / "zipped.pt"
    raw.parent.mkdir()
    zipped.parent.mkdir()
    raw.write_bytes(pickle.dumps({"model": Exploit()}, protocol=2))
    torch.save({"model": Exploit()}, zipped)  # torch's own format around the same payload
    for path in (raw, zipped):
        with pytest.raises(ValueError, match=f"{path.name} cannot be loaded safely"):
            load_checkpoint(path)
    store = CheckpointStore(zipped.parent)
    assert store.latest_valid() == zipped and store.skipped == []  # whole (its loading is what refuses it)
    store = CheckpointStore(raw.parent)
    assert store.latest_valid() is None
    assert [(p.name, "not a whole torch checkpoint" in why) for p, why in store.skipped] == [("raw.pt", True)]
    assert not sentinel.exists()
    # The other doors to the same file: `gputrain eval/export/predict` (load_for_eval) and model_weights, which a
    # bare state_dict file goes through (docs/checkpoints.md: "Every load uses weights_only=True"). Planted fault: model_weights
    # unpickles freely (refused later, for not holding tensors, once the payload has run).
    from gputrain.tools.from_checkpoint import load_for_eval

    for path in (zipped, raw):
        for load in (model_weights, load_for_eval):
            with pytest.raises(Exception) as refused:  # any refusal; that no code ran is checked first
                load(path)
            assert not sentinel.exists(), f"{load.__name__}({path.name}) ran the file's code"
            assert "Weights only load failed" in str(refused.value), refused.value  # torch's refusal, named


def test_resume_never_silently_starts_over_when_every_checkpoint_is_damaged(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    assert store.resume_path() is None  # no folder yet: a fresh start
    for step in (1, 2):
        store.save(_state(step), name=f"step_{step:06d}")
    for path in (tmp_path / "ck").glob("step_*.pt"):
        _empty(path)  # last.pt, a hard link of step_000002.pt, goes too
    assert store.latest_valid() is None
    with pytest.raises(ValueError, match="no usable checkpoint in .*step_000002.pt \\(0 bytes\\).*--resume PATH"):
        store.resume_path()


def test_with_torchs_record_crcs_off_the_whole_file_is_checksummed(tmp_path, monkeypatch):
    """A user's torch.serialization.set_crc32_options(False) leaves the zip's CRCs zero: the file's own CRC-32 then."""
    monkeypatch.setattr(torch.serialization, "get_crc32_options", lambda: False)
    store = CheckpointStore(tmp_path)
    path = store.save(_state(1), name="step_000001")
    entry = _manifest(tmp_path)["files"]["step_000001.pt"]
    assert "zip_crc32" not in entry and entry["crc32"] == f"{zlib.crc32(path.read_bytes()):08x}"
    _flip(path)
    with pytest.raises(ValueError, match="checksum mismatch: crc32"):
        load_checkpoint(path)


def test_manifests_of_whole_file_crcs_written_before_still_check(tmp_path):
    """gputrain 0.1 listed each file's whole CRC-32 under crc32: such a folder still loads, and damage still shows."""
    store = CheckpointStore(tmp_path)
    path = store.save(_state(3), name="step_000003")
    manifest = _manifest(tmp_path)
    for entry in manifest["files"].values():
        del entry["zip_crc32"]
        entry["crc32"] = f"{zlib.crc32(path.read_bytes()):08x}"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert _saved_step(path) == 3
    store.save(_state(4), name="step_000004")  # a new save beside the old entries
    assert _saved_step(tmp_path / "step_000004.pt") == 4 and _saved_step(path) == 3
    _flip(path)
    with pytest.raises(ValueError, match="checksum mismatch: crc32"):
        load_checkpoint(path)


@pytest.mark.parametrize("where", ["a record's crc32 in the central directory", "the directory's offset"])
def test_damage_outside_the_tensor_bytes_is_caught(tmp_path, where):
    """Bytes loading reads besides the records. (torch and zipfile both read the zip64 end record, and ignore the
    classic end record torch also writes: damage there changes nothing loaded.)"""
    store = CheckpointStore(tmp_path)
    path = store.save(_state(1), name="step_000001")
    data = bytearray(path.read_bytes())
    at = data.rfind(b"PK\x01\x02") + 16 if where.startswith("a record") else data.rfind(b"PK\x06\x06") + 48
    data[at] ^= 0x01
    path.unlink()  # a new file, so last.pt (a hard link of the old one) keeps the good bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_checkpoint(path)
    assert store.latest_valid() == tmp_path / "last.pt"


def test_a_valid_checkpoint_of_the_same_size_is_not_the_one_listed(tmp_path):
    """Another intact save of the same size under the name (a copy over it, a stale file): the manifest says no."""
    store = CheckpointStore(tmp_path)
    older = store.save(_state(1), name="step_000001")
    newer = store.save(_state(2), name="step_000002")
    assert older.stat().st_size == newer.stat().st_size
    newer.unlink()  # a new file, so last.pt (a hard link of the old one) keeps the good bytes
    shutil.copyfile(older, newer)
    with pytest.raises(ValueError, match="checksum mismatch: zip records crc32"):
        load_checkpoint(newer)
    assert _saved_step(tmp_path / "last.pt") == 2
