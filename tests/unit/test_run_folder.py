"""Pure pieces of a user's first hour: run folders, config validation, strict JSON, checkpoint fit, launcher reports."""

from __future__ import annotations

import json
import math
import os
from datetime import datetime
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from gputrain.cli import preflight
from gputrain.config import load_config
from gputrain.data.imagefolder import ImageFiles
from gputrain.data.images import DataError
from gputrain.launcher.failures import report_failure
from gputrain.launcher.worker_errors import WorkerErrorHandler
from gputrain.runs.folder import (
    check_eval_folder,
    check_output_file,
    check_run_folder,
    clear_run_folder,
    default_run_dir,
    eval_dir_for,
    point_latest,
)
from gputrain.runs.loggers import JsonlLogger, strict_json
from gputrain.tools.bench.scale import (
    ScaleRow,
    _error_line,
    add_speedup,
    markdown_table,
    plot,
    run_command,
    threads_per_process,
)
from gputrain.tools.from_checkpoint import config_from_checkpoint, load_fitting, python_run_message
from gputrain.tools.make_data import make_dataset

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


# -- config validation and YAML errors --------------------------------------------------------


@pytest.mark.parametrize("override, field", [
    ("trainer.devices=0", "trainer.devices=0"), ("trainer.devices=-1", "trainer.devices=-1"),
    ("trainer.epochs=0", "trainer.epochs=0"), ("trainer.batch_size=0", "trainer.batch_size=0"),
    ("data.val_fraction=1.0", "data.val_fraction=1.0"), ("optim.lr=0", "optim.lr=0.0"),
])
def test_nonsense_values_are_refused_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config("autoencoder", [override])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("task: autoencoder\ntrainer:\n  epochs: 3\n  loggers: [csv\n")
    with pytest.raises(ValueError) as err:
        load_config(str(recipe))
    assert str(recipe) in str(err.value) and "line 4" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="trainer.epohcs.*Did you mean") as err:
        load_config("autoencoder", ["trainer.epohcs=3"])
    assert "\n" not in str(err.value)


# -- strict JSON ------------------------------------------------------------------------------


def _strict_loads(text: str):
    def refuse(token: str):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_and_summaries_are_strict_json(tmp_path):
    logger = JsonlLogger(tmp_path / "metrics.jsonl")
    logger.log({"train/loss": math.nan, "val/loss": math.inf, "lr": 0.1, "n": torch.tensor(2.5)}, step=1, epoch=0)
    logger.close()
    record = _strict_loads((tmp_path / "metrics.jsonl").read_text())
    assert record["train/loss"] is None and record["val/loss"] is None and record["lr"] == 0.1 and record["n"] == 2.5
    assert _strict_loads(strict_json({"final": {"a": [1.0, -math.inf]}})) == {"final": {"a": [1.0, None]}}


# -- checkpoint config and fit ----------------------------------------------------------------


def _tiny(width: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.Conv2d(width, 3, 3))


def test_a_misfit_is_one_line_naming_shapes_and_the_deciding_field():
    saved = {"task": "autoencoder", "model": {"name": "pkg:tiny", "kwargs": {"width": 4}}}
    cfg = load_config(None, ["model.name=pkg:tiny", "model.kwargs.width=8"])
    with pytest.raises(ValueError) as err:
        load_fitting(_tiny(8), _tiny(4).state_dict(), path="last.pt", cfg=cfg, saved=saved)
    message = str(err.value)
    assert "0.weight is 4x3x3x3 in the checkpoint but 8x3x3x3 in the model" in message
    assert "model.kwargs.width=8 here but 4 in training" in message and "\n" not in message
    model = load_fitting(_tiny(4), _tiny(4).state_dict(), path="last.pt")
    assert isinstance(model, nn.Module)


