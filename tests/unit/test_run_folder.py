"""Pure pieces of a user's first hour: run folders (new and dated, refused when in use, cleared only when
gputrain's alone), the ``latest`` link, output files and eval folders."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest

from gputrain.runs.folder import (
    check_eval_folder,
    check_output_file,
    check_run_folder,
    clear_run_folder,
    default_run_dir,
    eval_dir_for,
    forget_untrained_run,
    point_latest,
)

NOON = datetime(2026, 11, 23, 14, 15, 2)


def _a_run(folder: Path) -> Path:
    """What a run leaves: its marker, config, metrics, and a checkpoint its manifest lists."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "epoch_0001.pt").write_bytes(b"old")
    entry = {"size": 3, "crc32": "00000000", "seq": 1}
    (folder / "checkpoints" / "manifest.json").write_text(json.dumps({"seq": 1, "files": {"epoch_0001.pt": entry}}))
    (folder / "config.yaml").write_text("task: autoencoder\n")
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / ".gputrain").write_text("gputrain\n")
    return folder


# -- run folders ------------------------------------------------------------------------------


def test_default_run_dir_is_new_and_unique_within_one_second(tmp_path):
    first = default_run_dir("autoencoder", root=tmp_path, now=NOON)
    second = default_run_dir("autoencoder", root=tmp_path, now=NOON)
    assert first.name == "autoencoder-20261123-141502" and second.name == "autoencoder-20261123-141502-2"
    assert first.is_dir() and second.is_dir() and not any(first.iterdir())
    assert default_run_dir("my/recipes/ae.yaml", root=tmp_path, now=NOON).name == "ae-20261123-141502"
    assert default_run_dir("pkg.mod:build", root=tmp_path, now=NOON).name == "build-20261123-141502"


def test_a_non_empty_run_folder_is_refused_naming_both_ways_out(tmp_path):
    run = _a_run(tmp_path / "run")
    with pytest.raises(ValueError) as err:
        check_run_folder(run, resume="", overwrite=False)
    message = str(err.value)
    assert str(run) in message and "--resume auto" in message and "--overwrite" in message
    assert "\n" not in message
    check_run_folder(run, resume="auto", overwrite=False)  # continuing it
    check_run_folder(run, resume=str(run / "checkpoints" / "epoch_0001.pt"), overwrite=False)  # its own checkpoint
    check_run_folder(run, resume="", overwrite=True)  # replacing it
    check_run_folder(tmp_path / "new", resume="", overwrite=False)  # does not exist yet
    (tmp_path / "empty").mkdir()
    check_run_folder(tmp_path / "empty", resume="", overwrite=False)
    with pytest.raises(ValueError, match="is not empty"):  # a checkpoint from elsewhere starts a new run
        check_run_folder(run, resume=str(tmp_path / "other.pt"), overwrite=False)


def test_contradictions_and_files_are_refused(tmp_path):
    run = _a_run(tmp_path / "run")
    with pytest.raises(ValueError, match="--overwrite would delete the run .* --resume auto"):
        check_run_folder(run, resume="auto", overwrite=True)
    with pytest.raises(ValueError, match="the checkpoint --resume starts from"):
        check_run_folder(run, resume=str(run / "checkpoints" / "epoch_0001.pt"), overwrite=True)
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_run_folder(run / "config.yaml", resume="", overwrite=False)


def test_overwrite_clears_only_gputrain_run_folders(tmp_path, monkeypatch):
    run = _a_run(tmp_path / "run")
    clear_run_folder(run)
    assert run.is_dir() and list(run.iterdir()) == []
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')\n")
    with pytest.raises(ValueError, match="holds no gputrain run"):
        check_run_folder(project, resume="", overwrite=True)
    with pytest.raises(ValueError, match="holds no gputrain run"):
        clear_run_folder(project)
    assert (project / "train.py").is_file()
    _a_run(project / "inside")
    (project / "inside" / "tensorboard").mkdir()  # a logger's folder: its contents are ours whatever they are
    (project / "inside" / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    monkeypatch.chdir(project / "inside")
    with pytest.raises(ValueError, match="working folder"):
        check_run_folder(Path("."), resume="", overwrite=True)


def test_latest_is_a_relative_link_replaced_atomically(tmp_path):
    a, b = default_run_dir("x", root=tmp_path, now=NOON), default_run_dir("y", root=tmp_path, now=NOON)
    assert point_latest(a) and os.readlink(tmp_path / "latest") == a.name
    assert point_latest(b) and os.readlink(tmp_path / "latest") == b.name
    assert (tmp_path / "latest").resolve() == b.resolve()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".latest")]  # no temporary link left
    old = tmp_path / "old"
    old.mkdir()
    (old / "latest").mkdir()  # a real folder from an older gputrain is left alone
    assert not point_latest(old / "run")
    assert (old / "latest").is_dir() and not (old / "latest").is_symlink()


