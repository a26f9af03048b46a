"""Pipeline parallelism: one process per stage, on ``torch.distributed.pipelining`` (GPipe or 1F1B).

Every rank reads the same batches (the data-parallel size is 1); rank ``r`` runs stage ``r`` of the
model's chain of blocks (:mod:`gputrain.parallel.blocks`), cut by hand, by parameter count, or by
measured per-block cost. Only the last stage sees outputs and computes the loss.

Exactness: the loop weights each micro-batch's mean loss by ``n / N`` (its share of the step). The
schedule cuts it further into pipeline chunks, which differ in size on a short batch, so each
chunk's loss is weighted by its own size, ``loss(chunk) * len(chunk) / n * weight``, and the
schedule's own division by the chunk count is turned off (``scale_grads=False``). The gradient is
then exactly the unsplit model's. Chunks are cut at a fixed size, ``ceil(batch_size / M)``, like
the micro-batches of one process with ``accumulate_grad_batches = M``: with BatchNorm, each chunk
is normalised by its own statistics, as there. torch's pipelining needs chunks of one shape per
schedule step, so a short batch runs as a step of full chunks plus a step of the remainder
(gradients accumulate across both).

State: every rank keeps the whole model object (weights outside its stage stay on the CPU, unused)
and an optimizer over all of its parameters, of which only the stage's ever receive gradients or
state. So optimizer state keeps the plain model's parameter indices: gathered from the stages it is
the state one process would hold, and a checkpoint resumes on any stage count, or on ``single``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gputrain.dist import DistInfo, comm
from gputrain.strategies.base import tensors_of
from gputrain.strategies.pipeline_model import PipelinedModel
from gputrain.strategies.stages import SplitOptions, StagedStrategy

if TYPE_CHECKING:
    from gputrain.config import RunConfig
    from gputrain.precision import Precision
    from gputrain.strategies.base import MicroBatch
    from gputrain.tasks.base import Task


class Pipeline(StagedStrategy):
    """One process per stage; ``parallel.schedule`` gpipe or 1f1b over ``parallel.micro_batches`` chunks."""

    name = "pipeline"
    wrapper = PipelinedModel

    def __init__(self, dist_info: DistInfo, *, options: SplitOptions) -> None:
        super().__init__(dist_info)
        self.options = options

    @classmethod
    def from_config(cls, dist_info: DistInfo, cfg: RunConfig) -> Pipeline:
        stages = dist_info.world_size
        if stages == 1:  # one process runs the plain model (e.g. `gputrain eval` of a pipeline checkpoint)
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, split_points=[]))
        # Checked as the launcher did, now with the real stage count and the resolved precision.
        return cls(dist_info, options=SplitOptions.from_config(cfg, stages=stages, strategy=cls.name))

    def describe(self) -> str:
        o = self.options
        return (f"strategy=pipeline stages={o.stages} schedule={o.schedule} micro_batches={o.micro_batches} "
                f"split_size={o.micro_batch_size}")

    # -- topology: every rank reads the whole batch; only the last stage sees outputs ---------------
    @classmethod
    def data_parallel_size(cls, world_size: int) -> int:
        return 1

    @property
    def computes_loss(self) -> bool:
        return self.dist.rank == self.dist.world_size - 1

    def has_forward_collectives(self, module: nn.Module) -> bool:
        return False

    # -- model --------------------------------------------------------------------------------
    def setup_module(self, model: nn.Module) -> nn.Module:
        if self.dist.world_size == 1:
            # One stage (e.g. `gputrain eval` of a pipeline checkpoint on one process): the model itself.
            return model.to(self.dist.device)
        from gputrain.parallel.blocks import (  # imports torchvision: only here
            block_key_map,
            sequential_blocks,
        )

        blocks = sequential_blocks(model, children_in_order=bool(self.options.split_points))
        module = PipelinedModel(model, blocks, block_key_map(model, blocks), self.options, self.dist,
                                announce=self._announce_plan)
        if not module.ensure_plan() and self.options.needs_profile:
            self._announce_wait()
        return module


    def forward_backward(self, module: nn.Module, micro: MicroBatch, *, task: Task,
                         precision: Precision) -> torch.Tensor | None:
        if not isinstance(module, PipelinedModel):
            return super().forward_backward(module, micro, task=task, precision=precision)
        if micro.inputs is None:
            return None
        if task.targets_to_model:
            raise ValueError(f"strategy pipeline cannot run task {type(task).__name__}: its model takes the targets "
                             "in forward; use ddp or model_parallel")
        with precision.forward_context():
            return module.train_step(micro.inputs, micro.targets, task=task, weight=micro.weight)

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """The global norm over all stages: each stage's squared norm, summed over ranks."""
        if not isinstance(module, PipelinedModel):
            return super().clip_grad_norm(module, max_norm)
        params = [p for p in module.local_parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.dist.device)
        total = comm.all_reduce(local.double().pow(2).reshape(1)).sqrt().to(local.dtype).reshape(())
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    # -- checkpoints: the plain model's keys and parameter indices, gathered on rank 0 --------------
    def model_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state_dict on rank 0 (a collective once split; empty dict on other ranks)."""
        if not isinstance(module, PipelinedModel) or module.stage is None:
            return super().model_state_dict(module)
        parts = comm.gather_objects(module.local_model_state())
        if parts is None:
            return {}
        return {k: v for part in parts for k, v in part.items()}

    def load_model_state_dict(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        if not isinstance(module, PipelinedModel) or module.stage is None:
            return super().load_model_state_dict(module, state)
        module.load_local_model_state(state)

    def named_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        if not isinstance(module, PipelinedModel) or module.stage is None:
            return super().named_weights(module)
        return {module.key_map[k]: v for k, v in module.stage.state_dict().items()}  # this stage's, live

    def optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """One process's optimizer state (indices of the plain model's parameters) on rank 0; a collective."""
        if not isinstance(module, PipelinedModel) or module.stage is None:
            return super().optimizer_state_dict(module, optimizer)
        local = optimizer.state_dict()
        on_cpu = {i: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in local["state"].items()}
        parts = comm.gather_objects(on_cpu)
        if parts is None:
            return {}
        return {"state": {i: s for part in parts for i, s in part.items()}, "param_groups": local["param_groups"]}

    def load_optimizer_state_dict(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        if isinstance(module, PipelinedModel) and module.stage is not None:
            local = module.local_parameter_indices(optimizer)
            state = {**state, "state": {i: s for i, s in state["state"].items() if int(i) in local}}
        optimizer.load_state_dict(state)

    def local_tensors(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        if not isinstance(module, PipelinedModel) or module.stage is None:
            yield from super().local_tensors(module, optimizer)
            return
        yield from module.stage.parameters()
        yield from module.stage.buffers()
        yield from tensors_of(optimizer.state_dict()["state"])

    def eval_module(self, module: nn.Module) -> nn.Module:
        return module

