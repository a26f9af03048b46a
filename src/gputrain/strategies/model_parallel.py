"""Model parallelism in one process: the model cut into stages on several devices, micro-batches pipelined.

The classic pattern of PyTorch's model-parallel tutorial, for K stages: each batch is cut into
micro-batches of ``split_size``, and at clock tick ``t`` stage ``s`` runs micro-batch ``t - s``.
CUDA launches kernels asynchronously, so while stage 2 works on micro-batch ``i`` on its GPU the
host has already queued micro-batch ``i + 1`` on stage 1's GPU: the stages overlap. The outputs are
concatenated on the last stage's device and the loss is computed there, once, on the whole batch;
backward runs through the same graph, so the gradient is exactly that of the unsplit model.

The model is not modified: :func:`~gputrain.parallel.blocks.sequential_blocks` finds its chain of
blocks, which share the model's modules, so the optimizer, checkpoints (plain keys) and evaluation
see the user's model. On a CPU-only machine every stage sits on the CPU and the same code runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gputrain.dist import DistInfo
from gputrain.strategies.base import move_to_device
from gputrain.strategies.micro_batches import cat_outputs, chunk_batch
from gputrain.strategies.stages import (
    SplitOptions,
    StagedStrategy,
    choose_split,
    move_and_rebind,
    resolve_stage_devices,
    verify_chain,
)

if TYPE_CHECKING:
    from gputrain.config import RunConfig
    from gputrain.parallel.blocks import Block, Stage


def pipelined_forward(stages: Sequence[nn.Module], devices: Sequence[torch.device], chunks: Sequence[Any]) -> Any:
    """Run ``chunks`` (micro-batches on ``devices[0]``) through ``stages``, wavefront by wavefront.

    At tick ``t`` stage ``s`` runs micro-batch ``t - s``. Stages are visited last to first within a
    tick, so a stage has taken its input before the stage behind it overwrites it with the next
    one. Each stage sees its micro-batches in order, as one process accumulating them would
    (BatchNorm running statistics are updated in the same sequence). Returns the concatenated outputs.
    """
    k, m = len(stages), len(chunks)
    waiting: list[Any] = [None] * k
    outputs: list[Any] = []
    for tick in range(m + k - 1):
        for s in reversed(range(k)):
            micro = tick - s
            if not 0 <= micro < m:
                continue
            out = stages[s](chunks[micro] if s == 0 else waiting[s])
            if s == k - 1:
                outputs.append(out)
            else:
                waiting[s + 1] = move_to_device(out, devices[s + 1])
    return cat_outputs(outputs)


class SplitModel(nn.Module):
    """The user's model (``.model``) cut into stages placed on ``devices``; ``forward`` pipelines micro-batches.

    The split is chosen at construction when no data is needed (hand split points, parameter
    counts), else on the first batch (the measured partition profiles one micro-batch).
    """

    def __init__(self, model: nn.Module, blocks: Sequence[Block], devices: Sequence[torch.device],
                 options: SplitOptions, announce: Callable[[str], None]) -> None:
        super().__init__()
        self.model = model
        self.blocks = list(blocks)  # a plain list: the blocks are the model's modules, registered there
        self.devices = list(devices)
        self.options = options
        self.announce = announce
        self.stages: list[Stage] | None = None
        self.compile_mode: str | None = None
        """Set by the strategy (``trainer.compile``): each stage is compiled once placed on its device."""
        self.split: list[int] = []
        self._planned = False
        self.optimizer: torch.optim.Optimizer | None = None
        """Set by the strategy: moved parameters are rebound in it when the split is made after it was built."""

    def ensure_plan(self, example: Any = None) -> bool:
        """Choose the split (printing the plan), check the chain and place the stages; False until a batch comes.

        Hand split points and the parameter-count partition are chosen (and checked against the block
        names) without data; the measured partition profiles the first batch. Either way the stages
        are placed only after the chain of blocks was compared with the model's forward on that batch.
        """
        from gputrain.parallel.blocks import split_stages

        if self.stages is not None:
            return True
        if not self.options.needs_profile and not self._planned:
            self.split, text = choose_split(self.blocks, self.options, self.devices)
            self._planned = True
            self.announce(text)
        if example is None:
            return False
        if self.options.needs_profile:
            self._move(lambda: self.model.to(self.devices[0]))  # the profiler measures blocks on the first device
            self.split, text = choose_split(self.blocks, self.options, self.devices, example)
            self.announce(text)
        verify_chain(self.model, self.blocks, example)
        stages = split_stages(self.blocks, self.split)

        def place() -> None:
            for stage, device in zip(stages, self.devices, strict=True):
                stage.to(device)

        self._move(place)
        if self.compile_mode:
            for stage in stages:
                stage.compile(mode=self.compile_mode)
        self.stages = stages
        return True

    def _move(self, move: Callable[[], Any]) -> None:
        move_and_rebind(self.model, self.optimizer, move)

    def forward(self, x: Any) -> Any:
        chunks = chunk_batch(x, self.options.micro_batch_size)
        self.ensure_plan(chunks[0])
        assert self.stages is not None
        return pipelined_forward(self.stages, self.devices, chunks)


class ModelParallel(StagedStrategy):
    """One process; the model's stages on ``parallel.stage_devices`` (default: one GPU each, or all on the CPU)."""

    name = "model_parallel"
    wrapper = SplitModel

    def __init__(self, dist_info: DistInfo, *, devices: Sequence[torch.device], options: SplitOptions) -> None:
        super().__init__(dist_info)
        self.devices = list(devices)
        self.options = options

    @classmethod
    def from_config(cls, dist_info: DistInfo, cfg: RunConfig) -> ModelParallel:
        kind = dist_info.device.type
        devices = resolve_stage_devices(cfg.parallel.stage_devices, cfg.parallel.stages, accelerator=kind,
                                        cuda_count=torch.cuda.device_count() if kind == "cuda" else 0)
        return cls(dist_info, devices=devices, options=SplitOptions.from_config(cfg, stages=len(devices), strategy=cls.name))

    def describe(self) -> str:
        o = self.options
        return (f"strategy=model_parallel stages={o.stages} stage_devices={','.join(map(str, self.devices))} "
                f"micro_batches={o.micro_batches} split_size={o.micro_batch_size}")

    @property
    def root_device(self) -> torch.device:
        return self.devices[0]

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]

    def setup_module(self, model: nn.Module) -> nn.Module:
        # Imported here: gputrain.parallel imports torchvision, which `import gputrain` need not pay for.
        from gputrain.parallel.blocks import block_key_map, sequential_blocks

        blocks = sequential_blocks(model, children_in_order=bool(self.options.split_points))
        block_key_map(model, blocks)  # refuses a model with weights outside the chain (they would stay behind)
        split = SplitModel(model, blocks, self.devices, self.options, self._announce_plan)
        if not split.ensure_plan() and self.options.needs_profile:
            self._announce_wait()
        return split

