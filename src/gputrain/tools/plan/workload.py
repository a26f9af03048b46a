"""What one training step of a run is, as planning needs it: the model, the loss, the optimizer, a batch of any size.

Built from the run's config by the task itself (the same model and data a training run builds), so what is
planned is what trains. Batches of any size are made from the first samples of the training set, repeated when
the set is shorter: the shapes and dtypes are the run's, the values only matter to real timing steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gputrain.config import RunConfig
from gputrain.tasks.base import Task


@dataclass
class Workload:
    cfg: RunConfig
    model: nn.Module
    task: Task
    samples: list[Any]
    """The first samples of the training set, as its dataset returns them."""
    device: torch.device
    precision: str
    """The resolved precision: 32, 16-mixed or bf16-mixed."""
    split_points: tuple[str, ...] = ()
    _collate: Any = field(default=None, repr=False)
    notes: set[str] = field(default_factory=set)
    """What the plan's reader should know about how figures were obtained."""
    runs_on_fake_tensors: bool = True
    """False once a fake step failed: the model's memory is then measured by real steps."""
    counted: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    """Memory already counted for this model, by what was counted: plans that share a step share its count."""
    _meta_model: nn.Module | None = field(default=None, repr=False)
    seconds_per_sample: float = 0.0
    """One training sample read in this process (decode and augment: :mod:`~gputrain.tools.plan.input`)."""
    seconds_per_sample_in_worker: float | None = None
    """The same in a real loader worker (None: no worker could be timed)."""

    def meta_model(self) -> nn.Module:
        """The model on the meta device, made once: each pass on fake tensors copies it (no weights to copy)."""
        if self._meta_model is None:
            self._meta_model = copy.deepcopy(self.model).to("meta")
        return self._meta_model

    @classmethod
    def from_config(cls, cfg: RunConfig, device: torch.device, precision: str, count: int = 8) -> Workload:
        from torch.utils.data import default_collate

        from gputrain.tasks import build_task

        # Float batches as the workers would hand them (uint8 ones become these on the device: the same tensors).
        data_cfg = dataclasses.replace(cfg.data, normalize_on_device=False, decode_on_device=False)
        spec = build_task(dataclasses.replace(cfg, data=data_cfg))
        data = spec.train_data
        n = min(len(data), count)  # type: ignore[arg-type]
        if n == 0:
            raise ValueError(f"data.root={cfg.data.root!r}: the training set is empty; planning reads a batch of it")
        samples = [data[i] for i in range(n)]
        from gputrain.tools.plan.input import time_reads, time_worker_reads

        collate = spec.task.collate_fn() or default_collate
        return cls(cfg=cfg, model=spec.model, task=spec.task, samples=samples, device=device, precision=precision,
                   split_points=tuple(cfg.parallel.split_points), _collate=collate,
                   seconds_per_sample=time_reads(data, collate, cfg.trainer.batch_size),
                   seconds_per_sample_in_worker=time_worker_reads(data, collate, cfg.trainer.batch_size))

    def checkpointed(self) -> Workload:
        """The same run with ``trainer.activation_checkpointing=true`` (a checkpointed copy of the model; the notes
        are shared). Raises ValueError when the model has no chain of blocks to checkpoint."""
        from gputrain.parallel.activation_checkpoint import checkpoint_blocks

        model = copy.deepcopy(self.model)
        checkpoint_blocks(model, children_in_order=bool(self.split_points))
        return dataclasses.replace(self, model=model, notes=self.notes, counted={}, _meta_model=None)

    def batch(self, size: int) -> tuple[Any, Any]:
        """``(inputs, targets)`` of ``size`` samples, on the CPU."""
        picked = [self.samples[i % len(self.samples)] for i in range(size)]
        return self.task.split_batch(self._collate(picked))

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.precision in ("16-mixed", "bf16-mixed"):
            dtype = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
            with torch.autocast(device_type=self.device.type, dtype=dtype):
                yield
        else:
            yield

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from gputrain.optim import build_optimizer

        # Fused kernels are the same tensors; on fake tensors they may lack a kernel, so plan the plain one.
        return build_optimizer(model, dataclasses.replace(self.cfg.optim, fused=False))

    def loss_of(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.task.loss(outputs, targets)

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Any, targets: Any) -> None:
        with self.autocast():
            loss = self.task.loss(self.task.forward(model, inputs, targets), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
