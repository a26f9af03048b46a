"""What model_parallel and pipeline share: stage devices, micro-batch cutting, and choosing the split.

Pure functions (devices, sizes, which block goes where) are tested without processes or GPUs
(tests/unit/test_model_parallel_placement.py). :func:`choose_split` is the one place that turns
``parallel.*`` settings into split indices and the plan text printed at start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gputrain.config.checks import check_micro_batches, check_split_options
from gputrain.strategies.base import Strategy
from gputrain.strategies.micro_batches import batch_len, chunk_batch, micro_batch_sizes, split_size

if TYPE_CHECKING:
    from gputrain.config import OptimConfig, RunConfig
    from gputrain.parallel.blocks import Block

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class SplitOptions:
    """The ``parallel.*`` settings that decide how a model is cut, plus what profiling needs to know."""

    stages: int
    micro_batches: int
    split_points: tuple[str, ...] = ()
    partition: str = "measured"
    schedule: str = "gpipe"
    memory_caps: tuple[float, ...] = ()
    """Bytes per stage (one value for all, or one per stage); empty: the device's memory on CUDA, none on CPU."""
    batch_size: int = 1
    """trainer.batch_size: the batch each step's micro-batches are cut from."""
    optimizer: str = "sgd"

    @property
    def micro_batch_size(self) -> int:
        return split_size(self.batch_size, self.micro_batches)

    @property
    def needs_profile(self) -> bool:
        """Only the measured partitioner needs an example batch (and so waits for the first one)."""
        return not self.split_points and self.partition == "measured" and self.stages > 1

    @classmethod
    def from_config(cls, cfg: RunConfig, stages: int, strategy: str) -> SplitOptions:
        p = cfg.parallel
        if p.micro_batches < 1:
            raise ValueError(f"parallel.micro_batches={p.micro_batches} must be at least 1")
        check_split_options(cfg, stages, strategy)  # as the launcher did, with the resolved precision and stages
        return cls(stages=stages, micro_batches=p.micro_batches, split_points=tuple(p.split_points),
                   partition=p.partition, schedule=p.schedule,
                   memory_caps=tuple(g * GIB for g in p.stage_memory_gib), batch_size=cfg.trainer.batch_size,
                   optimizer=cfg.optim.name)


# -- devices -----------------------------------------------------------------------------------
def resolve_stage_devices(spec: Sequence[str], stages: int, *, accelerator: str, cuda_count: int) -> list[torch.device]:
    """The device of each stage: ``spec`` (parallel.stage_devices) as given, else one GPU per stage.

    Without ``spec``: ``cuda:0, cuda:1, ...`` when the accelerator is CUDA (stages beyond the GPU count
    wrap around, so a one-GPU machine runs every stage on cuda:0), else every stage on the CPU.
    ``spec``, when given, also sets the number of stages.
    """
    if not spec:
        if stages < 1:
            raise ValueError(f"parallel.stages={stages} must be at least 1")
        if accelerator == "cuda" and cuda_count > 0:
            return [torch.device("cuda", i % cuda_count) for i in range(stages)]
        return [torch.device("cpu")] * stages
    devices = []
    for i, name in enumerate(spec):
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"parallel.stage_devices[{i}]={name!r} is not a device; write cpu, cuda:0, cuda:1, ...") from None
        if device.type == "cuda":
            index = 0 if device.index is None else device.index
            if index >= cuda_count:
                raise ValueError(
                    f"parallel.stage_devices[{i}]={name!r} but this machine has {cuda_count} visible GPU(s); "
                    f"use cuda:0 .. cuda:{max(cuda_count - 1, 0)} or cpu"
                )
            device = torch.device("cuda", index)
        devices.append(device)
    return devices


def stage_of_blocks(n_blocks: int, split_indices: Sequence[int]) -> list[int]:
    """The stage (0-based) of each of ``n_blocks`` blocks cut before ``split_indices``."""
    return [sum(1 for s in split_indices if s <= i) for i in range(n_blocks)]


def block_devices(names: Sequence[str], split_indices: Sequence[int], devices: Sequence[torch.device]) -> dict[str, torch.device]:
    """Block name -> the device of its stage; one device per stage."""
    if len(devices) != len(split_indices) + 1:
        raise ValueError(f"{len(split_indices) + 1} stages but {len(devices)} stage devices; give one per stage")
    return {name: devices[s] for name, s in zip(names, stage_of_blocks(len(names), split_indices), strict=True)}


# -- choosing the split ----------------------------------------------------------------------------
def memory_caps(options: SplitOptions, devices: Sequence[torch.device]) -> list[float] | None:
    """Per-stage caps in bytes: given ones, else each CUDA device's memory; None on CPU (no cap)."""
    if options.memory_caps:
        return list(options.memory_caps)
    if all(d.type == "cuda" for d in devices):
        return [float(torch.cuda.get_device_properties(d).total_memory) for d in devices]
    return None


