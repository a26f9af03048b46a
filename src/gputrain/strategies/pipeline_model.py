"""This rank's pipeline stage of a model, driven by ``torch.distributed.pipelining`` schedules.

Kept apart from :mod:`gputrain.strategies.pipeline` (the strategy: topology, clipping, checkpoints)
so that each file stays small. :class:`PipelinedModel` owns the split, the stage's placement, and
one ``PipelineStage`` + schedule per shape of chunk (torch's stages pre-allocate receive buffers
for one shape, so a short batch's remainder chunk gets a stage of its own, made once and reused).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from gputrain.dist import DistInfo
from gputrain.strategies.base import tensors_of
from gputrain.strategies.micro_batches import batch_len, cat_outputs, chunk_batch, equal_runs
from gputrain.strategies.stages import (
    SplitOptions,
    choose_split,
    move_and_rebind,
    verify_chain,
)

if TYPE_CHECKING:
    from gputrain.parallel.blocks import Block, Stage
    from gputrain.tasks.base import Task


@dataclass
class _LossContext:
    """What the chunk loss of the current step needs; the schedule's ``loss_fn`` is fixed at construction."""

    task: Task
    n: int
    weight: float
    chunk_losses: list[tuple[torch.Tensor, int]] = field(default_factory=list)


@dataclass
class _Run:
    stage: PipelineStage
    schedule: Any
    out_meta: Any = None
    """Eval runs: the per-sample shape and dtype of the outputs, so that other stages can stand in for them."""


