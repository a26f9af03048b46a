"""An unmodified model as an ordered list of named blocks whose chain computes its forward.

Strategies that split a model (model_parallel, pipeline) and the partitioner need the model as a
chain: block ``i`` consumes what block ``i-1`` returned. :func:`sequential_blocks` finds that chain
for the shapes gputrain knows (torchvision ResNet, ``nn.Sequential``, the conv autoencoder,
DeepLabv3+) without touching model code: blocks *share* the model's submodules (no copies), so
training the blocks trains the model, and :func:`block_key_map` maps a block's state_dict keys back
to the model's, so a split model saves weights the plain model loads with ``strict=True``.

The state passed between blocks is a tensor, or a tuple of tensors when a later block needs an
earlier result (DeepLabv3+'s decoder reads layer1's features). A tuple always holds only tensors,
so it can cross a process boundary with ``torch.distributed.pipelining``. The adapters below hold
the small glue code (a flatten, a concatenation) that a model's ``forward`` did inline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torchvision
from torch import nn

from gputrain.nn.chain import Block

State = Any
"""A tensor, or a tuple of tensors carried between blocks."""

SPLIT_HELP = (
    "make it splittable: build it as an nn.Sequential, or give parallel.split_points on a model "
    "whose top-level children run in order (their names are the split points)"
)


def _is_plain(model: nn.Module, base: type[nn.Module], *methods: str) -> bool:
    """``model`` is a ``base`` whose forward code (``methods``) no subclass has overridden."""
    return isinstance(model, base) and all(getattr(type(model), m) is getattr(base, m) for m in methods)


def _describes_its_chain(model: nn.Module) -> bool:
    """``model`` has a ``chain_blocks()`` (:mod:`gputrain.nn.chain`) and its forward is the one that describes."""
    owner = next((c for c in type(model).__mro__ if "chain_blocks" in vars(c)), None)
    return owner is not None and type(model).forward is owner.forward  # type: ignore[attr-defined]


def _resnet_blocks(model: torchvision.models.ResNet) -> list[Block]:
    names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool"]
    # ResNet._forward_impl calls torch.flatten(x, 1) between avgpool and fc; nn.Flatten(1) is the same op.
    return [*((n, getattr(model, n)) for n in names), ("flatten", nn.Flatten(1)), ("fc", model.fc)]


def sequential_blocks(model: nn.Module, *, children_in_order: bool = False) -> list[Block]:
    """The named blocks of ``model`` that, applied in order, compute ``model(x)``.

    Known shapes: torchvision ``ResNet`` (conv1 ... avgpool, flatten, fc), torchvision's other classifier
    families that are chains (:mod:`gputrain.parallel.families`), ``nn.Sequential`` (its
    children, named "0", "1", ...), :class:`ConvAutoencoder` (encoder, decoder) and
    :class:`DeepLabV3Plus` (conv1 ... layer1, reduce, layer2 ... layer4, aspp, fuse, classifier,
    upsample; a tuple state). ``children_in_order=True`` (the user gave split points) accepts any
    other model's top-level children as the chain: the user vouches that they run in order, and
    :func:`~gputrain.parallel.chain_check.check_blocks` verifies it on the first batch. Other models raise a one-line ValueError.
    """
    from gputrain.parallel.families import family_blocks, is_known_non_chain

    family = family_blocks(model)
    if _is_plain(model, torchvision.models.ResNet, "forward", "_forward_impl"):
        blocks = _resnet_blocks(model)  # type: ignore[arg-type]
    elif family is not None:
        blocks = family
    elif _is_plain(model, nn.Sequential, "forward"):
        blocks = list(model.named_children())
    elif _describes_its_chain(model):
        blocks = model.chain_blocks()  # type: ignore[operator]
    elif children_in_order and len(list(model.children())) > 1:
        blocks = list(model.named_children())
    elif is_known_non_chain(model):
        raise ValueError(f"cannot split torchvision's {type(model).__name__} into a chain of blocks (its forward is no "
                         f"chain: docs/models.md); train it with strategy single, ddp, dp or fsdp")
    else:
        raise ValueError(f"cannot split {type(model).__name__} into a chain of blocks; {SPLIT_HELP}")
    return blocks


def run_blocks(blocks: Iterable[Block], state: State) -> State:
    """Apply ``blocks`` in order to ``state`` (the model's input, or a previous block's output)."""
    for _, block in blocks:
        state = block(state)
    return state


class Stage(nn.Module):
    """A contiguous run of blocks as one module, e.g. one pipeline stage.

    Blocks are registered under their names, so a stage of a ResNet or an ``nn.Sequential`` has the
    model's own state_dict keys; :func:`block_key_map` covers the adapters of other models.
    ``forward(*state)`` takes the carried tuple spread out, as ``torch.distributed.pipelining``
    passes a previous stage's tuple output, and returns a tensor or a tuple of tensors.
    """

    def __init__(self, blocks: Sequence[Block]) -> None:
        super().__init__()
        if not blocks:
            raise ValueError("a Stage needs at least one block")
        for name, block in blocks:
            self.add_module(name, block)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.named_children()]

    def forward(self, *state: torch.Tensor) -> State:
        return run_blocks(self.named_children(), state[0] if len(state) == 1 else state)


def split_stages(blocks: Sequence[Block], split_indices: Sequence[int]) -> list[Stage]:
    """Cut ``blocks`` before each of ``split_indices`` (as returned by :mod:`gputrain.parallel.partition`)."""
    bounds = [0, *split_indices, len(blocks)]
    return [Stage(blocks[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def block_key_map(model: nn.Module, blocks: Sequence[Block]) -> dict[str, str]:
    """``"<block name>.<key in the block's state_dict>"`` -> the model's state_dict key.

    The keys on the left are exactly those of a :class:`Stage` made of these blocks, so
    ``{key_map[k]: v for k, v in stage.state_dict().items()}`` over all stages is a state_dict of the
    plain model. Matching is by tensor identity (blocks share the model's parameters and buffers),
    so it holds for any adapter. Raises ValueError if some model entry belongs to no block (a
    module the chain would never run) or a block entry is not the model's.
    """
    owners: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        owners.setdefault(id(tensor), []).append(key)
    mapping: dict[str, str] = {}
    for name, block in blocks:
        for key, tensor in block.state_dict(keep_vars=True).items():
            candidates = owners.get(id(tensor))
            if not candidates:
                raise ValueError(
                    f"block {name!r} holds {key!r}, which is not in {type(model).__name__}'s state_dict"
                )
            # A tied tensor has several model keys: prefer the one ending like the block's key.
            mapping[f"{name}.{key}"] = next((c for c in candidates if c.endswith(key)), candidates[0])
    missing = sorted(set(model.state_dict()) - set(mapping.values()))
    if missing:
        raise ValueError(
            f"{len(missing)} state_dict entries of {type(model).__name__} belong to no block (e.g. {missing[0]!r}): "
            f"the chain of blocks would never run them; {SPLIT_HELP}"
        )
    return mapping


def to_model_state_dict(
    stage_states: Iterable[Mapping[str, Any]], key_map: Mapping[str, str]
) -> dict[str, Any]:
    """Merge stages' state_dicts into one with the plain model's keys (see :func:`block_key_map`)."""
    merged: dict[str, Any] = {}
    for state in stage_states:
        for key, value in state.items():
            if key not in key_map:
                raise ValueError(
                    f"stage state_dict key {key!r} is not a block key; was the map built for this model?"
                )
            merged[key_map[key]] = value
    return merged
