"""Measure each block's forward+backward time and its memory, on the device it will train on.

:func:`profile_blocks` is the one profiler of gputrain: the partitioner uses it to choose split
points, and the strategy chooser (roadmap item 9) uses the same numbers to predict the memory and
step time of DDP, FSDP and pipeline plans. It leaves the blocks as it found them (BatchNorm running
statistics, gradients and train/eval modes are restored).

How each figure is obtained:

- ``forward_backward_s``: each block runs on its own input (the previous block's output, detached,
  requiring a gradient as a pipeline stage's received input does), forward then backward with a
  gradient of ones, timed with CUDA events on a GPU and ``time.perf_counter`` on a CPU (or CPU
  time, ``clock="cpu"``); the median
  of ``repeats`` runs after one warm-up run. Blocks are interleaved (block 1, 2, ..., 1, 2, ...) so
  a slow spell of a shared machine spreads over all of them instead of landing on one.
- ``activation_bytes``: the tensors autograd saves for backward during one connected forward of
  all blocks, seen through ``torch.autograd.graph.saved_tensors_hooks`` on every device. Each
  storage is counted once, by the first block that saves it; parameters and buffers are excluded.
  This is what one (micro-)batch keeps alive between its forward and its backward.
- ``peak_bytes`` (CUDA only, else None): ``torch.cuda.max_memory_allocated`` above the baseline
  during the block's timed forward+backward: saved tensors, output, gradients and workspaces.
- ``param_bytes``/``grad_bytes``/``optimizer_bytes``: from the parameters; gradients only for
  trainable ones; optimizer state per trainable parameter: SGD with momentum 1x, Adam/AdamW 2x.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from gputrain.parallel.blocks import Block, State

OPTIMIZER_STATES: dict[str, int] = {"sgd": 1, "adam": 2, "adamw": 2}
"""Optimizer state tensors kept per trainable parameter (SGD's momentum; Adam's two moments)."""


@dataclass(frozen=True)
class BlockCost:
    """Measured cost of one block at the profiled batch; times in seconds, sizes in bytes."""

    name: str
    forward_backward_s: float
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Saved for backward by one forward at the profiled batch (scales with the batch)."""
    output_bytes: int
    """The block's output: what crosses a stage boundary if a stage ends here."""
    peak_bytes: int | None = None
    """CUDA only: allocator peak above baseline during forward+backward."""

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state: held whatever the batch."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _tensors(state: State) -> list[torch.Tensor]:
    return [state] if isinstance(state, torch.Tensor) else [t for t in state if isinstance(t, torch.Tensor)]


