"""Runs that go non-finite for a planted reason, for the replay's tests (issue 41).

Each cause is a small classifier trained with the Python API on a dataset read from one file per sample (so the
report can name a file):
- ``overflow``: a module that multiplies by 1e5 and divides again overflows float16 in the forward at 16-mixed,
  on every step, until the loss scaler's streak of skipped steps ends the run;
- ``loud``: a module that multiplies by 1e5 at 16-mixed: kept in float32, the next float16 op overflows on its output;
- ``sample``: one sample's file holds a NaN, at precision 32;
- ``backward``: a module whose forward is finite and whose backward is NaN (the gradient of sqrt at 0);
- ``lr``: finite gradients and an lr so large that the first optimizer step makes the weights inf;
- ``grown``: weights as earlier steps can leave them (3e37, finite): the forward overflows float32 itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from gputrain import Trainer
from gputrain.data.samplers import EpochPlan
from gputrain.errors import NonFiniteError
from gputrain.tasks.base import Task

N = 64
SEED = 0
NAN_POSITION = 5
"""Where in epoch 1's order the NaN sample sits: step 3 (global batch 2), the second sample, so rank 1 on 2 ranks."""


class Amplify(nn.Module):
    """Multiplies by ``gain`` and divides again: in float16 the product overflows to inf for |x| > 65504 / gain."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain / self.gain


class Scale(nn.Module):
    """Multiplies by ``gain``: in float32 its output fits, and the next float16 op overflows on it."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class SqrtAtZero(nn.Module):
    """Adds sqrt(0 * x): zero in the forward, NaN in the backward (0.5 / sqrt(0) times 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (x * 0).sqrt()


def model(cause: str) -> nn.Module:
    middle: nn.Module = {"overflow": Amplify(1e5), "loud": Scale(1e5), "backward": SqrtAtZero()}.get(cause, nn.Identity())
    torch.manual_seed(SEED)
    built = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), middle, nn.ReLU(), nn.Linear(16, 3))
    if cause == "grown":
        with torch.no_grad():
            built[1].weight.fill_(3e37)  # inputs of std 10: sums of 12 products beyond float32's 3.4e38
    return built


class FileSamples(Dataset):
    """One ``.pt`` file per sample, listed in ``samples`` as torchvision's folder datasets list theirs."""

    def __init__(self, root: Path) -> None:
        self.samples = [(str(p), int(p.stem.split("_")[2])) for p in sorted(root.glob("sample_*.pt"))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return torch.load(path, weights_only=True), label


def nan_index() -> int:
    return EpochPlan(N, seed=SEED, epoch=0, dp_size=1, batch_size=2).order[NAN_POSITION]


def write_data(root: Path, *, nan_sample: bool, scale: float = 1.0) -> FileSamples:
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    bad = nan_index() if nan_sample else -1
    for i in range(N):
        x = torch.randn(3, 2, 2, generator=g) * scale
        if i == bad:
            x[1, 0, 0] = float("nan")
        torch.save(x, root / f"sample_{i:03d}_{i % 3}.pt")
    return FileSamples(root)


def fail(root: Path, cause: str, *, devices: int = 1, fp32_modules: list[str] | None = None,
         checkpoint_every: int = 0, strategy: str = "ddp", global_batch: int = 2) -> str:
    """Train the planted run; the NonFiniteError's line, or "" when it trained to the end."""
    # lr: inputs of std 10 make gradients above 1.2, which times lr 3e38 is beyond float32 on the first step
    data = write_data(root / "data", nan_sample=cause == "sample", scale=10.0 if cause in ("lr", "grown") else 1.0)
    trainer = Trainer(out=str(root / "run"), overwrite=True, strategy=strategy if devices > 1 else "single",
                      devices=devices, accelerator="cpu", epochs=1, batch_size=global_batch // devices, seed=SEED,
                      precision="16-mixed" if cause in ("overflow", "loud") else "32", log_every_n_steps=8,
                      fp32_modules=fp32_modules or [], checkpoint_every_n_steps=checkpoint_every, progress_bar=False)
    if cause == "lr":  # plain SGD: lr x |gradient| beyond float32's 3.4e38 on the first step
        trainer.cfg.optim.name, trainer.cfg.optim.lr, trainer.cfg.optim.momentum = "sgd", 3e38, 0.0
    try:
        trainer.fit(model(cause), data, loss=nn.functional.cross_entropy)
    except NonFiniteError as err:
        return str(err)
    return ""


def run(info: Any, root: str, cause: str) -> str:
    return fail(Path(root), cause, devices=2)


def build(cfg: Any) -> Any:
    """``task=nonfinite_runs:build``: the planted run from the command line (``model.name=nonfinite_runs:model``)."""
    from gputrain.models import build_model
    from gputrain.tasks.spec import TaskSpec

    return TaskSpec(task=Task(nn.functional.cross_entropy), model=build_model(cfg.model.name, **cfg.model.kwargs),
                    train_data=FileSamples(Path(cfg.data.root)), val_data=None)
