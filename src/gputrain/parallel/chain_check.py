"""Checking that a chain of blocks computes the model's forward (docs/partitioning.md).

``model_parallel`` and ``pipeline`` train the chain, not ``model.forward``: a model whose forward is
not that chain (a skip connection around a child) would silently train another model. So the
strategies run :func:`check_blocks` on the first batch before the first step and refuse in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gputrain.parallel.blocks import Block, State

CHAIN_HELP = (
    "wrap the model as an nn.Sequential of blocks whose chain is its forward (keep each skip connection "
    "inside one block), or use a strategy that does not split the model (single, ddp, fsdp)"
)


def _max_diff(got: State, want: State) -> float | None:
    """Largest absolute difference between two states, relative to ``want``'s scale (at least 1); None if
    their structure or shapes differ."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return None
        if not want.numel():
            return 0.0
        if not want.is_floating_point():
            return 0.0 if torch.equal(got, want) else float("inf")
        scale = max(1.0, float(want.detach().abs().max().nan_to_num(posinf=1.0)))
        return float((got.detach() - want.detach()).abs().max().nan_to_num(nan=0.0)) / scale
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)) and len(got) == len(want):
        diffs = [_max_diff(g, w) for g, w in zip(got, want, strict=True)]
        return None if None in diffs else max((d for d in diffs if d is not None), default=0.0)
    return None


def _describe(state: State) -> str:
    if isinstance(state, torch.Tensor):
        return str(tuple(state.shape))
    if isinstance(state, (tuple, list)):
        return "(" + ", ".join(_describe(s) for s in state) + ")"
    return type(state).__name__


def check_blocks(
    model: nn.Module, blocks: Sequence[Block], example: Any, *, atol: float = 1e-5
) -> float:
    """Largest difference between ``run_blocks(blocks, example)`` and ``model(example)``, in eval mode.

    Raises a one-line ValueError when it exceeds ``atol`` (relative to the output's scale, at least
    1), naming the first block whose output in the chain differs from its output inside
    ``model.forward`` (seen with forward hooks), or the block that fails on its predecessor's output
    (children that cannot be chained). Eval mode and no_grad keep BatchNorm statistics as they were;
    the model's mode is restored.
    """
    model_name = type(model).__name__
    inside: dict[int, State] = {}

    def recorder(i: int) -> Any:
        def hook(_module: nn.Module, _inputs: Any, output: State) -> None:
            inside.setdefault(i, output)  # the first call: where the chain would run it
        return hook

    was_training = model.training
    handles = [block.register_forward_hook(recorder(i)) for i, (_, block) in enumerate(blocks)]
    model.eval()
    try:
        with torch.no_grad():
            want = model(example)
            if isinstance(want, dict) and list(want) == ["out"]:
                want = want["out"]  # torchvision's segmentation models: the chain returns the logits themselves
            for handle in handles:
                handle.remove()
            handles = []
            state, first = example, None
            for i, (name, block) in enumerate(blocks):
                try:
                    state = block(state)
                except Exception as e:  # noqa: BLE001 (any error here means: not a chain)
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise ValueError(
                        f"{model_name} cannot be split into its top-level children: block {name!r} fails on the "
                        f"previous block's output {_describe(state)} ({reason}); {CHAIN_HELP}"
                    ) from None
                if first is None and i in inside:
                    d = _max_diff(state, inside[i])
                    if d is None or d > atol:
                        first = name
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    diff = _max_diff(state, want)
    if diff is None:
        raise ValueError(
            f"the blocks of {model_name} return {_describe(state)}, the model {_describe(want)}; {CHAIN_HELP}"
        )
    if diff > atol:
        where = first if first is not None else blocks[-1][0]
        raise ValueError(
            f"the blocks of {model_name} do not compute its forward: its top-level children do not run in order "
            f"(a skip connection?); from block {where!r} on, the chained output differs from the model's (by {diff:.3g} of its "
            f"scale); {CHAIN_HELP}"
        )
    return diff