def _as_input(state: State, requires_grad: bool) -> State:
    """A fresh copy of ``state``: a leaf for float tensors (when ``requires_grad``), cloned so in-place
    layers (ResNet's ReLU) neither fail on a leaf nor overwrite the stored input between repeats."""

    def one(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(requires_grad and t.is_floating_point()).clone()

    return one(state) if isinstance(state, torch.Tensor) else tuple(one(t) for t in state)


@contextmanager
def _preserved(blocks: Sequence[Block]) -> Iterator[None]:
    """Run in train mode; afterwards restore modes, buffers (BatchNorm statistics) and gradients."""
    modules = [m for _, block in blocks for m in block.modules()]
    modes = [m.training for m in modules]
    buffers = [(b, b.detach().clone()) for _, block in blocks for b in block.buffers()]
    grads = [(p, p.grad) for _, block in blocks for p in block.parameters()]
    try:
        for _, block in blocks:
            block.train()
        yield
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.training = mode
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        for p, grad in grads:
            p.grad = grad


def _saved_bytes(blocks: Sequence[Block], x: torch.Tensor) -> tuple[list[int], list[State]]:
    """Bytes autograd saves per block in one connected forward, and the states between blocks.

    ``states[i]`` is block ``i``'s input and ``states[i + 1]`` its output, detached copies.
    """
    exclude = {t.untyped_storage().data_ptr() for _, b in blocks for t in (*b.parameters(), *b.buffers())}
    owner: dict[tuple[str, int], int] = {}
    sizes = [0] * len(blocks)
    current = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() and key[1] not in exclude and key not in owner:
            owner[key] = current
            sizes[current] += storage.nbytes()
        return t

    states: list[State] = [_as_input(x, requires_grad=False)]
    state: State = x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for current, (_, block) in enumerate(blocks):  # noqa: B007 (pack reads ``current``)
            state = block(state)
            states.append(_as_input(state, requires_grad=False))
    return sizes, states


def _timer(device: torch.device, clock: str) -> tuple[object, object]:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end
    return (time.process_time() if clock == "cpu" else time.perf_counter()), None


def _elapsed(device: torch.device, clock: str, start: object, end: object) -> float:
    if device.type == "cuda":
        end.record()  # type: ignore[attr-defined]
        end.synchronize()  # type: ignore[attr-defined]
        return start.elapsed_time(end) / 1000  # type: ignore[attr-defined]
    return (time.process_time() if clock == "cpu" else time.perf_counter()) - start  # type: ignore[operator]


def _forward_backward(
    block: nn.Module, inp: State, device: torch.device, clock: str
) -> tuple[float, int | None]:
    """One timed forward+backward of ``block``; the allocator peak above baseline on CUDA."""
    for p in block.parameters():
        p.grad = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start, end = _timer(device, clock)
    outs = [t for t in _tensors(block(inp)) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    seconds = _elapsed(device, clock, start, end)
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    return seconds, peak


def profile_blocks(
    blocks: Sequence[Block],
    example_input: torch.Tensor,
    *,
    device: torch.device | str,
    optimizer: str = "sgd",
    repeats: int = 3,
    clock: str = "wall",
) -> list[BlockCost]:
    """Measure every block of ``blocks`` (already on ``device``) at ``example_input``'s batch.

    ``optimizer`` is sgd (with momentum), adam or adamw; it only sets ``optimizer_bytes``. Profile
    at the batch of one training step (plans divide it into micro-batches), and call this inside
    ``torch.autocast`` to profile mixed precision. ``clock="cpu"`` times CPU blocks with ``time.process_time`` instead of the
    wall clock: on a machine shared with other work, at one thread, it counts only this process's
    compute. See the module docstring for how each figure is measured.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device, as .to() does
        device = torch.device("cuda", torch.cuda.current_device())
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"profile_blocks(optimizer={optimizer!r}) is unknown; choose one of {sorted(OPTIMIZER_STATES)}"
        )
    if clock not in ("wall", "cpu") or (clock == "cpu" and device.type != "cpu"):
        raise ValueError(
            f"profile_blocks(clock={clock!r}) must be wall, or cpu on a CPU device (got {device})"
        )
    if repeats < 1:
        raise ValueError(f"profile_blocks(repeats={repeats}) must be at least 1")
    for name, block in blocks:
        where = {t.device for t in (*block.parameters(), *block.buffers())}
        if where and where != {device}:
            raise ValueError(
                f"block {name!r} is on {sorted(map(str, where))} but device={device}; move the model there first"
            )
    x = example_input.to(device)
    with _preserved(blocks):
        saved, states = _saved_bytes(blocks, x)
        times: list[list[float]] = [[] for _ in blocks]
        peaks: list[int | None] = [None] * len(blocks)
        for run in range(repeats + 1):  # run 0 warms up (allocator, kernels, caches)
            for i, (_, block) in enumerate(blocks):
                seconds, peak = _forward_backward(
                    block, _as_input(states[i], requires_grad=i > 0), device, clock
                )
                if run:
                    times[i].append(seconds)
                    if peak is not None:
                        peaks[i] = max(peaks[i] or 0, peak)
    costs = []
    for i, (name, block) in enumerate(blocks):
        params = list(block.parameters())
        trainable = [p for p in params if p.requires_grad]
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
        costs.append(
            BlockCost(
                name=name,
                forward_backward_s=statistics.median(times[i]),
                params=sum(p.numel() for p in params),
                param_bytes=param_bytes,
                grad_bytes=grad_bytes,
                optimizer_bytes=OPTIMIZER_STATES[optimizer] * grad_bytes,
                activation_bytes=saved[i],
                output_bytes=sum(t.numel() * t.element_size() for t in _tensors(states[i + 1])),
                peak_bytes=peaks[i],
            )
        )
    return costs