def test_eval_config_comes_from_the_checkpoint_and_overrides_win(tmp_path):
    saved = load_config("autoencoder", ["model.kwargs.width=4", "trainer.out=runs/x", "trainer.devices=2",
                                        "data.root=somewhere"])
    from gputrain.config import to_dict

    state = {"model": {}, "config": to_dict(saved)}
    cfg, note = config_from_checkpoint(state, "last.pt", recipe=None, overrides=["trainer.batch_size=3"])
    assert cfg.model.kwargs == {"width": 4} and cfg.data.root == "somewhere" and cfg.trainer.batch_size == 3
    assert (cfg.trainer.out, cfg.trainer.devices, note) == ("", 1, "")  # where it ran is not carried over
    cfg, _ = config_from_checkpoint(state, "last.pt", recipe=None, overrides=["model.kwargs.width=8"])
    assert cfg.model.kwargs == {"width": 8}
    with pytest.raises(ValueError, match="holds no saved config"):
        config_from_checkpoint({"model": {}}, "last.pt", recipe=None, overrides=[])
    python_run = {"model": {}, "config": {"task": "custom", "model": {"name": "my.mod:Net", "kwargs": {}}}}
    with pytest.raises(ValueError, match="trained from Python with model my.mod:Net"):
        config_from_checkpoint(python_run, "last.pt", recipe=None, overrides=[])
    assert "export_model(model, 'last.pt'" in python_run_message("last.pt", python_run["config"], "export")


def test_another_recipe_never_merges_its_model_options_into_a_checkpoint():
    """Issue 15 item 3: cifar10-resnet18's model.kwargs.cifar_stem reached the autoencoder's builder."""
    from gputrain.config import to_dict

    saved = to_dict(load_config("autoencoder", ["model.kwargs.width=4", "trainer.batch_size=5"]))
    state = {"model": {}, "config": saved}
    cfg, note = config_from_checkpoint(state, "last.pt", recipe="cifar10-resnet18", overrides=["trainer.batch_size=3"])
    assert (cfg.task, cfg.model.name, cfg.model.kwargs) == ("autoencoder", "conv_autoencoder", {"width": 4})
    assert cfg.trainer.batch_size == 3 and cfg.data == load_config(None, layers=[saved]).data
    assert note == ("gputrain: eval ignores recipe cifar10-resnet18 (task=classification model.name=resnet18): "
                    "last.pt was trained as task=autoencoder model.name=conv_autoencoder, so it is used with the config "
                    "saved in it; drop the recipe to silence this")
    # The same task and model: the recipe says how to run (trainer), the checkpoint what the model is.
    cfg, note = config_from_checkpoint(state, "last.pt", recipe="autoencoder", overrides=[])
    assert note == "" and cfg.model.kwargs == {"width": 4}
    assert cfg.trainer.batch_size == load_config("autoencoder").trainer.batch_size


# -- preflight --------------------------------------------------------------------------------


def test_16_bit_recipe_defaults_fall_back_on_cpu_and_explicit_ones_warn():
    precision, line = preflight.cpu_precision("16-mixed", "cpu", explicit=False)
    assert precision == "32" and "falls back to 32" in line and "--precision 16-mixed" in line
    precision, line = preflight.cpu_precision("bf16-mixed", "cpu", explicit=True)
    assert precision == "bf16-mixed" and "warning" in line and "20x slower" in line
    assert preflight.cpu_precision("32", "cpu", explicit=False) == ("32", "")


def test_dp_says_what_devices_does_and_missing_extras_name_the_install():
    note = preflight.devices_note("dp", 2, "cpu")
    assert "--devices 2 starts no more processes" in note and "on a CPU it uses one device" in note
    assert preflight.devices_note("ddp", 2, "cpu") == ""
    from gputrain import extras
    from gputrain.errors import MissingExtra

    with pytest.raises(MissingExtra, match=r"pip install 'gputrain\[loggers\]'"):
        extras.EXTRAS["no_such_package_xyz"] = "loggers"
        try:
            extras.require("no_such_package_xyz", "trainer.loggers=[x]")
        finally:
            del extras.EXTRAS["no_such_package_xyz"]


def test_data_make_refuses_negative_counts(tmp_path):
    with pytest.raises(ValueError, match="count=-5"):
        make_dataset("imagefolder", tmp_path / "x", count=-5)
    assert not (tmp_path / "x").exists()


def test_images_of_different_sizes_name_the_first_odd_file(tmp_path):
    from torchcodec.encoders import PngEncoder

    for i, side in enumerate((40, 40, 32, 40)):
        PngEncoder(torch.zeros(3, side, side + 1, dtype=torch.uint8)).to_file(tmp_path / f"f{i}.png")
    files = sorted(tmp_path.glob("*.png"))
    with pytest.raises(DataError) as err:
        ImageFiles(files)
    assert str(files[2]) in str(err.value) and "33x32" in str(err.value) and "41x40" in str(err.value)
    assert "data.image_size" in str(err.value)
    assert ImageFiles(files, image_size=16)[2].shape == (3, 16, 16)  # resized: no check needed


