"""The one small protocol every parallel strategy implements.

A strategy owns everything that differs between ways of running: how many processes a node
starts, how a module is wrapped, which rank reads which share of a step (the data-parallel
rank and size), the forward-backward of one micro-batch (a pipeline computes the loss inside
its schedule), gradient reduction and clipping, the optimizer, how model and optimizer state
are gathered for a checkpoint and loaded back, and the collectives used to reduce metrics.
The training loop only calls these methods, so it never branches on the strategy.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Sampler

from gputrain.data.samplers import EvalSampler
from gputrain.dist import DistInfo

if TYPE_CHECKING:
    from gputrain.config import OptimConfig, RunConfig
    from gputrain.precision import Precision
    from gputrain.tasks.base import Task


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a nested batch (tensors, lists, tuples, dicts) to ``device``.

    An object with a ``to_device(device, non_blocking)`` method builds itself there (images still encoded,
    :class:`~gputrain.data.device_decode.EncodedBatch`, are decoded on the device).
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    to_device = getattr(batch, "to_device", None)
    if callable(to_device):
        return to_device(device, non_blocking)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(v, device, non_blocking) for v in batch]
        return type(batch)(moved) if isinstance(batch, tuple) and not hasattr(batch, "_fields") else moved
    return batch


def strip_module_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop a leading ``module.`` (DataParallel/DDP) from every key, so saved weights load anywhere."""
    return {k.removeprefix("module."): v for k, v in state_dict.items()}


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested containers (optimizer state, batches)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


@dataclass(frozen=True)
class MicroBatch:
    """This rank's share of one micro-batch of a step, as the loop hands it to the strategy."""

    inputs: Any
    """On the strategy's root device; None when this rank has no samples in this micro-batch."""
    targets: Any
    size: int
    """Samples on this rank (0 when ``inputs`` is None, or for a joining empty slice)."""
    weight: float
    """Multiplies the task's mean loss so that the reduced gradient is the mean over the step's global batch."""
    sync: bool
    """Reduce gradients in this backward (the last micro-batch of a step whose ranks all have samples)."""


