"""A user's first hour (issue 7), through the command line: what is refused, and how (items 4 to 7, 10 and 11).

Nonsense values (4), precision that cannot help (5), one line instead of a traceback (6), multi-process runs that
fail early and quietly (7), ``--version`` and ``--help`` (10) and a core install's missing extras (11). Refusals
that happen before any training are checked by calling ``gputrain.cli.main`` in this process (the same code path,
without 5 s of imports per command); runs and everything with workers are real ``gputrain`` processes. Every check
asserts the exit code, the one line printed (never a traceback) and what is left on disk.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from first_hour import TINY, cli, gputrain, make_workdir, one_error_line
from gputrain.cli import main


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("first_hour"))


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- 4. nonsense ------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, flag", [
    (("train", "autoencoder", "--devices", "0"), "--devices 0"),
    (("train", "autoencoder", "--devices", "-1"), "--devices -1"),
    (("train", "autoencoder", "--epochs", "0"), "--epochs 0"),
    (("train", "autoencoder", "--epochs", "-3"), "--epochs -3"),
    (("train", "autoencoder", "--batch-size", "0"), "--batch-size 0"),
    (("train", "autoencoder", "trainer.epochs=0"), "trainer.epochs=0"),
    (("data", "make", "imagefolder", "--out", "data/x", "--count", "-5"), "--count -5"),
    (("data", "make", "imagefolder", "--out", "data/x", "--size", "0"), "--size 0"),
])
def test_4_nonsense_is_refused_before_anything_is_written(args, flag, capsys, cwd):
    code, _, err = cli(capsys, *args)
    assert code == 2 and flag in one_error_line(err)
    assert list(cwd.iterdir()) == []  # no run folder, no data folder


def test_4_dp_with_devices_says_how_many_devices_it_uses(capsys, cwd):
    code, out, err = cli(capsys, "train", "cifar10-resnet18", "--devices", "2", "--accelerator", "cpu")
    assert "strategy dp runs 1 process per node, so --devices 2 starts no more processes" in out
    assert "on a CPU it uses one device" in out
    assert code == 2 and "data.root=data/cifar10 does not exist" in one_error_line(err)  # found before any worker


# -- 5. precision that cannot help ------------------------------------------------------------------


def test_5_a_recipe_16_bit_default_falls_back_on_cpu_and_an_explicit_one_warns(workdir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    recipe = tmp_path / "half.yaml"
    recipe.write_text("task: autoencoder\ntrainer:\n  precision: 16-mixed\n  loggers: []\n")
    code, out, err = cli(capsys, "train", str(recipe), *TINY, "--out", str(tmp_path / "a"))
    assert code == 0 and "precision 16-mixed (from the recipe) falls back to 32 on a CPU" in out
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["precision"] == "32"
    code, out, err = cli(capsys, "train", str(recipe), *TINY, "--out", str(tmp_path / "b"), "--precision", "16-mixed")
    assert code == 0 and "warning: precision 16-mixed on a CPU" in err and "Traceback" not in err
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["precision"] == "16-mixed"


# -- 6. one line instead of a traceback -------------------------------------------------------------


def test_6_yaml_syntax_error_and_out_that_is_a_file(capsys, cwd):
    (cwd / "mine.yaml").write_text("task: autoencoder\ntrainer:\n  epochs: 2\n  loggers: [csv\n")
    code, _, err = cli(capsys, "train", "mine.yaml")
    assert code == 2 and "recipe mine.yaml line 5" in one_error_line(err)
    (cwd / "notes.txt").write_text("mine")
    (cwd / "data" / "frames").mkdir(parents=True)
    code, _, err = cli(capsys, "train", "autoencoder", "--out", "notes.txt")
    assert code == 2 and "--out notes.txt is a file" in one_error_line(err)
    assert (cwd / "notes.txt").read_text() == "mine"


def test_6_images_of_different_sizes_name_the_first_odd_file(workdir, tmp_path, capsys, monkeypatch):
    from torchcodec.encoders import PngEncoder

    monkeypatch.chdir(workdir)
    data = tmp_path / "frames"
    subprocess.run(["cp", "-r", str(workdir / "data" / "frames"), str(data)], check=True)
    odd = data / "video_01" / "odd.png"
    PngEncoder(torch.zeros(3, 24, 24, dtype=torch.uint8)).to_file(odd)
    code, _, err = cli(capsys, "train", "autoencoder", *TINY, "--data-root", str(data), "--out", str(tmp_path / "r"))
    line = one_error_line(err)
    assert code == 2 and str(odd) in line and "24x24" in line and "32x32" in line and "data.image_size" in line


def test_6_a_failing_run_inside_bench_scale_is_named(capsys, cwd):
    (cwd / "empty").mkdir()  # exists (a missing folder is refused before any run), but holds no images
    code, _, err = cli(capsys, "bench", "scale", "autoencoder", "--devices", "1", "--batch-size", "4",
                       "--accelerator", "cpu", "--out", "scale", "data.root=empty")
    line = one_error_line(err)
    assert code == 2 and "--devices 1 --batch-size 4 failed (exit 2)" in line and "empty" in line


# -- 7. multi-process runs: early and quiet ---------------------------------------------------------


def test_7_a_missing_data_root_is_found_before_workers_start(capsys, cwd):
    code, _, err = cli(capsys, "train", "autoencoder", "--devices", "2", "--data-root", "missing/frames")
    line = one_error_line(err)
    assert code == 2 and "data.root=missing/frames does not exist" in line and "rank" not in line
    assert not (cwd / "runs").exists()


@pytest.mark.slow
def test_7_the_first_failing_rank_is_printed_last_without_the_others_noise(workdir, tmp_path):
    data = tmp_path / "frames"
    subprocess.run(["cp", "-r", str(workdir / "data" / "frames"), str(data)], check=True)
    victim = sorted(data.rglob("*.jpg"))[0]
    raw = victim.read_bytes()
    victim.write_bytes(raw[: int(len(raw) * 0.9)])  # the header reads; decoding fails on the rank that reads it
    done = gputrain("train", "autoencoder", *TINY, "--devices", "2", "--data-root", str(data),
                    "--out", str(tmp_path / "run"), "data.val_fraction=0", cwd=workdir)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and re.match(r"gputrain: error: rank [01]: image .*truncated", last) and str(victim) in last
    assert "Traceback" not in done.stderr and "Connection closed" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 5


def _coco_log_lines(dist_info, root: str) -> int:
    import logging

    from gputrain.data.coco import COCODetection

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("gputrain.data.coco").addHandler(handler)
    COCODetection(Path(root) / "images", Path(root) / "annotations" / "instances.json", train=True)
    return sum("kept" in r.getMessage() for r in records)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")
def test_7_coco_kept_line_is_printed_once_per_job(tmp_path):
    from gputrain.data.coco_sample import make_coco
    from multiproc import run_ranks

    make_coco(tmp_path / "coco", num_images=6, size=48)
    assert run_ranks(_coco_log_lines, str(tmp_path / "coco")) == [1, 0]


# -- 10. small things -------------------------------------------------------------------------------


def test_10_version_and_help_describe_the_tool(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and re.match(r"gputrain \d+\.\d+\.\d+ \(torch ", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "trains vision models" in text and "example" in text and "docs/cli.md" in text
    assert all(c in text for c in ("train RECIPE", "eval [RECIPE]", "export onnx", "data make", "bench scale"))
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "--checkpoint" in text and not any(f in text for f in ("--epochs", "--seed", "--resume", "--max-restarts"))


# -- 11. a core install -----------------------------------------------------------------------------


@pytest.mark.parametrize("args, extra", [
    (("train", "autoencoder", *TINY, "trainer.loggers=[csv,tensorboard]"), "loggers"),
    (("export", "onnx", "--checkpoint", "whatever.pt", "--out", "m.onnx"), "export"),
    pytest.param(("train", "autoencoder", *TINY, "--devices", "2", "trainer.loggers=[wandb]"), "loggers",
                 marks=pytest.mark.slow),
    pytest.param(("train", "coco-maskrcnn", "--accelerator", "cpu"), "coco", marks=pytest.mark.slow),
])
def test_11_a_missing_optional_package_names_the_extra(args, extra, workdir, tmp_path):
    done = gputrain(*args, cwd=tmp_path, core_only=workdir / "core_only")
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and f"pip install 'gputrain[{extra}]'" in line
    assert not (tmp_path / "runs").exists()