def test_a_run_refused_before_training_leaves_no_folder_and_latest_where_it_was(tmp_path, monkeypatch):
    """Found by a new user (round 5): a refused run left an empty dated folder, and ``runs/latest`` pointed to it."""
    from gputrain.cli import main
    from gputrain.data.imagefolder import make_frames

    frames = make_frames(tmp_path / "frames", count=8, size=40, videos=1)
    monkeypatch.chdir(tmp_path)
    before = _a_run(tmp_path / "runs" / "autoencoder-20261123-141502")
    point_latest(before)
    assert main(["train", "autoencoder", "--data-root", str(frames), "--accelerator", "cpu",
                 "model.kwargs.widht=3"]) == 2
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["autoencoder-20261123-141502", "latest"]
    assert os.readlink(tmp_path / "runs" / "latest") == before.name
    # A folder holding more than an untrained run's files (metrics, checkpoints) is kept, and latest with it.
    kept = _a_run(tmp_path / "runs" / "kept")
    point_latest(kept)
    assert not forget_untrained_run(kept, before.name) and os.readlink(tmp_path / "runs" / "latest") == "kept"
    # With no earlier run, the link goes with the folder.
    (tmp_path / "alone" / "run" / "splits").mkdir(parents=True)
    point_latest(tmp_path / "alone" / "run")
    assert forget_untrained_run(tmp_path / "alone" / "run", None)
    assert list((tmp_path / "alone").iterdir()) == []


def test_output_files_and_eval_folders(tmp_path):
    onnx = tmp_path / "model.onnx"
    check_output_file(onnx, overwrite=False)
    onnx.write_bytes(b"x")
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        check_output_file(onnx, overwrite=False)
    check_output_file(onnx, overwrite=True)
    with pytest.raises(ValueError, match="is a folder"):
        check_output_file(tmp_path, overwrite=True)
    (tmp_path / "eval.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds eval.json"):
        check_eval_folder(tmp_path, overwrite=False)
    assert eval_dir_for(tmp_path / "run" / "checkpoints" / "last.pt", "ae") == tmp_path / "run" / "eval"


@pytest.mark.parametrize("foreign", ["train.py", "data/a.csv", "checkpoints/resnet.pt", "checkpoints/model.ckpt",
                                     "checkpoints/step_000004.dcp/notes.txt", "eval/notes.md"])
def test_overwrite_refuses_a_run_folder_holding_one_file_gputrain_did_not_write(tmp_path, foreign):
    """issue 28 item 1: a project folder with checkpoints/ and config.yaml lost train.py and data/a.csv."""
    run = _a_run(tmp_path / "p")
    (run / "checkpoints" / "step_000004.dcp").mkdir()
    (run / "checkpoints" / "step_000004.dcp" / ".metadata").write_bytes(b"m")
    (run / "eval").mkdir()
    (run / "eval" / "eval.json").write_text("{}")
    (run / foreign).parent.mkdir(parents=True, exist_ok=True)
    (run / foreign).write_text("mine")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    for attempt in (lambda: check_run_folder(run, resume="", overwrite=True), lambda: clear_run_folder(run)):
        with pytest.raises(ValueError) as err:
            attempt()
        assert str(run / foreign) in str(err.value) and "was not written by gputrain" in str(err.value)
        assert "\n" not in str(err.value)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing removed
    (run / foreign).unlink()
    if foreign.startswith("data/"):
        (run / "data").rmdir()  # an empty folder of the user's is still theirs
    clear_run_folder(run)  # without it, the folder is gputrain's alone
    assert list(run.iterdir()) == []


def test_a_folder_without_the_run_marker_or_a_manifest_is_not_a_run(tmp_path):
    """config.yaml and checkpoints/ are common names: on their own they do not make a folder gputrain's."""
    project = tmp_path / "p"
    (project / "checkpoints").mkdir(parents=True)
    (project / "config.yaml").write_text("lr: 0.1\n")
    with pytest.raises(ValueError, match="holds no gputrain run"):
        clear_run_folder(project)
    assert (project / "config.yaml").is_file() and (project / "checkpoints").is_dir()
