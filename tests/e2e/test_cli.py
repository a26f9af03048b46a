"""The command line end to end, with real torchrun workers: outputs, logging from rank 0 only, export, scaling."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from forked_cli import run_gputrain
from gputrain.data.imagefolder import make_frames

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def gputrain(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = run_gputrain(args, env=ENV)
    if check and done.returncode != 0:
        raise AssertionError(f"gputrain {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done


def gputrain_here(capsys: pytest.CaptureFixture[str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``gputrain`` run in this process (``gputrain.cli.main``, what the command runs, without a new interpreter's
    seconds of imports): for the one-process commands, whose promises are not about processes. Multi-rank runs stay
    real ``gputrain`` processes with real torchrun workers (``gputrain``)."""
    from gputrain.cli import main

    capsys.readouterr()  # only this command's output
    code = main(list(args))
    out, err = capsys.readouterr()
    done = subprocess.CompletedProcess(["gputrain", *args], code, out, err)
    if check and code != 0:
        raise AssertionError(f"gputrain {' '.join(args)} failed:\n{out[-2000:]}\n{err[-4000:]}")
    return done


@pytest.fixture(scope="module")
def frames(tmp_path_factory) -> Path:
    return make_frames(tmp_path_factory.mktemp("data") / "frames", count=48, size=40, videos=2)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, frames) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("runs") / "ddp2"
    done = gputrain("train", "autoencoder", "--devices", "2", "--accelerator", "cpu", "--epochs", "2",
                    "--batch-size", "8", "--data-root", str(frames), "--out", str(out),
                    "trainer.loggers=[csv,tensorboard,wandb]", "trainer.log_every_n_steps=1")
    return out, done


def test_two_rank_run_writes_one_set_of_outputs(two_rank_run):
    out, done = two_rank_run
    assert "global_batch=16" in done.stdout
    assert done.stdout.count("epoch 1:") == 1  # printed by rank 0 only
    assert sorted(p.name for p in out.glob("*.jsonl")) == ["metrics.jsonl"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in lines if "event" in r] == ["pace"]  # the run's first steps' pace, once (rank 0)
    records = [r for r in lines if "event" not in r]
    epochs = [r for r in records if "val/loss" in r]
    steps = [r for r in records if "val/loss" not in r]
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert all({"epoch", "step", "train/loss"} <= r.keys() for r in records)
    # 24 training images over 2 ranks x batch 8 -> 2 steps per epoch, each logged once (not once per rank)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert epochs[-1]["val/samples"] == 24  # every validation image exactly once
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["global_batch"], summary["batch_size_per_device"]) == (2, 16, 8)
    assert summary["iters_per_epoch"] == {"train": 2, "val": 2, "total": 4}
    assert "trainer:" in (out / "config.yaml").read_text()
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert len(list((out / "wandb").glob("wandb/offline-run-*"))) == 1
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["epoch", "step", "train/loss"]


def test_checkpoints_are_unwrapped_and_complete(two_rank_run):
    out, _ = two_rank_run
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "precision", "state", "rng", "config"} <= state.keys()
    assert state["state"]["epoch"] == 2 and state["world_size"] == 2
    assert not any(k.startswith("module.") for k in state["model"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["epoch_0001.pt", "epoch_0002.pt", "last.pt",
                                                                       "manifest.json"]


def test_export_onnx_matches_pytorch(two_rank_run, tmp_path, capsys):
    out, _ = two_rank_run
    done = gputrain_here(capsys, "export", "onnx", "--checkpoint", str(out / "checkpoints" / "last.pt"),
                         "--out", str(tmp_path / "ae.onnx"))
    assert (tmp_path / "ae.onnx").stat().st_size > 1000
    diff = float(done.stdout.strip().rsplit("max abs diff", 1)[1])
    assert diff < 1e-4


def test_resume_auto_continues_the_run(two_rank_run, frames, tmp_path, capsys):
    out, _ = two_rank_run
    run = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(out), str(run)], check=True)
    done = gputrain_here(capsys, "train", "autoencoder", "--devices", "1", "--accelerator", "cpu", "--epochs", "3",
                         "--batch-size", "16", "--data-root", str(frames), "--out", str(run), "--resume", "auto")
    assert "epoch 3:" in done.stdout and "epoch 1:" not in done.stdout
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert state["state"]["epoch"] == 3
    import csv

    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["epoch"] for r in rows if r.get("val/loss")] == ["1", "2", "3"]  # history kept across the resume
    two_rank = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert sorted(two_rank["rng"]) == ["0", "1"]  # each rank's generators, so each resumes its own


def test_corrupt_image_error_names_the_file(frames, tmp_path, capsys):
    data = tmp_path / "frames"
    subprocess.run(["cp", "-r", str(frames), str(data)], check=True)
    victim = sorted(data.rglob("*.jpg"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    done = gputrain_here(capsys, "train", "autoencoder", "--accelerator", "cpu", "--epochs", "1", "--data-root",
                         str(data), "--out", str(tmp_path / "run"), "data.val_fraction=0.0", "--strategy", "single",
                         check=False)
    assert done.returncode != 0
    assert str(victim) in done.stderr


def test_bad_override_is_refused_with_the_field_name(tmp_path):
    done = gputrain("train", "autoencoder", "trainer.epochs=many", "--out", str(tmp_path), check=False)
    assert done.returncode == 2 and "trainer.epochs" in done.stderr


@pytest.mark.slow  # four training jobs (~20 s)
def test_bench_scale_writes_table_json_and_plot(frames, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as ENV gives a command: the jobs inherit this process's environment
    done = gputrain_here(capsys, "bench", "scale", "autoencoder", "--devices", "1,2", "--batch-size", "8",
                         "--epochs", "2", "--accelerator", "cpu", "--out", str(tmp_path), f"data.root={frames}")
    rows = json.loads((tmp_path / "scale.json").read_text())
    assert [(r["devices"], r["batch_size"], r["iters_per_epoch"]) for r in rows] == [(1, 8, 6), (2, 8, 4)]
    assert rows[0]["speedup"] == 1.0 and rows[1]["efficiency"] == pytest.approx(rows[1]["speedup"] / 2)
    assert (tmp_path / "scale.png").stat().st_size > 1000
    assert "| devices | threads per process | batch size (per device) | iters per epoch (train + val) |" in done.stdout
    assert [r["threads"] for r in rows] == [1, 1]  # OMP_NUM_THREADS=1 is kept, the same in both rows