def choose_split(blocks: Sequence[Block], options: SplitOptions, devices: Sequence[torch.device],
                 example: Any = None, labels: Sequence[str] = ()) -> tuple[list[int], str]:
    """Split indices for ``options.stages`` stages and the plan text to print.

    Hand split points and the parameter-count partition need no data. The measured partition
    profiles every block (already on ``devices[0]``) on ``example``, one micro-batch, and scales
    the figures to the whole batch; the profiler restores BatchNorm statistics, and the RNG is
    forked so that profiling draws no random numbers from the training stream. ``labels`` say where
    each stage runs in the printed plan (default: its device).
    """
    # gputrain.parallel imports torchvision (its block adapters): imported when a model is split, not with gputrain.
    from gputrain.parallel.partition import partition_by_params, plan_from_split_points
    from gputrain.parallel.plan import format_plan, plan_from_costs
    names = [name for name, _ in blocks]
    where = list(labels) or [str(d) for d in devices]
    if options.stages == 1:
        return [], _simple_plan(blocks, [], where, options, "one stage")
    if options.split_points:
        split = plan_from_split_points(names, options.split_points, field="parallel.split_points")
        return split, _simple_plan(blocks, split, where, options, "split_points")
    if options.partition == "params":
        split = partition_by_params([sum(p.numel() for p in b.parameters()) for _, b in blocks], options.stages)
        return split, _simple_plan(blocks, split, where, options, "params")
    from gputrain.parallel.profile import profile_blocks

    if example is None:
        raise ValueError("the measured partition needs an example batch; give parallel.split_points instead")
    forked = [d for d in {devices[0]} if d.type == "cuda"]
    with torch.random.fork_rng(devices=forked), torch.enable_grad():
        costs = profile_blocks(blocks, example, device=devices[0], optimizer=options.optimizer)
    scale = options.batch_size / batch_len(example)
    costs = [dataclasses.replace(c, forward_backward_s=c.forward_backward_s * scale,
                                 activation_bytes=int(c.activation_bytes * scale),
                                 output_bytes=int(c.output_bytes * scale)) for c in costs]
    plan = plan_from_costs(costs, options.stages, partition="measured", memory_caps=memory_caps(options, devices),
                           micro_batches=options.micro_batches, schedule=options.schedule)
    return list(plan.split_indices), f"{format_plan(plan)}\nstages on: {', '.join(where)}"


def _label(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} blocks)"


def _simple_plan(blocks: Sequence[Block], split: Sequence[int], where: Sequence[str], options: SplitOptions,
                 method: str) -> str:
    """The plan without measured times: blocks, device and parameters per stage, and the bubble."""
    from gputrain.parallel.partition import format_bytes
    from gputrain.parallel.plan import bubble
    bounds = [0, *split, len(blocks)]
    rows = [("stage", "blocks", "on", "params")]
    for s, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        params = sum(p.numel() * p.element_size() for _, blk in blocks[a:b] for p in blk.parameters())
        rows.append((str(s + 1), _label([n for n, _ in blocks[a:b]]), where[s], format_bytes(params)))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    k, m = len(bounds) - 1, options.micro_batches
    lines.append(f"{k} stage{'s' if k != 1 else ''} by {method}, {m} micro-batch{'es' if m != 1 else ''} "
                 f"of {options.micro_batch_size} ({options.schedule}): bubble {bubble(k, m):.1%} "
                 "(parallel.partition=measured also predicts time and memory)")
    return "\n".join(lines)


# -- checking that the chain is the model's forward ---------------------------------------------------
CHECK_SAMPLES = 2
"""Samples of the first batch on which the chain is compared with ``model.forward`` (eval mode: BatchNorm
uses its running statistics, so the comparison does not depend on how many)."""


