"""The autoencoder runs several test files compare: one process, DDP, accumulation, resume, CUDA."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.models.vision import ConvAutoencoder
from gputrain.tasks.autoencoder import ReconstructionTask

__all__ = ["ConvAutoencoder", "_Images", "_max_diff", "_train"]

N_IMAGES = 64


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.rand(N_IMAGES, 3, 20, 20, generator=g))


class _Images(torch.utils.data.Dataset):
    """Bare tensors (the autoencoder's batches are images, not tuples)."""

    def __init__(self) -> None:
        self.x = _data().tensors[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def _train(out: str, strategy: str, devices: int, batch_size: int, accumulate: int = 1, epochs: int = 2,
           resume: str = "", accelerator: str = "cpu", model_fn: Callable[[], torch.nn.Module] = ConvAutoencoder,
           **options: object) -> dict[str, torch.Tensor]:
    """Final weights of the run; ``model_fn`` builds the model after seeding (the autoencoder unless a test needs
    another image-to-image model)."""
    torch.manual_seed(0)
    model = model_fn()
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=0.5, momentum=0.9))
    trainer = Trainer(cfg, strategy=strategy, devices=devices, accelerator=accelerator, batch_size=batch_size,
                      accumulate_grad_batches=accumulate, epochs=epochs, out=out, progress_bar=False,
                      loggers=[], resume=resume, log_every_n_steps=1, **options)
    trainer.fit(model, _Images(), _Images(), task=ReconstructionTask())
    return {k: v.clone() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


