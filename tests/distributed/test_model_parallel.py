"""model_parallel (one process, stages on several devices, micro-batches pipelined) computes what `single` does.

On this CPU-only machine both stages sit on the CPU: the split, the pipelined micro-batches, the
loss on concatenated outputs and the placement code all run; real copies between GPUs are
exercised by benchmarks/model_parallel_gpu.py where GPUs exist.

Exactness: without BatchNorm, a step's gradient does not depend on how the batch is cut, so the
reference is `single` with the same batch. With BatchNorm, each micro-batch is normalised by its
own statistics, so the reference is `single` with ``batch_size / M`` and ``accumulate_grad_batches
= M``: the same micro-batches, the same statistics, the same running-average updates in the same
order. Weights are compared relative to each tensor's scale (BatchNorm's running variance is in
the hundreds, where float32 holds about 5 significant digits).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.data import TensorDataset

from forked_cli import run_gputrain
from gputrain import Trainer
from gputrain.config import OptimConfig, ParallelConfig, RunConfig

TOL = 1e-5


def small_cnn() -> nn.Sequential:
    """No BatchNorm: the gradient of a step is independent of how its batch is cut."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 5))


def data(n: int, size: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.randint(0, 5, (n,), generator=g))


def fit(out: Path, model: nn.Module, train: TensorDataset, *, strategy: str, batch: int, accumulate: int = 1,
        parallel: ParallelConfig | None = None, epochs: int = 2, lr: float = 0.05, clip: float = 0.0) -> Trainer:
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=lr, momentum=0.9), parallel=parallel or ParallelConfig())
    trainer = Trainer(cfg, strategy=strategy, devices=1, accelerator="cpu", batch_size=batch,
                      accumulate_grad_batches=accumulate, epochs=epochs, out=str(out), progress_bar=False, loggers=[],
                      log_every_n_steps=1, grad_clip_norm=clip)
    trainer.fit(model, train, loss=F.cross_entropy)
    return trainer


def step_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "step" in r and "train/samples" not in r]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) / max(1.0, float(b[k].double().abs().max()))
               for k in a if a[k].is_floating_point())


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}


@pytest.mark.parametrize("partition", ["split_points", "measured"])
def test_small_cnn_matches_single_on_a_short_last_step(tmp_path, partition):
    # 37 samples at batch 8: the last step has 5, cut into micro-batches of 2, 2 and 1.
    train = data(37, 8)
    parallel = ParallelConfig(micro_batches=4, split_points=["2"] if partition == "split_points" else [])
    split = fit(tmp_path / "mp", small_cnn(), train, strategy="model_parallel", batch=8, parallel=parallel, clip=0.5)
    single = fit(tmp_path / "single", small_cnn(), train, strategy="single", batch=8, clip=0.5)
    assert max_rel_diff(weights(single), small_cnn().state_dict()) > 1e-3, "training must move the weights"
    assert len(step_losses(tmp_path / "mp")) == 10
    assert step_losses(tmp_path / "mp") == pytest.approx(step_losses(tmp_path / "single"), abs=TOL)
    assert max_rel_diff(weights(split), weights(single)) <= TOL
    # The checkpoint is the plain model's state_dict: it loads into the unmodified model.
    saved = torch.load(tmp_path / "mp" / "checkpoints" / "last.pt", weights_only=True)
    small_cnn().load_state_dict(saved["model"], strict=True)


@pytest.mark.slow
def test_resnet18_with_batchnorm_matches_single_accumulating_the_same_micro_batches(tmp_path):
    # 40 samples at batch 16 in micro-batches of 4: steps of 16, 16 and 8 (two micro-batches). 64x64
    # inputs keep layer4's BatchNorm at 4 values per channel and sample: with fewer, its normalisation
    # turns float rounding into visible differences within a few steps, in any two runs.
    train = data(40, 64)

    def resnet() -> nn.Module:
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=5)

    parallel = ParallelConfig(micro_batches=4, split_points=["layer3"])
    split = fit(tmp_path / "mp", resnet(), train, strategy="model_parallel", batch=16, parallel=parallel, epochs=1,
                lr=0.001)
    single = fit(tmp_path / "single", resnet(), train, strategy="single", batch=4, accumulate=4, epochs=1, lr=0.001)
    assert step_losses(tmp_path / "mp") == pytest.approx(step_losses(tmp_path / "single"), abs=TOL)
    assert max_rel_diff(weights(split), weights(single)) <= TOL
    saved = torch.load(tmp_path / "mp" / "checkpoints" / "last.pt", weights_only=True)
    torchvision.models.resnet18(num_classes=5).load_state_dict(saved["model"], strict=True)


