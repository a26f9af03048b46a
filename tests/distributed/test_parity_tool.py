"""``gputrain parity`` with real processes: it passes where the modes agree and names the cause where they do not.

The planted faults are user code (models, datasets, a hook) defined here; the parity workers import
this module by name, as they would import a user's ``package.module:function``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain.cli import main
from gputrain.config import load_config
from gputrain.data.imagefolder import make_frames
from gputrain.engine.hooks import Hook
from gputrain.tasks.base import Task
from gputrain.tasks.spec import TaskSpec
from gputrain.tools.diagnose.parity import build_from_config, check_parity
from gputrain.tools.make_data import make_dataset

pytestmark = pytest.mark.slow


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 3, 8, 8, generator=g)
    return TensorDataset(x, (x.mean((1, 2, 3)) > 0.5).long())


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(F.relu(self.bn(self.conv(x))), 1).flatten(1))


class RankDropNet(nn.Module):
    """Rank 1 skips ``extra``: the planted fault of a forward pass that depends on the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.extra, self.head = nn.Linear(192, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x.flatten(1)))
        if not (dist.is_initialized() and dist.get_rank() == 1):
            h = h + self.extra(h)
        return self.head(h)


def build_mlp() -> TaskSpec:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    return TaskSpec(task=Task(F.mse_loss), model=nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
                    train_data=TensorDataset(x, x.sum(1, keepdim=True)), val_data=None)


def build_bn() -> TaskSpec:
    return TaskSpec(task=Task(F.cross_entropy), model=BNNet(), train_data=_data(), val_data=None)


def build_rank_drop() -> TaskSpec:
    return TaskSpec(task=Task(F.cross_entropy), model=RankDropNet(), train_data=_data(), val_data=None)


class NoSetEpoch(Hook):
    """Planted fault: the training sampler's set_epoch becomes a no-op, as in a strategy that forgets it (in this
    mode's process only, put back when the mode ends)."""

    def before_fit(self, ctx) -> None:
        from gputrain.data.samplers import StepBatchSampler

        self.real = StepBatchSampler.set_epoch
        StepBatchSampler.set_epoch = lambda *args, **kwargs: None  # type: ignore[method-assign]

    def after_fit(self, ctx, summary) -> None:
        from gputrain.data.samplers import StepBatchSampler

        StepBatchSampler.set_epoch = self.real  # type: ignore[method-assign]

    on_exception = after_fit  # type: ignore[assignment]


def tiny_config(recipe: str, folder) -> tuple:
    """(config, global batch) of a built-in recipe shrunk for parity on CPU, with its generated data in ``folder``.

    benchmarks/tools_time.py imports this, so its figures describe what these tests run.
    """
    if recipe == "autoencoder":
        data = make_frames(folder / "frames", count=32, size=40, videos=2)  # ConvAutoencoder: sides of 20k
        return load_config(recipe, [f"data.root={data}", "trainer.accelerator=cpu"]), 4
    if recipe == "cifar10-resnet18":
        data = make_dataset("cifar10", folder / "cifar10", count=120)
        return load_config(recipe, [
            f"data.root={data}", "trainer.accelerator=cpu",
            "model.kwargs.cifar_stem=false",  # 16x fewer FLOPs; the stem is not what parity compares
            "trainer.sync_batchnorm=true",  # plain BatchNorm differs across ranks by design (another test)
            "optim.scale_lr=linear", "optim.reference_batch=128",  # the recipe's lr is for batch 128
        ]), 8
    raise ValueError(recipe)


def _row(report, mode):
    return next(r for r in report.rows if r.mode == mode)


def test_parity_passes_on_the_tiny_autoencoder_recipe(tmp_path, capsys):
    frames = make_frames(tmp_path / "frames", count=32, size=40, videos=2)  # ConvAutoencoder: sides of 20k
    code = main(["parity", "autoencoder", f"data.root={frames}", "trainer.batch_size=4", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()}
    for mode in ("ddp", "accumulation", "dp"):
        assert lines[mode].rstrip().endswith("PASS"), out
    assert out.rstrip().endswith("PASS")


def test_parity_passes_on_a_tiny_resnet18_classifier(tmp_path):
    cfg, g = tiny_config("cifar10-resnet18", tmp_path)
    report = check_parity(functools.partial(build_from_config, cfg), cfg, modes=["ddp", "accumulation", "dp"],
                          global_batch=g)
    assert not report.failed, report.format()
    assert _row(report, "ddp").status == "PASS" and _row(report, "ddp").bn_ranks == "agree", report.format()
    assert _row(report, "dp").status == "PASS"
    # BatchNorm over micro-batches of 4 cannot equal BatchNorm over 8: reported, not failed.
    assert _row(report, "accumulation").status in ("PASS", "WARN")


def test_parity_at_16_mixed_passes_modes_whose_loss_scaler_skipped_the_same_steps():
    """16-mixed's first steps are skipped while the scale settles (no loss logged for them): the same steps in both
    modes are equal, not NaN against NaN. Planted fault: any NaN in a mode's losses fails it."""
    from gputrain.config import OptimConfig, RunConfig, TrainerConfig

    cfg = RunConfig(trainer=TrainerConfig(precision="16-mixed", batch_size=8), optim=OptimConfig(name="sgd", lr=0.01))
    report = check_parity(build_mlp, cfg, modes=["accumulation"], global_batch=8, steps=4, epochs=1, dtype="float32")
    row = _row(report, "accumulation")
    assert not report.failed and row.status == "PASS", report.format()
    assert any(loss != loss for loss in row.losses), "no step was skipped: the test no longer covers skipped steps"


def test_parity_names_unsynced_batchnorm():
    cfg = load_config(None, ["optim.name=sgd", "optim.lr=0.1", "trainer.sync_batchnorm=false"])
    report = check_parity(build_bn, cfg, modes=["ddp"], global_batch=8)
    row = _row(report, "ddp")
    assert report.failed and row.status == "FAIL", report.format()
    assert "set trainer.sync_batchnorm=true" in row.cause and row.bn_ranks.startswith("differ")


@pytest.mark.parametrize("find_unused", [True, False])
def test_parity_names_a_parameter_dropped_on_one_rank(find_unused):
    # With find_unused_parameters the run finishes with wrong weights; without it DDP's all-reduce
    # breaks (gloo aborts the process). Either way the cause names the parameter and the rank.
    cfg = load_config(None, ["optim.name=sgd", "optim.lr=0.1", f"trainer.find_unused_parameters={find_unused}"])
    report = check_parity(build_rank_drop, cfg, modes=["ddp"], global_batch=8, timeout_s=30)
    row = _row(report, "ddp")
    assert report.failed and row.status == "FAIL", report.format()
    assert "extra.bias (rank 1), extra.weight (rank 1)" in row.cause, report.format()


def test_parity_names_a_sampler_whose_epoch_is_never_set():
    cfg = load_config(None, ["optim.name=sgd", "optim.lr=0.1"])
    report = check_parity(build_bn, cfg, modes=["ddp"], global_batch=8, mode_hooks={"ddp": [NoSetEpoch()]},
                          steps=2, epochs=2)
    row = _row(report, "ddp")
    assert report.failed and row.samples == "differ at step 3", report.format()
    assert "set_epoch is never called" in row.cause
