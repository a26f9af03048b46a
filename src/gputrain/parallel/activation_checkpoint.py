"""``trainer.activation_checkpointing``: recompute each block's activations in the backward instead of keeping them.

The blocks are the model's chain (:func:`~gputrain.parallel.blocks.sequential_blocks`): each one that holds
submodules (a ResNet's ``layer1`` ... ``layer4``, the autoencoder's encoder and decoder, DeepLabv3+'s stages) runs
under ``torch.utils.checkpoint`` (non-reentrant): the forward keeps only its input, the backward runs its forward
again. Less activation memory for about one more forward of compute.

Same result, not only the same gradients: a BatchNorm in training mode would update its running statistics a
second time in the recomputed forward. During the recompute its momentum is 0 (it still normalises with the
batch's statistics, as the first forward did) and its batch count is restored, so the buffers end where a run
without checkpointing ends, bit for bit (tested). Dropout draws the same masks (checkpoint restores the random state).

The block's class is swapped for a subclass whose ``forward`` checkpoints the original one: module names,
parameters and ``state_dict`` keys stay the model's, and copies of the model stay checkpointed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from gputrain.parallel.blocks import sequential_blocks

_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}


@contextlib.contextmanager
def _statistics_kept(block: nn.Module) -> Iterator[None]:
    """BatchNorm's running statistics left as they are: momentum 0 makes the update ``1 * running + 0 * batch``
    (the same op, so the same tensors saved for backward, which checkpoint compares), and the batch count is put
    back."""
    norms = [(m, m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
             for m in block.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    for m, _, _ in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, count in norms:
            m.momentum = momentum
            if count is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(count)


def _checkpointed(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _SUBCLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not self.training:
                return cls.forward(self, *args, **kwargs)
            return checkpoint(cls.forward, self, *args, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), _statistics_kept(self)), **kwargs)

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                       "__qualname__": cls.__qualname__})
    return _SUBCLASSES[cls]


def is_checkpointed(module: nn.Module) -> bool:
    return type(module) in _SUBCLASSES.values()


def _acts_in_place(module: nn.Module) -> bool:
    """A Sequential whose first layer overwrites its input (EfficientNet's and MNASNet's heads start with an in-place
    Dropout): recomputing it would find its saved input changed, so it is left out; such heads hold one Linear on
    pooled features, nothing worth recomputing."""
    first = next(iter(module.children()), None)
    return isinstance(module, nn.Sequential) and bool(getattr(first, "inplace", False))


def checkpoint_blocks(model: nn.Module, *, children_in_order: bool = False) -> list[str]:
    """Checkpoint the blocks of ``model``'s chain that hold submodules; their names. A model without a chain raises
    a one-line ValueError naming the option."""
    try:
        blocks = sequential_blocks(model, children_in_order=children_in_order)
    except ValueError as err:
        raise ValueError(f"trainer.activation_checkpointing=true: {err}") from None
    owned = {id(m) for m in model.modules()}
    names = []
    for name, block in blocks:
        # A chain may wrap a model's module to pass its state along (DeepLabv3+'s tuple): checkpoint the module the
        # model itself calls, not the wrapper.
        for module in [block] if id(block) in owned else [m for m in block.children() if id(m) in owned]:
            if any(True for _ in module.children()) and not is_checkpointed(module) and not _acts_in_place(module):
                module.__class__ = _checkpointed(type(module))
                names.append(name)
    if not names:
        raise ValueError(f"trainer.activation_checkpointing=true: {type(model).__name__}'s blocks hold no submodules "
                         "to recompute; leave it false")
    return names
