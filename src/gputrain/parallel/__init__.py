"""Splitting a model into stages: blocks, per-block profiling and partitioning (docs/partitioning.md).

These are building blocks for the strategies that split a model (model_parallel, pipeline) and for
choosing a strategy from predicted memory and time; nothing here starts processes or moves models.
"""

from gputrain.parallel.blocks import (
    Block,
    Stage,
    block_key_map,
    run_blocks,
    sequential_blocks,
    split_stages,
    to_model_state_dict,
)
from gputrain.parallel.chain_check import check_blocks
from gputrain.parallel.partition import partition_by_cost, partition_by_params, plan_from_split_points
from gputrain.parallel.plan import (
    PipelinePlan,
    StagePlan,
    activation_scale,
    bubble,
    format_plan,
    make_plan,
    plan_from_costs,
)
from gputrain.parallel.profile import BlockCost, profile_blocks

__all__ = [
    "Block",
    "BlockCost",
    "PipelinePlan",
    "Stage",
    "StagePlan",
    "activation_scale",
    "block_key_map",
    "bubble",
    "check_blocks",
    "format_plan",
    "make_plan",
    "partition_by_cost",
    "partition_by_params",
    "plan_from_costs",
    "plan_from_split_points",
    "profile_blocks",
    "run_blocks",
    "sequential_blocks",
    "split_stages",
    "to_model_state_dict",
]
