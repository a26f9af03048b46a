"""data.synthetic and `gputrain bench throughput`: shapes of synthetic batches, and the JSON a user scripts against."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from gputrain.config import load_config
from gputrain.data.synthetic import DeviceResidentSamples
from gputrain.tasks import build_task

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def _make(kind: str, out, count: int) -> None:
    done = subprocess.run([sys.executable, "-m", "gputrain", "data", "make", kind, "--out", str(out), "--count",
                           str(count)], capture_output=True, text=True, env=ENV)
    assert done.returncode == 0, done.stderr


def _flat(sample):
    if isinstance(sample, torch.Tensor):
        return [(tuple(sample.shape), sample.dtype)]
    if isinstance(sample, dict):
        return [x for k in sorted(sample) for x in _flat(sample[k])]
    if isinstance(sample, (list, tuple)):
        return [x for v in sample for x in _flat(v)]
    return [type(sample)]


def test_synthetic_samples_have_the_recipes_shapes_and_dtypes(tmp_path):
    for recipe, kind in (("autoencoder", "imagefolder"), ("cifar10-resnet18", "cifar10"),
                         ("ade20k-deeplabv3plus", "ade20k")):
        _make(kind, tmp_path / kind, 24)
        spec = build_task(load_config(recipe, [f"data.root={tmp_path / kind}", "data.image_size=64"]
                                      if kind == "ade20k" else [f"data.root={tmp_path / kind}"]))
        synthetic = DeviceResidentSamples(spec.train_data, torch.device("cpu"))
        assert len(synthetic) == len(spec.train_data)
        for index in (0, 3, len(synthetic) - 1):
            assert _flat(synthetic[index]) == _flat(spec.train_data[index % 8]), recipe


def test_bench_throughput_prints_a_table_and_writes_the_json_keys(tmp_path):
    _make("imagefolder", tmp_path / "frames", 48)
    done = subprocess.run([sys.executable, "-m", "gputrain", "bench", "throughput", "autoencoder", "--data-root",
                           str(tmp_path / "frames"), "--out", str(tmp_path / "out"), "--json", str(tmp_path / "t.json"),
                           "--epochs", "2", "trainer.batch_size=8"], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "t.json").read_text())
    for key in ("train_images_per_s", "synthetic_train_images_per_s", "input_bound_ratio", "peak_memory_bytes"):
        assert result[key] > 0, key
    assert result["input_bound_ratio"] == result["train_images_per_s"] / result["synthetic_train_images_per_s"]
    assert result["flops_per_image"] > 1e6 and result["eval_images_per_s"] > 0
    assert "| input-bound ratio (real / synthetic) |" in done.stdout
    assert "synthetic: true" in (tmp_path / "out" / "synthetic" / "config.yaml").read_text()
    assert "synthetic: false" in (tmp_path / "out" / "real" / "config.yaml").read_text()


def test_flops_are_counted_on_the_float_image_and_nothing_is_written_where_the_command_runs(tmp_path, monkeypatch):
    from gputrain.data.classfolder import make_classfolder
    from gputrain.data.coco_sample import make_coco
    from gputrain.tools.throughput import flops_per_image

    classes = make_classfolder(tmp_path / "classes", classes=2, per_class=4, size=32, seed=0)
    coco = make_coco(tmp_path / "coco", num_images=6, size=64)
    monkeypatch.chdir(tmp_path / "classes")
    common = [f"data.root={classes}", "data.image_size=32", "model.name=resnet18"]
    usual = flops_per_image("imagefolder-resnet50", common)
    assert usual and usual > 1e6  # at 32x32 the last maps are 1x1: counted on two images, reported per image
    for option in ("data.normalize_on_device=true", "data.decode_on_device=true"):  # uint8 or bytes in workers
        assert flops_per_image("imagefolder-resnet50", [*common, option]) == usual
    assert flops_per_image("coco-maskrcnn", [f"data.root={coco}"]) is None  # structured inputs: not counted
    assert sorted(p.name for p in (tmp_path / "classes").iterdir()) == ["circle", "square"]  # no splits/ here


def test_synthetic_training_serves_every_index_from_the_first_eight_real_samples(tmp_path):
    """docs/performance.md: with data.synthetic=true the first 8 real samples are read once and served for every index,
    so the input pipeline is out of the measurement. In one process, no workers: each read of the dataset is seen.
    Planted faults: the loader ignores data.synthetic (every sample read each epoch); one sample kept instead of 8."""
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import Dataset

    from gputrain import Trainer
    from gputrain.config import DataConfig, RunConfig

    class Counted(Dataset):
        def __init__(self, n: int) -> None:
            self.x, self.reads = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4), []

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, index: int):
            self.reads.append(index)
            return self.x[index], self.x[index].sum(0, keepdim=True)

    for n, kept in ((24, 8), (5, 5)):  # min(8, N) real samples
        data = Counted(n)
        t = Trainer(RunConfig(data=DataConfig(synthetic=True)), strategy="single", accelerator="cpu",
                    progress_bar=False, loggers=[], batch_size=4, epochs=2, out=str(tmp_path / str(n)),
                    enable_checkpointing=False)
        t.fit(nn.Linear(4, 1), data, loss=F.mse_loss)
        assert data.reads == list(range(kept)), f"N={n}: indices read"  # the first min(8, N) once, nothing else
        assert t.state.samples_seen == 2 * n  # every index of both epochs was trained on
        served = torch.cat([x for x, _ in t.train_loader])  # one more epoch's batches, as the loop gets them
        assert len(served) == n and all(any(torch.equal(row, real) for real in data.x[:kept]) for row in served)
        assert {int(row[0]) // 4 for row in served} == set(range(kept))  # every kept sample is served
