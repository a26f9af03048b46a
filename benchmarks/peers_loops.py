"""The job every variant of ``benchmarks/peers.py`` runs, and the variants themselves: one model, data and seed.

The same in-memory data (:class:`Keyed`), initial weights, sample order (gputrain's batch sampler) and optimizer for
the hand-written loop (plain or DDP, optionally with glibc's allocator set as gputrain sets it), Lightning and
gputrain; :class:`Clock` records each one's epoch times, first step and epoch loss. ``benchmarks/peers.py`` starts
the processes, runs a variant from :data:`RUNNERS` in each, and reports.
"""

from __future__ import annotations

import functools
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset

from gputrain.data.samplers import StepBatchSampler
from gputrain.models.vision import ConvAutoencoder

MODELS = {"resnet18": dict(images=1024, size=32, batch=32, lr=0.05),
          "autoencoder": dict(images=1024, size=80, batch=32, lr=0.5)}


# -- the job every variant runs ---------------------------------------------------------------------
class Keyed(Dataset):
    """In-memory samples addressed by gputrain's ``(epoch, index)`` keys (what its batch sampler yields)."""

    def __init__(self, model: str) -> None:
        spec = MODELS[model]
        g = torch.Generator().manual_seed(123)
        self.x = torch.rand(spec["images"], 3, spec["size"], spec["size"], generator=g)
        self.y = torch.randint(0, 10, (spec["images"],), generator=g)
        self.model = model

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, key: Any) -> Any:
        i = key[1] if isinstance(key, tuple) else key
        return (self.x[i], self.y[i]) if self.model == "resnet18" else (self.x[i], self.x[i])


def build_model(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10) if model == "resnet18" else ConvAutoencoder()


def loss_fn(model: str) -> Any:
    return F.cross_entropy if model == "resnet18" else F.mse_loss


def batch_sampler(data: Dataset, model: str, rank: int, world: int) -> StepBatchSampler:
    return StepBatchSampler(len(data), dp_rank=rank, dp_size=world,  # type: ignore[arg-type]
                            batch_size=MODELS[model]["batch"] // world, seed=0)


class EpochAwareBatches(StepBatchSampler):
    """The same batches, with ``.sampler`` pointing at itself: where Lightning looks for ``set_epoch`` each epoch."""

    @property
    def sampler(self) -> StepBatchSampler:
        return self


def optimizer(params: Any, model: str) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=MODELS[model]["lr"], momentum=0.9)


class Clock:
    """Epoch times, the end of the first step (seconds since the process started) and the epoch's loss."""

    def __init__(self, started: float) -> None:
        self.started, self.epochs, self.first_step, self.loss = started, [], None, float("nan")
        self._t = 0.0

    def epoch_start(self) -> None:
        self._t = time.perf_counter()

    def epoch_end(self) -> None:
        self.epochs.append(time.perf_counter() - self._t)

    def step(self) -> None:
        if self.first_step is None:
            self.first_step = time.time() - self.started


def mean_loss(total: torch.Tensor, count: int, world: int) -> float:
    stats = torch.tensor([float(total), float(count)], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(stats)
    return float(stats[0] / stats[1])


def run_hand(model_name: str, epochs: int, clock: Clock, rank: int, world: int, tuned: bool = False) -> None:
    if tuned:
        try:
            from gputrain.engine.fast import keep_freed_host_memory
        except ImportError:  # a gputrain from before issue 29 (--baseline runs of this script)
            from gputrain.fast_path import keep_freed_host_memory  # type: ignore[no-redef]

        keep_freed_host_memory()
    data = Keyed(model_name)
    model = build_model(model_name)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt, loss_of = optimizer(model.parameters(), model_name), loss_fn(model_name)
    sampler = batch_sampler(data, model_name, rank, world)
    loader = DataLoader(data, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        clock.epoch_start()
        total, count = torch.zeros(()), 0
        for x, y in loader:
            loss = loss_of(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            total += loss.detach() * len(x)
            count += len(x)
            clock.step()
        clock.epoch_end()
        clock.loss = mean_loss(total, count, world)


def run_lightning(model_name: str, epochs: int, clock: Clock, rank: int, world: int) -> None:
    try:
        import lightning as L  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise SystemExit("benchmarks/peers.py: Lightning is not installed; pip install -r requirements-bench.txt") from None

    class Module(L.LightningModule):  # type: ignore[misc,name-defined,unused-ignore]
        def __init__(self) -> None:
            super().__init__()
            self.net, self.loss_of = build_model(model_name), loss_fn(model_name)
            self.total, self.count = torch.zeros(()), 0

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = self.loss_of(self.net(x), y)
            self.total += loss.detach() * len(x)
            self.count += len(x)
            return loss

        def on_train_epoch_start(self) -> None:
            self.total, self.count = torch.zeros(()), 0
            clock.epoch_start()

        def on_train_batch_end(self, *args: Any) -> None:
            clock.step()

        def on_train_epoch_end(self) -> None:
            clock.epoch_end()
            clock.loss = mean_loss(self.total, self.count, world)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.parameters(), model_name)

    data = Keyed(model_name)
    batches = EpochAwareBatches(len(data), dp_rank=rank, dp_size=world, batch_size=MODELS[model_name]["batch"] // world,
                                seed=0)
    loader = DataLoader(data, batch_sampler=batches)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(Module(), loader)


def run_gputrain(model_name: str, epochs: int, clock: Clock, rank: int, world: int) -> None:
    from gputrain import Trainer
    from gputrain.config import OptimConfig, RunConfig
    from gputrain.tasks.base import Task

    try:
        from gputrain.engine.hooks import Hook
    except ImportError:  # a gputrain from before issue 29, whose hooks lived in gputrain.hooks
        from gputrain.hooks.base import Hook  # type: ignore[no-redef]

    class Timing(Hook):
        def before_epoch(self, trainer: Any) -> None:
            clock.epoch_start()

        def after_step(self, trainer: Any, logs: Any) -> None:
            clock.step()

        def after_epoch(self, trainer: Any, metrics: dict[str, float]) -> None:
            clock.epoch_end()
            clock.loss = metrics["train/loss"]

    spec = MODELS[model_name]
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=spec["lr"], momentum=0.9))
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, hooks=[Timing()], strategy="ddp" if world > 1 else "single", devices=world,
                          accelerator="cpu", batch_size=spec["batch"] // world, epochs=epochs, out=f"{out}/run",
                          progress_bar=False, loggers=[], enable_checkpointing=False, pictures=0,
                          log_every_n_steps=0)
        trainer.fit(build_model(model_name), Keyed(model_name), None, task=Task(loss_fn(model_name)))


RUNNERS = {"hand": run_hand, "hand_ddp": run_hand, "hand_tuned": functools.partial(run_hand, tuned=True),
           "hand_ddp_tuned": functools.partial(run_hand, tuned=True), "lightning": run_lightning,
           "gputrain": run_gputrain}