def verify_chain(model: torch.nn.Module, blocks: Sequence[Block], example: Any) -> None:
    """Refuse, in one line, a split whose chain of blocks does not compute ``model(example)``.

    Runs on the device of the model's first parameter, in eval mode without gradients (BatchNorm
    statistics untouched, mode restored), with the RNG forked so training draws the same numbers.
    """
    from gputrain.parallel.chain_check import check_blocks
    from gputrain.strategies.base import move_to_device

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    sample = move_to_device(chunk_batch(example, CHECK_SAMPLES)[0], device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        check_blocks(model, blocks, sample)


# -- moving parameters after the optimizer was built ---------------------------------------------------
def rebind_optimizer(optimizer: torch.optim.Optimizer | None, before: Sequence[torch.nn.Parameter],
                     after: Sequence[torch.nn.Parameter]) -> None:
    """After moving a model whose optimizer already exists: point the optimizer at the moved parameters
    (``Module.to`` may create new ones, e.g. to ``meta``) and move its state tensors beside them."""
    if optimizer is None:
        return
    moved = {id(old): new for old, new in zip(before, after, strict=True)}
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    state = {}
    for p, entry in optimizer.state.items():
        new = moved.get(id(p), p)
        # Per-parameter tensors follow the parameter; scalars (Adam's step) stay where the optimizer keeps them.
        state[new] = {k: v.to(new.device) if isinstance(v, torch.Tensor) and v.shape == new.shape else v
                      for k, v in entry.items()}
    optimizer.state.clear()
    optimizer.state.update(state)


def move_and_rebind(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, move: Any) -> None:
    """Run ``move()`` (which moves parts of ``model`` to their devices) and point ``optimizer`` at the moved parameters."""
    before = list(model.parameters())
    move()
    rebind_optimizer(optimizer, before, list(model.parameters()))


class StagedStrategy(Strategy):
    """What model_parallel and pipeline share: a wrapper module holding the user's model, and a printed plan.

    The wrapper class (``wrapper``) has ``.model`` (the unmodified model) and ``.optimizer`` (bound after
    setup, so a split chosen on the first batch can move parameters and rebind the optimizer).
    """

    wrapper: ClassVar[type[torch.nn.Module]]
    splits_batch = True
    options: SplitOptions

    def check_batch(self, batch_size: int, model: torch.nn.Module | None = None) -> None:
        """At least one sample per micro-batch; two where the model trains BatchNorm, which cannot normalise one."""
        m = self.options.micro_batches
        check_micro_batches(batch_size, m)
        norms = [name for name, module in (model.named_modules() if model is not None else [])
                 if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training]
        if norms and m > 1 and min(micro_batch_sizes(batch_size, m)) > 1:
            self._announce_micro_batch_norm(norms, batch_size, m)
        if not norms or min(micro_batch_sizes(batch_size, m)) > 1:
            return
        fits = [k for k in range(m - 1, 0, -1)  # the most micro-batches that all hold 2 samples or more
                if min(micro_batch_sizes(batch_size, k)) > 1 and len(micro_batch_sizes(batch_size, k)) == k]
        fix = f"use parallel.micro_batches={fits[0]}" if fits else "use a batch of at least 2"
        raise ValueError(f"parallel.micro_batches={m} cuts trainer.batch_size={batch_size} into micro-batches of "
                         f"{'+'.join(map(str, micro_batch_sizes(batch_size, m)))} samples, and the model's BatchNorm "
                         f"({norms[0]} and {len(norms) - 1} more) cannot train on a micro-batch of 1 sample; {fix}")

    def _announce_micro_batch_norm(self, norms: list[str], batch_size: int, m: int) -> None:
        """One line at start: micro-batches change what BatchNorm computes, as in any GPipe-style pipeline."""
        if self.dist.is_main:
            sizes = "+".join(map(str, micro_batch_sizes(batch_size, m)))
            print(f"gputrain: {self.name}: BatchNorm ({norms[0]} and {len(norms) - 1} more) normalises each of the {m} "
                  f"micro-batches ({sizes} samples) with its own statistics, so this trains what single trains with "
                  f"trainer.accumulate_grad_batches={m}, not single at batch {batch_size}; parallel.micro_batches=1 "
                  "or a model without BatchNorm trains the same model as single (docs/strategies.md)", flush=True)

    def compile_module(self, module: torch.nn.Module, mode: str) -> None:
        """Each stage is compiled on its own device, when the first batch places it (``compile_mode`` of the wrapper)."""
        if isinstance(module, self.wrapper):
            module.compile_mode = mode  # type: ignore[assignment]
        else:  # one process holding the whole model
            super().compile_module(module, mode)

    def _announce_plan(self, text: str) -> None:
        if self.dist.is_main:
            print(f"gputrain: {self.name} plan\n{text}", flush=True)

    def _announce_wait(self) -> None:
        """One line at setup when the measured partition waits for the first batch; the plan header comes once, then."""
        if self.dist.is_main:
            print(f"gputrain: {self.name}: parallel.partition=measured chooses the split on the first batch, from "
                  "per-block time and memory measured on it", flush=True)

    def setup_optimizer(self, module: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
        optimizer = super().setup_optimizer(module, cfg)
        if isinstance(module, self.wrapper):
            module.optimizer = optimizer  # type: ignore[assignment]  # the wrapper declares it
        return optimizer

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        inner = module.model if isinstance(module, self.wrapper) else None
        return inner if isinstance(inner, torch.nn.Module) else super().unwrap(module)