# --- a model whose forward is not the chain of its children is refused before the first step (issue 15) ---
SKIPNET = '''
from torch import nn


class SkipNet(nn.Module):
    """stem -> body -> head as children, but forward adds a skip around body: not their chain."""

    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))

    def forward(self, x):
        h = self.stem(x)
        return self.head(h + self.body(h))


def build(num_classes: int = 4, **_):
    return SkipNet(num_classes)
'''


def skipnet() -> nn.Module:
    namespace: dict = {}
    exec(compile(SKIPNET, "skipnet.py", "exec"), namespace)
    torch.manual_seed(0)
    return namespace["build"](5)


def test_a_skip_connection_is_refused_in_one_line_before_any_step(tmp_path):
    model = skipnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"SkipNet do not compute its forward.*from block 'head' on.*nn\.Sequential") \
            as refused:
        fit(tmp_path / "mp", model, data(12, 8), strategy="model_parallel", batch=4,
            parallel=ParallelConfig(micro_batches=2, split_points=["body"]))
    assert "\n" not in str(refused.value)
    # Refused before the first step: weights and BatchNorm statistics are the model's own, in train mode.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and model.training
    assert not (tmp_path / "mp" / "checkpoints" / "last.pt").exists()


class FlattenInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 2, 3, padding=1), nn.Linear(2 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).flatten(1))


def test_children_that_cannot_be_chained_get_one_line_not_a_shape_error(tmp_path):
    with pytest.raises(ValueError, match=r"FlattenInForward cannot be split.*block 'fc' fails on the previous "
                                         r"block's output \(2, 2, 8, 8\)") as refused:
        fit(tmp_path / "mp", FlattenInForward(), data(8, 8), strategy="model_parallel", batch=4,
            parallel=ParallelConfig(micro_batches=2, split_points=["fc"]))
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def classfolder_8px(tmp_path_factory):
    """``gputrain data make classfolder --count 16 --size 8``, made in this process (the command's own test is
    elsewhere; here it would only cost a process start)."""
    from gputrain.tools.make_data import make_dataset

    return make_dataset("classfolder", tmp_path_factory.mktemp("data") / "data", count=16, size=8)


@pytest.mark.parametrize("strategy", ["model_parallel", "pipeline"])
def test_cli_refuses_a_user_model_that_is_not_its_chain(tmp_path, strategy, classfolder_8px):
    import os

    (tmp_path / "skipnet_user.py").write_text(SKIPNET)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = run_gputrain(["train", "resnet50-model-parallel", "--epochs", "1", "--batch-size", "4",
                        "--data-root", str(classfolder_8px), "--out", str(tmp_path / "run"),
                        "--devices", "2" if strategy == "pipeline" else "1", f"trainer.strategy={strategy}",
                        "model.name=skipnet_user:build", "parallel.split_points=[body]", "parallel.micro_batches=2",
                        "data.image_size=8", "data.num_classes=4"], env=env, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [line for line in (run.stdout + run.stderr).splitlines() if "SkipNet" in line]
    assert len(errors) == 1 and "from block 'head' on" in errors[0] and errors[0].startswith("gputrain: error:")
    assert "Traceback" not in run.stderr


class OverflowsInEval(nn.Module):
    """Finite in training; in eval mode its outputs overflow, as a barely trained ResNet-50's can."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x.flatten(1))
        return out if self.training else out * float("inf")


def test_a_non_finite_validation_metric_prints_one_warning_naming_it_and_the_epoch(tmp_path, capfd):
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=0.01))
    trainer = Trainer(cfg, strategy="single", devices=1, accelerator="cpu", batch_size=4, epochs=1,
                      out=str(tmp_path), progress_bar=False, loggers=[])
    torch.manual_seed(0)
    summary = trainer.fit(OverflowsInEval(), data(8, 8), data(8, 8), loss=F.cross_entropy)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "not finite" in line]
    assert not math.isfinite(summary["final"]["val/loss"])
    assert len(warnings) == 1 and warnings[0].startswith("gputrain: warning: val/loss=") and "after epoch 1" in warnings[0]
