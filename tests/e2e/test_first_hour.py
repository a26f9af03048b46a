"""A user's first hour (issue 7), through the command line: each numbered item of the issue, as a user meets it.

Refusals that happen before any training are checked by calling ``gputrain.cli.main`` in this
process (the same code path, without 5 s of imports per command); runs, evaluation, export and
everything with workers or signals are real ``gputrain`` processes. Every check asserts the exit
code, the one line printed (never a traceback) and what is left on disk.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gputrain.cli import main
from gputrain.data.imagefolder import make_frames

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
TINY = ("--devices", "1", "--accelerator", "cpu", "--epochs", "1", "--batch-size", "4", "trainer.progress_bar=false",
        "model.name=first_hour_models:tiny_ae", "model.kwargs.width=4")  # width 4: not the builder's default 8

MODELS = '''
from torch import nn

def tiny_ae(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, 3, 3, padding=1))
'''

# A core install (`pip install gputrain`, no extras), made here by hiding the optional packages from the
# path finder: find_spec returns None and imports fail exactly as for a package that is not installed.
CORE_ONLY = '''
import sys
from importlib.machinery import PathFinder

BLOCKED = {"tensorboard", "wandb", "onnx", "onnxruntime", "onnxscript", "pycocotools", "matplotlib"}


class _CoreOnly(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_CoreOnly if finder is PathFinder else finder for finder in sys.meta_path]
'''


def gputrain(*args: str, cwd: Path, core_only: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(ENV)
    if core_only is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(core_only), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "gputrain", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``gputrain ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("gputrain: error: "), err
    return lines[0]


def listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("first_hour")
    make_frames(root / "data" / "frames", count=16, size=32, videos=2)
    (root / "first_hour_models.py").write_text(MODELS)
    (root / "core_only").mkdir()
    (root / "core_only" / "sitecustomize.py").write_text(CORE_ONLY)
    return root


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


# -- 8. strict JSON ---------------------------------------------------------------------------------


def test_8_metrics_and_summary_are_strict_json(trained):
    run, _ = trained

    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    json.loads((run / "summary.json").read_text(), parse_constant=refuse)


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


# -- 3. interrupts (real processes and signals) -----------------------------------------------------


def _interrupt(workdir: Path, out: Path, devices: str, sig: signal.Signals, *, group: bool, epochs: int = 60):
    """Start a long run, send ``sig`` once the first epoch is logged; (exit code, stdout, stderr, seconds to exit)."""
    args = ["train", "autoencoder", *TINY, "--devices", devices, "--epochs", str(epochs), "--batch-size", "2",
            "--out", str(out), "trainer.loggers=[]"]
    proc = subprocess.Popen([sys.executable, "-m", "gputrain", *args], cwd=workdir, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("epoch 1:"):
            break
    sent = time.monotonic()
    os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)  # Ctrl-C reaches the whole group
    out, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + out, err, time.monotonic() - sent


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.mark.parametrize("devices, sig, group, code", [
    pytest.param("2", signal.SIGINT, True, 130, marks=pytest.mark.slow),
    # In the fast tier: the ranks run in sessions of their own, so the launcher's forwarding is the only way
    # a signal sent to it reaches them.
    ("2", signal.SIGTERM, False, 143),
    pytest.param("1", signal.SIGINT, True, 130, marks=pytest.mark.slow),
])
def test_3_an_interrupt_stops_cleanly_with_one_line(workdir, tmp_path, devices, sig, group, code):
    out = tmp_path / "run"
    rc, stdout, stderr, _ = _interrupt(workdir, out, devices, sig, group=group)
    interrupted = [line for line in stdout.splitlines() if line.startswith("interrupted at epoch")]
    assert rc == code and len(interrupted) == 1, (stdout, stderr)
    assert f"--resume auto --out {out}" in interrupted[0]
    assert "Traceback" not in stderr and stderr.strip() == "", stderr
    assert (out / "checkpoints" / "last.pt").is_file()


@pytest.mark.slow
def test_3_resume_after_ctrl_c_ends_with_the_uninterrupted_weights(workdir, tmp_path):
    out = tmp_path / "interrupted"
    # 12 epochs: the signal goes out as soon as epoch 1 is logged, seconds before the run could end (which
    # would fail the exit code check), and the resumed and uninterrupted runs stay short.
    rc, _, stderr, _ = _interrupt(workdir, out, "2", signal.SIGINT, group=True, epochs=12)
    assert rc == 130, stderr
    common = ("train", "autoencoder", *TINY, "--devices", "2", "--epochs", "12", "--batch-size", "2",
              "trainer.loggers=[]")
    resumed = gputrain(*common, "--resume", "auto", "--out", str(out), cwd=workdir)
    straight = gputrain(*common, "--out", str(tmp_path / "straight"), cwd=workdir)
    assert resumed.returncode == 0 and straight.returncode == 0, resumed.stderr + straight.stderr
    a, b = _weights(out / "checkpoints" / "last.pt"), _weights(tmp_path / "straight" / "checkpoints" / "last.pt")
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-7)


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
