"""An exponential moving average (EMA) of the weights, kept on every rank beside the model it follows.

It averages what torchvision's classification reference averages (``ExponentialMovingAverage``, an
``AveragedModel`` with ``use_buffers=True``): every floating-point parameter and buffer, BatchNorm's running
statistics included, so the EMA model is evaluated with statistics that belong to its own weights (timm#245);
integer buffers (``num_batches_tracked``) are copied. Each update is ``ema = decay * ema + (1 - decay) * weights``,
as ``torch._foreach_lerp_`` computes it in torch's own ``get_ema_multi_avg_fn``.

The average is a set of tensors shaped as this rank's weights (:meth:`~gputrain.strategies.base.Strategy.named_weights`):
under FSDP each rank keeps only its own shards, never the gathered parameters; a pipeline stage keeps its stage's.
Whatever needs the EMA as a model (validation, a full checkpoint, loading one) swaps it into the live weights one
tensor at a time, lets the strategy do what it does for the model, and swaps back: no strategy knows about it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from gputrain.config.schema import RunConfig
    from gputrain.strategies.base import Strategy


def effective_decay(decay: float, *, global_batch: int, every: int, epochs: int, adjust: bool) -> float:
    """The decay applied per update: torchvision's reference scales ``1 - decay`` by the samples between updates
    over the epochs (``adjust = world_size * batch_size * model_ema_steps / epochs``), so one setting suits any
    batch and schedule length; ``adjust=False`` applies ``decay`` as given (timm's convention)."""
    if not adjust:
        return decay
    return 1.0 - min(1.0, (1.0 - decay) * global_batch * every / max(epochs, 1))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: an FSDP shard's local part (a view of the same storage), else itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class WeightAverage:
    """The EMA of one run's weights: :meth:`update` after optimizer steps, :meth:`swapped_in` to use it as the model."""

    def __init__(self, strategy: Strategy, module: nn.Module, *, decay: float, every: int, warmup_steps: int) -> None:
        self.strategy, self.module = strategy, module
        self.decay, self.every, self.warmup_steps = decay, every, warmup_steps
        with torch.no_grad():
            self.tensors = {k: v.detach().clone() for k, v in strategy.named_weights(module).items()}
        self.updates = 0
        """Updates averaged since the average last restarted from the weights (the reference's ``n_averaged``)."""

    @classmethod
    def for_run(cls, cfg: RunConfig, strategy: Strategy, module: nn.Module, global_batch: int) -> WeightAverage | None:
        """The run's EMA (``trainer.ema_decay`` > 0), or None."""
        t = cfg.trainer
        if t.ema_decay <= 0:
            return None
        decay = effective_decay(t.ema_decay, global_batch=global_batch, every=t.ema_every_n_steps, epochs=t.epochs,
                                adjust=t.ema_adjust)
        return cls(strategy, module, decay=decay, every=t.ema_every_n_steps, warmup_steps=cfg.scheduler.warmup_steps)

    @torch.no_grad()
    def update(self, global_step: int) -> None:
        """After optimizer step ``global_step`` (1-based): average after steps 1, 1 + every, 1 + 2 every, ... (the
        reference's iterations 0, every, ...). The first update after a start copies the weights, and during the
        learning rate's warm-up every update does (as the reference resets its average in the warm-up epochs)."""
        if (global_step - 1) % self.every:
            return
        live = self._live()
        averaged, current = [], []
        for name, ema in self.tensors.items():
            mine, theirs = _local(ema), _local(live[name])
            if self.updates == 0 or not mine.is_floating_point():
                mine.copy_(theirs)
            else:
                averaged.append(mine)
                current.append(theirs)
        if averaged:
            torch._foreach_lerp_(averaged, current, 1.0 - self.decay)
        self.updates = 0 if global_step <= self.warmup_steps else self.updates + 1

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA in the live weights for the block (and the weights in the EMA's tensors), swapped back after.

        One tensor's copy at a time is the only extra memory. What the block writes into the live weights (a
        strategy adopting rank 0's buffers, a checkpoint loaded) stays in the EMA.
        """
        live = self._live()
        pairs = [(_local(live[name]), _local(ema)) for name, ema in self.tensors.items()]
        _swap(pairs)
        try:
            yield
        finally:
            _swap(pairs)

    def _live(self) -> dict[str, torch.Tensor]:
        """The live weights the EMA follows, its tensors narrowed to them where they became fewer: a pipeline rank
        holds the whole model until its first batch places its stage, then that stage's layers alone (what the EMA
        held of them, the initial weights or a checkpoint's average, is kept, moved to the stage's device)."""
        live = self.strategy.named_weights(self.module)
        if live.keys() != self.tensors.keys() or any(t.device != live[k].device for k, t in self.tensors.items()):
            missing = sorted(live.keys() - self.tensors.keys())
            if missing:
                raise RuntimeError(f"the EMA of the weights holds no {missing[:3]}: the model changed after it began")
            # model_parallel places its stages on their devices at the first batch too
            self.tensors = {k: self.tensors[k].to(live[k].device) for k in live}
        return live

    def full_state(self) -> dict[str, torch.Tensor]:
        """The EMA as the model's full state dict, copied to the CPU (rank 0; ``{}`` elsewhere when gathered). A
        collective under strategies that gather; rank 0's buffers are the ones kept, as for the model."""
        with self.swapped_in():
            self.strategy.prepare_eval(self.module)
            state = self.strategy.model_state_dict(self.module)
            return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def adopt_rank0_buffers(self) -> None:
        """Every rank takes rank 0's averaged buffers, as the model's are before a save (a collective)."""
        with self.swapped_in():
            self.strategy.prepare_eval(self.module)

    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full EMA state dict (every rank read it), each rank keeping its shard or stage."""
        with self.swapped_in():
            self.strategy.load_model_state_dict(self.module, state)

    def restart_from_weights(self) -> None:
        """Start again from the live weights (a checkpoint without an EMA: the next update copies them)."""
        with torch.no_grad():
            live = self._live()
            for name, ema in self.tensors.items():
                _local(ema).copy_(_local(live[name]))
        self.updates = 0

    def local_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors this rank holds of the EMA (an FSDP shard's local part), as memory counts them."""
        return tuple(_local(t) for t in self.tensors.values())

    def checkpoint_entry(self, *, sharded: bool) -> dict[str, Any]:
        """What a checkpoint file holds of the EMA: the count, and the full weights unless a sharded folder does."""
        entry: dict[str, Any] = {"updates": self.updates, "decay": self.decay}
        if sharded:
            self.adopt_rank0_buffers()  # the folder holds one copy of a replicated tensor: rank 0's, as the model's
        else:
            entry["weights"] = self.full_state()
        return entry


@torch.no_grad()
def _swap(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for a, b in pairs:
        held = a.clone()
        a.copy_(b)
        b.copy_(held)
