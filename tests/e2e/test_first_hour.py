"""A user's first hour (issue 7), through the command line: items 1, 2 and 8 of the issue on one finished run.

Run folders (1), evaluation and export from the checkpoint alone (2) and strict JSON (8), as a user meets them. One
run with the default output folder, on a core install, serves every test that needs a finished run (the ``trained``
fixture); refusals are checked by calling ``gputrain.cli.main`` in this process (the same code path, without 5 s of
imports per command), runs, evaluation and export as real ``gputrain`` processes. Every check asserts the exit code,
the one line printed (never a traceback) and what is left on disk. The other items: test_first_hour_refusals.py
and test_first_hour_interrupts.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from first_hour import TINY, cli, gputrain, listing, make_workdir, one_error_line


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return make_workdir(tmp_path_factory.mktemp("first_hour"))


@pytest.fixture(scope="module")
def trained(workdir) -> tuple[Path, subprocess.CompletedProcess]:
    """One run with the default output folder, on a core install (no optional package importable)."""
    done = gputrain("train", "autoencoder", *TINY, cwd=workdir, core_only=workdir / "core_only")
    assert done.returncode == 0, done.stderr[-3000:]
    return (workdir / "runs" / "latest").resolve(), done


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- 1. run folders ---------------------------------------------------------------------------------


def test_1_and_11_default_run_gets_a_new_dated_folder_on_a_core_install(trained, workdir):
    run, done = trained
    assert "Traceback" not in done.stderr
    assert re.fullmatch(r"autoencoder-\d{8}-\d{6}", run.name)
    assert os.readlink(workdir / "runs" / "latest") == run.name  # relative: the runs folder can move
    assert {"config.yaml", "metrics.jsonl", "metrics.csv", "summary.json", "checkpoints"} <= {p.name for p in run.iterdir()}


def test_1_a_run_folder_in_use_is_refused_and_left_untouched(trained, workdir, capsys, monkeypatch):
    run, _ = trained
    monkeypatch.chdir(workdir)
    before = listing(run)
    for out in (str(run), "runs/latest"):
        code, _, err = cli(capsys, "train", "autoencoder", *TINY, "--out", out)
        line = one_error_line(err)
        assert code == 2 and "not empty" in line and "--resume auto" in line and "--overwrite" in line
    assert listing(run) == before


def test_1_overwrite_clears_the_old_run_first(trained, tmp_path, capsys, monkeypatch, workdir):
    run, _ = trained
    monkeypatch.chdir(workdir)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
    (copy / "metrics.jsonl").write_text('{"stale": 1}\n')
    code, _, err = cli(capsys, "train", "autoencoder", *TINY, "--out", str(copy), "--overwrite")
    assert code == 0 and "Traceback" not in err
    assert "stale" not in (copy / "metrics.jsonl").read_text()
    assert json.loads((copy / "summary.json").read_text())["epochs"] == 1


def test_1_a_runs_config_yaml_trains_again_as_a_recipe_into_a_new_folder(trained, capsys, monkeypatch, workdir):
    """issue 28 item 10: config.yaml carried trainer.out, so `gputrain train RUN/config.yaml` was sent back into the
    old run and refused. Planted fault: config.yaml written with where the run was started."""
    run, _ = trained
    monkeypatch.chdir(workdir)
    saved = (run / "config.yaml").read_text()
    assert saved.startswith("# The resolved config") and "out: ''" in saved and "resume: ''" in saved
    code, out, err = cli(capsys, "train", str(run / "config.yaml"), "trainer.progress_bar=false")
    assert code == 0, err
    again = Path(re.search(r"out=(\S+)", out).group(1))
    assert again.resolve() != run.resolve() and again.name.startswith("autoencoder-")
    assert (again / "config.yaml").read_text() == saved  # the same config, trained again


def test_1_overwrite_refuses_a_project_folder_and_removes_nothing(tmp_path, capsys, monkeypatch, workdir):
    """mkdir -p p/checkpoints p/data; train.py, data/a.csv: --overwrite deleted them (issue 28 item 1)."""
    monkeypatch.chdir(workdir)
    project = tmp_path / "p"
    (project / "checkpoints").mkdir(parents=True)
    (project / "data").mkdir()
    (project / "train.py").write_text("x\n")
    (project / "data" / "a.csv").write_text("y\n")
    (project / "checkpoints" / "other.ckpt").write_bytes(b"another tool's")
    (project / "config.yaml").write_text("lr: 0.1\n")
    before = listing(project)
    code, _, err = cli(capsys, "train", "autoencoder", *TINY, "--out", str(project), "--overwrite")
    assert code == 2 and "holds no gputrain run" in one_error_line(err)
    (project / ".gputrain").write_text("")  # even marked as a run, it holds files gputrain never wrote
    code, _, err = cli(capsys, "train", "autoencoder", *TINY, "--out", str(project), "--overwrite")
    line = one_error_line(err)
    assert code == 2 and "was not written by gputrain" in line and str(project / "checkpoints" / "other.ckpt") in line
    (project / ".gputrain").unlink()
    assert listing(project) == before


# -- 2. eval and export from the checkpoint alone ----------------------------------------------------


def test_2_eval_from_the_checkpoint_alone_uses_its_saved_model_options(trained, workdir):
    run, _ = trained
    done = gputrain("eval", "--checkpoint", str(run / "checkpoints" / "last.pt"), "--accelerator", "cpu", cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((run / "eval" / "eval.json").read_text())
    assert result["world_size"] == 1 and result["val/samples"] == 8


def test_2_export_from_the_checkpoint_alone(trained, workdir):
    run, _ = trained
    done = gputrain("export", "onnx", "--checkpoint", str(run / "checkpoints" / "last.pt"),
                    "--out", str(run / "model.onnx"), cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().rsplit("max abs diff", 1)[1]) < 1e-4
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(run / "model.onnx"), providers=["CPUExecutionProvider"])  # moved whole
    assert session.run(None, {"input": np.zeros((2, 3, 32, 32), np.float32)})[0].shape == (2, 3, 32, 32)
    assert not [p.name for p in run.iterdir() if p.name.startswith(".model.onnx")]  # no partial files


def test_2_a_model_that_does_not_fit_is_one_line_naming_the_field(trained, workdir, capsys, monkeypatch, tmp_path):
    run, _ = trained
    monkeypatch.chdir(workdir)
    checkpoint = str(run / "checkpoints" / "last.pt")
    for args in (("eval", "--checkpoint", checkpoint, "--out", str(tmp_path / "e")),
                 ("export", "onnx", "--checkpoint", checkpoint, "--out", str(tmp_path / "m.onnx"))):
        code, _, err = cli(capsys, *args, "model.kwargs.width=8")
        line = one_error_line(err)
        assert code == 2 and "0.weight is 4x3x3x3 in the checkpoint but 8x3x3x3" in line
        assert "model.kwargs.width=8 here but 4 in training" in line
    assert not (tmp_path / "e" / "eval.json").exists() and not (tmp_path / "m.onnx").exists()


def test_2_another_recipe_is_ignored_by_eval_and_export_never_merged_into_the_checkpoint(
        trained, workdir, capsys, monkeypatch, tmp_path):
    """Issue 15 item 3: cifar10-resnet18's model.kwargs (cifar_stem) used to reach the autoencoder's builder."""
    run, _ = trained
    monkeypatch.chdir(workdir)
    checkpoint = str(run / "checkpoints" / "last.pt")
    code, out, err = cli(capsys, "eval", "--checkpoint", checkpoint, "--out", str(tmp_path / "plain"))
    assert code == 0, err
    expected = json.loads((tmp_path / "plain" / "eval.json").read_text())
    ignored = (f"gputrain: eval ignores recipe cifar10-resnet18 (task=classification model.name=resnet18): "
               f"{checkpoint} was trained as task=autoencoder model.name=first_hour_models:tiny_ae, so it is used with the config "
               "saved in it; drop the recipe to silence this")
    for extra in ((), ("--overwrite",)):
        code, out, err = cli(capsys, "eval", "cifar10-resnet18", "--checkpoint", checkpoint,
                             "--out", str(tmp_path / "other"), *extra)
        assert code == 0, err
        assert ignored in out.splitlines() and "Traceback" not in err
        got = json.loads((tmp_path / "other" / "eval.json").read_text())
        assert got["val/loss"] == expected["val/loss"] and got["val/samples"] == expected["val/samples"]
    # The same task and model with other model options: the recipe says how to run, never what the model is.
    same = tmp_path / "same.yaml"
    same.write_text("task: autoencoder\nmodel:\n  name: first_hour_models:tiny_ae\n"
                    "  kwargs: {width: 16, not_an_option: 1}\ntrainer:\n"
                    "  eval_batch_size: 3\n")
    code, out, err = cli(capsys, "eval", str(same), "--checkpoint", checkpoint, "--out", str(tmp_path / "same"))
    assert code == 0, err
    got = json.loads((tmp_path / "same" / "eval.json").read_text())
    assert got["val/loss"] == pytest.approx(expected["val/loss"], rel=1e-6)  # batches of 3: another summation order
    assert got["val/samples"] == expected["val/samples"] and "ignores recipe" not in out
    code, out, err = cli(capsys, "export", "onnx", "cifar10-resnet18", "--checkpoint", checkpoint,
                         "--out", str(tmp_path / "m.onnx"), "--input-shape", "1,3,32,32")
    assert code == 0, err
    assert ignored.replace("eval ignores", "export ignores") in out.splitlines()
    assert (tmp_path / "m.onnx").is_file()


def test_2_and_6_a_truncated_checkpoint_is_named(trained, tmp_path, capsys, monkeypatch, workdir):
    run, _ = trained
    monkeypatch.chdir(workdir)
    truncated = tmp_path / "last.pt"
    truncated.write_bytes((run / "checkpoints" / "last.pt").read_bytes()[:3000])
    for args in (("eval", "--checkpoint", str(truncated)),
                 ("export", "onnx", "--checkpoint", str(truncated), "--out", str(tmp_path / "m.onnx")),
                 ("train", "autoencoder", *TINY, "--devices", "2", "--resume", str(truncated))):
        code, _, err = cli(capsys, *args)
        assert code == 2 and str(truncated) in one_error_line(err)


def test_2_a_python_api_checkpoint_says_what_it_needs_and_exports_from_python(tmp_path, capsys, cwd):
    from torch.utils.data import TensorDataset

    from gputrain import Trainer
    from gputrain.tools.export import export_model

    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(2, 3, 1))

    x = torch.rand(8, 3, 8, 8)
    Trainer(strategy="single", accelerator="cpu", epochs=1, batch_size=4, out=str(tmp_path / "py"),
            progress_bar=False, loggers=[]).fit(net(), TensorDataset(x, x), loss=torch.nn.functional.mse_loss)
    checkpoint = tmp_path / "py" / "checkpoints" / "last.pt"
    code, _, err = cli(capsys, "eval", "--checkpoint", str(checkpoint))
    assert code == 2 and "trained from Python with model torch.nn.modules.container:Sequential" in one_error_line(err)
    code, _, err = cli(capsys, "export", "onnx", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "m.onnx"))
    assert code == 2 and "export_model(model" in one_error_line(err)
    assert export_model(net(), checkpoint, tmp_path / "net.onnx", input_shape=[1, 3, 8, 8]) < 1e-4
    assert (tmp_path / "net.onnx").is_file()


# -- 8. strict JSON ---------------------------------------------------------------------------------


def test_8_metrics_and_summary_are_strict_json(trained):
    run, _ = trained

    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    json.loads((run / "summary.json").read_text(), parse_constant=refuse)


# -- 2, on a built-in recipe with a non-default model option ---------------------------------------


@pytest.mark.slow
def test_2_cifar10_resnet18_without_its_cifar_stem_evaluates_and_exports_from_the_checkpoint(tmp_path):
    from gputrain.tools.make_data import make_dataset

    make_dataset("cifar10", tmp_path / "data" / "cifar10", count=60)
    done = gputrain("train", "cifar10-resnet18", "--accelerator", "cpu", "--epochs", "1", "--batch-size", "10",
                    "--out", "runs/c10", "model.kwargs.cifar_stem=false", "trainer.progress_bar=false",
                    "trainer.max_steps_per_epoch=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = "runs/c10/checkpoints/last.pt"
    done = gputrain("eval", "--checkpoint", checkpoint, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "runs" / "c10" / "eval" / "eval.json").read_text())["val/samples"] == 10
    done = gputrain("export", "onnx", "--checkpoint", checkpoint, "--out", "runs/c10/model.onnx", cwd=tmp_path)
    assert done.returncode == 0 and (tmp_path / "runs" / "c10" / "model.onnx").is_file(), done.stderr[-3000:]