class PipelinedModel(nn.Module):
    """The whole model (``.model``) of which this rank trains stage ``rank``; ``forward`` is pipelined inference."""

    def __init__(self, model: nn.Module, blocks: Sequence[Block], key_map: dict[str, str], options: SplitOptions,
                 dist_info: DistInfo, announce: Callable[[str], None]) -> None:
        super().__init__()
        self.model = model
        self.blocks = list(blocks)
        self.key_map = key_map
        self.options = options
        self.info = dist_info
        self.announce = announce
        self.stage: Stage | None = None
        self.compile_mode: str | None = None
        """Set by the strategy (``trainer.compile``): this rank's stage is compiled once placed on its device."""
        self.optimizer: torch.optim.Optimizer | None = None
        self._runs: dict[tuple[Any, ...], _Run] = {}
        self._loss: _LossContext | None = None
        self._split: list[int] | None = None

    @property
    def is_first(self) -> bool:
        return self.info.rank == 0

    @property
    def is_last(self) -> bool:
        return self.info.rank == self.info.world_size - 1

    # -- the split ------------------------------------------------------------------------------
    def ensure_plan(self, example: Any = None) -> bool:
        """Choose the split, check the chain and place this rank's stage; False until the first batch.

        Hand split points and the parameter-count partition are chosen (and their plan printed)
        without data. On the first batch rank 0 measures and decides (measured partition) and
        compares the chain of blocks with the model's forward; the others receive the split, or the
        refusal, so that every rank stops with the same one line.
        """
        if self.stage is not None:
            return True
        o, device = self.options, self.info.device
        ranks = [f"rank {r}" for r in range(o.stages)]
        if not o.needs_profile and self._split is None:
            self._split, text = choose_split(self.blocks, o, [device] * o.stages, labels=ranks)
            self.announce(text)
        if example is None:
            return False
        box: list[Any] = [self._split, None]
        if self.is_first:
            try:
                if o.needs_profile:
                    self._move(lambda: self.model.to(device))
                    box[0], text = choose_split(self.blocks, o, [device] * o.stages, example, labels=ranks)
                    self.announce(text)
                verify_chain(self.model, self.blocks, example)
            except ValueError as e:
                box[1] = str(e)
        dist.broadcast_object_list(box, src=0)
        if box[1] is not None:
            raise ValueError(box[1])
        split = box[0]
        from gputrain.parallel.blocks import split_stages

        stages = split_stages(self.blocks, split)
        rank = self.info.rank

        def place() -> None:
            # Other stages' weights stay on the CPU: never used here, and never saved from here.
            for s, stage in enumerate(stages):
                stage.to(device if s == rank else torch.device("cpu"))

        self._move(place)
        self.stage = stages[rank]
        if self.compile_mode:
            self.stage.compile(mode=self.compile_mode)
        if self.optimizer is not None:  # state loaded before the split (resume): keep only this stage's
            local = {id(p) for p in self.stage.parameters()}
            for p in [p for p in self.optimizer.state if id(p) not in local]:
                del self.optimizer.state[p]
        return True

    def _move(self, move: Callable[[], Any]) -> None:
        move_and_rebind(self.model, self.optimizer, move)

    def local_parameters(self) -> Iterator[nn.Parameter]:
        assert self.stage is not None
        return self.stage.parameters()

    def local_parameter_indices(self, optimizer: torch.optim.Optimizer) -> set[int]:
        """Indices (as in ``optimizer.state_dict()``) of this stage's parameters."""
        local = {id(p) for p in self.local_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i for i, p in enumerate(params) if id(p) in local}

    def local_model_state(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's state_dict, under the plain model's keys, on the CPU."""
        assert self.stage is not None
        return {self.key_map[k]: v.detach().cpu() for k, v in self.stage.state_dict().items()}

    def load_local_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load this stage's part of a whole-model state_dict; refuses one that lacks any model key."""
        assert self.stage is not None
        missing = sorted(set(self.key_map.values()) - set(state))
        if missing:
            raise ValueError(f"the weights lack {len(missing)} key(s) of {type(self.model).__name__} "
                             f"(e.g. {missing[0]!r}); load a state_dict of this model")
        self.stage.load_state_dict({k: state[self.key_map[k]] for k in self.stage.state_dict()})

    # -- running the schedule ----------------------------------------------------------------------------
    def _run(self, chunks: Sequence[Any], *, train: bool) -> _Run:
        """The stage and schedule for ``len(chunks)`` chunks of this shape (made on first use, on every rank)."""
        shape = tuple((tuple(t.shape), t.dtype) for t in tensors_of(chunks[0]))
        key = (train, len(chunks), shape)
        if key not in self._runs:
            assert self.stage is not None
            o, n = self.options, len(chunks)
            stage = PipelineStage(_ContiguousOutputs(self.stage), self.info.rank, o.stages, self.info.device)
            # 1F1B needs at least as many chunks as stages; a short remainder runs as GPipe (same arithmetic).
            kind = Schedule1F1B if o.schedule == "1f1b" and n >= o.stages else ScheduleGPipe
            self._runs[key] = _Run(stage, kind(stage, n, loss_fn=self._chunk_loss if train else None,
                                               scale_grads=False))
        return self._runs[key]

    def _chunk_loss(self, output: Any, target: Any) -> torch.Tensor:
        ctx = self._loss
        assert ctx is not None
        loss = ctx.task.loss(output, target)
        size = batch_len(target)
        ctx.chunk_losses.append((loss.detach().clone(), size))  # a copy: see Strategy.forward_backward
        return loss * (size / ctx.n * ctx.weight)

    def train_step(self, inputs: Any, targets: Any, *, task: Task, weight: float) -> torch.Tensor | None:
        """Forward and backward of one batch through the pipeline; the batch's mean loss on the last stage."""
        chunks = chunk_batch(inputs, self.options.micro_batch_size)
        self.ensure_plan(chunks[0])
        targets_chunks = chunk_batch(targets, self.options.micro_batch_size) if self.is_last else None
        self._loss = _LossContext(task, batch_len(inputs), weight)
        try:
            for a, b in equal_runs([batch_len(c) for c in chunks]):
                run = self._run(chunks[a:b], train=True)
                done = len(self._loss.chunk_losses)
                run.schedule.step(arg_mbs=[(c,) for c in chunks[a:b]] if self.is_first else None,
                                  target_mbs=targets_chunks[a:b] if targets_chunks is not None else None,
                                  return_outputs=False)
                # A new stage first infers shapes with one extra call of the loss on a stand-in output;
                # the chunks' own losses are the last b - a calls.
                calls = self._loss.chunk_losses
                calls[done:] = calls[len(calls) - (b - a):]
            losses = self._loss.chunk_losses
        finally:
            self._loss = None
        if not self.is_last:
            return None
        return sum((loss.float() * size for loss, size in losses), torch.zeros((), device=self.info.device)) \
            / batch_len(inputs)

    def forward(self, x: Any) -> Any:
        """Pipelined inference: the outputs on the last stage; elsewhere zeros of their shape (broadcast, no memory)."""
        chunks = chunk_batch(x, self.options.micro_batch_size)
        self.ensure_plan(chunks[0])
        outputs, meta = [], None
        for a, b in equal_runs([batch_len(c) for c in chunks]):
            run = self._run(chunks[a:b], train=False)
            out = run.schedule.step(arg_mbs=[(c,) for c in chunks[a:b]] if self.is_first else None)
            if run.out_meta is None:  # once per shape: the last stage tells the others what it returns
                box = [_meta(out) if self.is_last else None]
                dist.broadcast_object_list(box, src=self.info.world_size - 1)
                run.out_meta = box[0]
            outputs.append(out)
            meta = run.out_meta
        if self.is_last:
            return cat_outputs(outputs)
        return _stand_in(meta, batch_len(x), self.info.device)


class _ContiguousOutputs(nn.Module):
    """A stage whose outputs, and the gradients it sends back for its inputs, are contiguous. torch's stages size
    their receive buffers with the strides the other side produced, and a compiled stage may produce channels-last
    ones (its outputs, or its inputs' gradients); gloo refuses to send or receive a strided tensor."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *state: torch.Tensor) -> Any:
        out = self.stage(*(_ContiguousGrad.apply(t) if t.requires_grad else t for t in state))
        if isinstance(out, torch.Tensor):
            return out.contiguous()
        return tuple(t.contiguous() for t in out)


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; a contiguous gradient backward."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _meta(out: Any) -> Any:
    """``("tensor", per-sample shape, dtype)``, or ``("tuple", [...])`` for a tuple of outputs."""
    if isinstance(out, torch.Tensor):
        return ("tensor", tuple(out.shape[1:]), out.dtype)
    return ("tuple", [_meta(o) for o in out])


def _stand_in(meta: Any, n: int, device: torch.device) -> Any:
    """Zeros shaped like the last stage's outputs, expanded from one sample (no memory per sample)."""
    if meta[0] == "tensor":
        _, shape, dtype = meta
        return torch.zeros((1, *shape), dtype=dtype, device=device).expand(n, *shape)
    return tuple(_stand_in(m, n, device) for m in meta[1])
