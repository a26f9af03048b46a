"""data.synthetic and `gputrain bench throughput`: shapes of synthetic batches, and the JSON a user scripts against."""

from __future__ import annotations

import json
import os

import torch

from gputrain.config import load_config
from gputrain.data.synthetic import DeviceResidentSamples
from gputrain.tasks import build_task
from gputrain.tools.make_data import make_dataset

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def _make(kind: str, out, count: int) -> None:
    """``gputrain data make KIND`` in this process: the command's function, without its seconds of imports."""
    make_dataset(kind, out, count=count)


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


def test_bench_throughput_prints_a_table_and_writes_the_json_keys(tmp_path, capsys, monkeypatch):
    from gputrain.cli import main

    _make("imagefolder", tmp_path / "frames", 48)
    # The command in this process (gputrain.cli.main, without a new interpreter's imports); its two training runs
    # are still real gputrain processes, which inherit this environment as they would the command's.
    for key in ("OMP_NUM_THREADS", "WANDB_SILENT"):
        monkeypatch.setenv(key, ENV[key])
    capsys.readouterr()
    code = main(["bench", "throughput", "autoencoder", "--data-root", str(tmp_path / "frames"), "--out",
                 str(tmp_path / "out"), "--json", str(tmp_path / "t.json"), "--epochs", "2", "trainer.batch_size=8"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    result = json.loads((tmp_path / "t.json").read_text())
    for key in ("train_images_per_s", "synthetic_train_images_per_s", "input_bound_ratio", "peak_memory_bytes"):
        assert result[key] > 0, key
    assert result["input_bound_ratio"] == result["train_images_per_s"] / result["synthetic_train_images_per_s"]
    assert result["flops_per_image"] > 1e6 and result["eval_images_per_s"] > 0
    assert "| input-bound ratio (real / synthetic) |" in stdout
    assert "synthetic: true" in (tmp_path / "out" / "synthetic" / "config.yaml").read_text()
    assert "synthetic: false" in (tmp_path / "out" / "real" / "config.yaml").read_text()


def test_flops_are_counted_on_the_float_image_and_nothing_is_written_where_the_command_runs(tmp_path, monkeypatch):
    from gputrain.data.classfolder import make_classfolder
    from gputrain.data.coco_sample import make_coco
    from gputrain.tools.bench.throughput import flops_per_image

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
        served = torch.cat([x for x, _ in t.loop.train_loader])  # one more epoch's batches, as the loop gets them
        assert len(served) == n and all(any(torch.equal(row, real) for real in data.x[:kept]) for row in served)
        assert {int(row[0]) // 4 for row in served} == set(range(kept))  # every kept sample is served


def _records(windows_by_epoch: list[list[float]]) -> list[dict]:
    """metrics.jsonl of a run: step records (one per window) then the epoch's record, epoch by epoch."""
    records, step = [], 0
    for epoch, windows in enumerate(windows_by_epoch, start=1):
        for value in windows:
            step += 5
            records.append({"epoch": epoch - 1, "step": step, "train/loss": 1.0, "train/images_per_s": value})
        records.append({"epoch": epoch, "step": step, "train/loss": 1.0, "time/train_s": 1.0,
                        "train/images_per_s": sum(windows) / len(windows), "time/epoch_s": 1.0})
    return records


def test_throughput_is_the_median_of_the_windows_after_the_first_epoch():
    """issue 28 item 6: with two timed epochs the "median" was the larger one. Planted faults: the first epoch's
    windows are counted; the upper middle value stands for the median."""
    from gputrain.tools.bench.throughput import steady

    records = _records([[1.0, 1.0, 1.0], [10.0, 20.0], [30.0, 40.0]])  # the first epoch (warm-up) is not timed
    assert steady(records, "train/images_per_s") == (25.0, 4)
    assert steady(_records([[4.0, 8.0]]), "train/images_per_s") == (6.0, 2)  # one epoch: nothing else to time


def test_impossible_or_rough_figures_come_with_a_caution_saying_why(tmp_path):
    from gputrain.tools.bench.throughput import Throughput, cautions, table

    result = Throughput(recipe="r", device="cpu", precision="32", batch_size=8, train_images_per_s=103.0,
                        synthetic_train_images_per_s=10.0, input_bound_ratio=10.3, eval_images_per_s=None,
                        flops_per_image=None, model_flops_utilisation=None, peak_memory_bytes=1, compile_s=None)
    lines = cautions(result, (12, 3))
    assert len(lines) == 2
    assert lines[0].startswith("input-bound ratio 10.30 is above 1: real data ran faster than samples already on "
                               "the device") and "busy" in lines[0]
    assert lines[1].startswith("only synthetic 3 timed window(s) of 5 steps after the first epoch")
    assert "| input-bound ratio (real / synthetic) | 10.30 (!) |" in table(result)
    result.input_bound_ratio = 0.49
    assert cautions(result, (5, 5)) == [] and "| 0.49 |" in table(result)


def test_bench_folders_are_named_for_their_benchmark(tmp_path, monkeypatch):
    """Its runs landed in runs/scale-* (issue 28 item 6)."""
    from gputrain.tools.bench.scale import _out_folder

    monkeypatch.chdir(tmp_path)
    assert _out_folder(None, False, "throughput").parent.resolve() == tmp_path.resolve() / "runs"
    assert _out_folder(None, False, "throughput").name.startswith("throughput-")
    assert (_out_folder(None, False, "scale") / ".gputrain").is_file()  # marked: --overwrite may clear it later