class Strategy(ABC):
    """How a model, its data and its gradients are spread over processes and devices."""

    name: ClassVar[str]
    splits_batch: ClassVar[bool] = False
    """Whether the model sees each process's batch in micro-batches (a split model): BatchNorm statistics then
    differ from one process's by design (``gputrain parity`` says so rather than fail)."""

    def __init__(self, dist_info: DistInfo) -> None:
        self.dist = dist_info

    # -- construction --------------------------------------------------------------------
    @classmethod
    def processes_per_node(cls, devices: int) -> int:
        """How many processes a node starts for ``devices``: one per device, or one for all of them as the
        strategy's registration says (:data:`gputrain.strategies.STRATEGIES`, read by the launcher before torch)."""
        from gputrain.strategies import processes_per_node

        return processes_per_node(cls.name, devices)

    @classmethod
    def data_parallel_size(cls, world_size: int) -> int:
        """How many shares of each step a job of ``world_size`` processes reads at once (1 for a pipeline, whose
        every stage reads the whole batch); known before the strategy is built, when ``auto`` is resolved."""
        return world_size

    @classmethod
    def from_config(cls, dist_info: DistInfo, cfg: RunConfig) -> Strategy:
        """This strategy with its options read from the run config."""
        return cls(dist_info)

    def describe(self) -> str:
        """What the start-up line says about this strategy (devices used, stages, ...)."""
        return f"strategy={self.name}"

    # -- topology ------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many different shares of each step are read at once."""
        return type(self).data_parallel_size(self.dist.world_size)

    @property
    def dp_rank(self) -> int:
        """Which share of each step this rank reads."""
        return self.dist.rank if self.dp_size > 1 else 0

    @property
    def computes_loss(self) -> bool:
        """Whether this rank sees outputs and loss (a pipeline's last stage only); others report nothing."""
        return True

    eval_in_lockstep: ClassVar[bool] = False
    """True when forward issues collectives (FSDP), so every rank must run the same number of eval batches."""

    # -- model and optimizer ---------------------------------------------------------------
    @abstractmethod
    def setup_module(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to its device(s) and wrap it for this strategy."""

    def compile_module(self, module: nn.Module, mode: str) -> None:
        """``torch.compile`` what training runs (``trainer.compile``), in place: state-dict keys stay the model's.

        The default compiles the wrapped module whole, so under DDP dynamo sees the wrapper and splits the
        graph at gradient buckets (its DDPOptimizer), keeping the all-reduce overlapped with backward.
        """
        module.compile(mode=mode)

    def setup_optimizer(self, module: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        from gputrain.optim import build_optimizer

        return build_optimizer(self.unwrap(module), cfg)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's model inside whatever wrapper :meth:`setup_module` added."""
        return module.module if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)) else module

    def eval_module(self, module: nn.Module) -> nn.Module:
        """The module to run evaluation with; it must not issue collectives unless ``eval_in_lockstep``."""
        return module

    def prepare_eval(self, module: nn.Module) -> None:
        """Make every rank evaluate the weights and buffers that a checkpoint saved now would hold."""

    def has_forward_collectives(self, module: nn.Module) -> bool:
        """Whether forward runs collectives (SyncBatchNorm, FSDP): then a rank without samples must still join."""
        from gputrain.nn.sync_batchnorm import CpuSyncBatchNorm

        return self.dist.world_size > 1 and any(
            isinstance(m, (nn.SyncBatchNorm, CpuSyncBatchNorm)) for m in self.unwrap(module).modules())

    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full weights with plain keys (never ``module.``), as saved in checkpoints; a collective where sharded."""
        return strip_module_prefix(self.unwrap(module).state_dict())

    def load_model_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(module).load_state_dict(strip_module_prefix(state))

    def named_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's live parameters and buffers under the plain model's keys, sharing their storage (an FSDP
        shard stays a shard): what an average of the weights follows and is swapped with."""
        return strip_module_prefix(self.unwrap(module).state_dict())

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def local_tensors(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
        """The tensors this rank holds (parameters, buffers, optimizer state), for finiteness checks."""
        yield from self.unwrap(module).parameters()
        yield from self.unwrap(module).buffers()
        yield from tensors_of(optimizer.state_dict()["state"])

    # -- the step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def backward_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        """Context for one forward+backward; ``enabled=False`` skips gradient sync (accumulation)."""
        yield

    def forward_backward(self, module: nn.Module, micro: MicroBatch, *, task: Task,
                         precision: Precision) -> torch.Tensor | None:
        """Forward, loss and backward of one micro-batch; returns the detached mean loss, or None.

        None means this rank computed no loss for it (no samples, or not the stage that sees outputs).
        """
        if micro.inputs is None:
            return None
        with self.backward_sync(module, micro.sync):
            with precision.forward_context():
                outputs = task.forward(module, micro.inputs, micro.targets)
                if micro.size == 0:
                    # An empty slice that joins forward collectives: a zero-weighted graph over every
                    # output gives zero gradients and runs the same backward collectives as its peers.
                    loss = sum((t.sum() for t in tensors_of(outputs)), torch.zeros((), device=self.root_device))
                    precision.backward(loss * 0.0)
                    return None
                if not task.targets_to_model:
                    self.check_loss_inputs(outputs, micro.targets)
                loss = task.loss(outputs, micro.targets)
                # The backward needs what autograd saved, not the outputs: held here they would stay alive through
                # the whole backward (a segmentation model's full-size logits, an autoencoder's reconstruction).
                del outputs
            precision.backward(loss * micro.weight)
        # A copy, not a view: some losses (mse_loss, smooth_l1) leave their scalar on a storage of the whole
        # unreduced batch, which a detached view would keep alive until the next micro-batch's loss replaces it.
        return loss.detach().clone()

    def finish_gradients(self, module: nn.Module) -> None:
        """Average gradients over data-parallel ranks by hand, after a step whose last micro-batch left
        some rank without samples (its backward ran without sync, since that rank had nothing to run)."""
        if not self._collective or self.dp_size == 1:
            return
        params = [p for p in self.unwrap(module).parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.dp_size
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over all parameters of the model) to ``max_norm``."""
        return torch.nn.utils.clip_grad_norm_(self.unwrap(module).parameters(), max_norm)

    # -- data --------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """Where inputs go before the forward pass."""
        return self.dist.device

    @property
    def output_device(self) -> torch.device:
        """Where the model's outputs land, so where targets must be for the loss."""
        return self.dist.device

    def eval_sampler(self, length: int) -> Sampler[int]:
        return EvalSampler(length, rank=self.dp_rank, world_size=self.dp_size)

    def check_batch(self, batch_size: int, model: nn.Module | None = None) -> None:
        """Refuse a batch this strategy cannot run with ``model``, before training; the default accepts any."""

    def check_loss_inputs(self, outputs: Any, targets: Any) -> None:
        """Refuse outputs/targets the loss cannot combine; the default accepts any."""

    # -- whether this process is one of several ------------------------------------------------
    @property
    def _collective(self) -> bool:
        return self.dist.world_size > 1 and dist.is_initialized()