# -- launcher reports and bench scale ---------------------------------------------------------


def _failure(tmp_path: Path, monkeypatch, rank: int, err: BaseException, exitcode: int) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise err
    except BaseException as e:  # noqa: BLE001  (recorded as torch's record() does)
        WorkerErrorHandler((ValueError,)).record_exception(e)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_first_failing_rank_is_reported_last_in_one_line(tmp_path, monkeypatch, capsys):
    first = _failure(tmp_path, monkeypatch, 1, ValueError("image data/x.jpg is truncated; re-export it"), 2)
    later = _failure(tmp_path, monkeypatch, 0, RuntimeError("[gloo] Connection closed by peer"), 1)
    code = report_failure({0: later, 1: first})
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == ["gputrain: error: rank 1: image data/x.jpg is truncated; re-export it"]
    crash = _failure(tmp_path, monkeypatch, 0, RuntimeError("boom"), 1)
    assert report_failure({0: crash}) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "gputrain: error: rank 0: RuntimeError: boom" and len(lines) <= 5


def test_bench_scale_cautions_where_efficiency_exceeds_one():
    rows = [ScaleRow(devices=1, batch_size=8, iters_per_epoch=4, train_time_s=1, startup_s=1, images_per_s=100),
            ScaleRow(devices=2, batch_size=8, iters_per_epoch=2, train_time_s=1, startup_s=1, images_per_s=250)]
    add_speedup(rows)
    assert rows[0].caution == "" and "above the 2 devices" in rows[1].caution
    table = markdown_table(rows)
    assert "| 2.50 (!) | 1.25 (!) |" in table and "efficiency above 1 is not possible" in table
    assert _error_line("noise\ngputrain: error: data.root=x does not exist\n") == "data.root=x does not exist"


def test_bench_scale_gives_every_row_the_same_threads_per_process_and_states_them(tmp_path):
    """Issue 15 item 10: unset OMP_NUM_THREADS gave 1 process all cores and N processes a share each."""
    assert threads_per_process([1, 2], cores=2, env={}) == 1  # the largest device count's share, for every row
    assert threads_per_process([1, 2, 4], cores=16, env={}) == 4
    assert threads_per_process([1, 2], cores=2, env={"OMP_NUM_THREADS": "3"}) == 3  # the user's choice is kept
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='x' must be a whole number"):
        threads_per_process([1], cores=2, env={"OMP_NUM_THREADS": "x"})
    threads = threads_per_process([1, 2], cores=8, env={})
    envs = [run_command("autoencoder", d, 8, epochs=2, out=tmp_path / str(d), accelerator="cpu", threads=threads,
                        overrides=["data.root=x"])[1] for d in (1, 2)]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["4", "4"]
    cmd, _ = run_command("autoencoder", 2, 8, epochs=2, out=tmp_path, accelerator="cpu", threads=4,
                         overrides=["data.root=x"])
    assert cmd[-1] == "data.root=x" and "--devices=2" in cmd  # the user's overrides come last and win
    rows = [ScaleRow(devices=1, batch_size=8, iters_per_epoch=4, train_time_s=1, startup_s=1, images_per_s=100,
                     threads=4),
            ScaleRow(devices=2, batch_size=8, iters_per_epoch=2, train_time_s=1, startup_s=1, images_per_s=250,
                     threads=4)]
    add_speedup(rows)
    table = markdown_table(rows).splitlines()
    assert table[0].startswith("| devices | threads per process |") and table[3].startswith("| 2 | 4 | 8 |")


def test_bench_scale_plot_marks_the_impossible_points_as_the_table_does(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [ScaleRow(devices=d, batch_size=b, iters_per_epoch=4, train_time_s=1, startup_s=1, images_per_s=ips,
                     threads=1) for d, b, ips in ((1, 8, 100), (2, 8, 250), (1, 16, 100), (2, 16, 150))]
    add_speedup(rows)
    assert plot(rows, tmp_path / "scale.png") == [(2, 8)]
    assert (tmp_path / "scale.png").stat().st_size > 1000
