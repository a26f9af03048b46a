"""Pipeline partitioning: the partitioner's arithmetic (costs, parameters, memory caps, schedules, hand split
points) and the plan it predicts. Blocks and their profiling: test_pipeline_blocks.py."""

from __future__ import annotations

import pytest
import torchvision

from gputrain.parallel import (
    BlockCost,
    activation_scale,
    bubble,
    format_plan,
    make_plan,
    partition_by_cost,
    partition_by_params,
    plan_from_costs,
    plan_from_split_points,
    sequential_blocks,
)
from resnet_blocks import RESNET_BLOCKS

# --- the partitioner: pure arithmetic ---------------------------------------------------------


def test_equal_costs_split_evenly():
    assert partition_by_cost([1, 1, 1, 1], 2) == [2]
    assert partition_by_cost([1, 1, 1, 1], 4) == [1, 2, 3]
    assert partition_by_cost([1, 1, 1, 1], 1) == []
    assert partition_by_cost([5, 1, 1, 1, 1, 1], 2) == [1]
    assert partition_by_cost([1, 2, 3, 4, 5, 6], 3) == [3, 5]  # 6 | 9 | 6


def test_ties_go_to_the_most_even_split():
    # Any split with the 4 alone has bottleneck 4; the rest should still be halved, not 1 | 3.
    assert partition_by_cost([4, 1, 1, 1, 1], 3) == [1, 3]


def test_too_many_stages_is_refused():
    with pytest.raises(ValueError, match="cannot cut 3 blocks into 4 stages; use 1 to 3 stages"):
        partition_by_cost([1, 1, 1], 4)


def test_parameter_count_and_time_disagree_on_resnet50():
    model = torchvision.models.resnet50(weights=None)
    params = [sum(p.numel() for p in block.parameters()) for _, block in sequential_blocks(model)]
    # Forward+backward seconds per block, shaped like a CPU profile of ResNet-50 at 224 px: each
    # layer costs about the same, while layer4 and fc hold 2/3 of the parameters.
    times = [0.10, 0.03, 0.01, 0.02, 0.50, 0.55, 0.80, 0.45, 0.002, 0.0, 0.01]
    by_params, by_time = partition_by_params(params, 2), partition_by_cost(times, 2)
    assert RESNET_BLOCKS[by_params[0]] == "layer4"  # 8.5 M | 17 M parameters
    assert RESNET_BLOCKS[by_time[0]] == "layer3"  # 1.21 s | 1.26 s

    def slowest(split: list[int]) -> float:
        return max(sum(times[: split[0]]), sum(times[split[0] :]))

    assert slowest(by_params) > 1.5 * slowest(by_time)


def test_memory_cap_forces_a_slower_split():
    assert partition_by_cost([1, 1, 1, 1], 2, memory=[1, 1, 1, 5]) == [2]
    # Stage 2 may hold at most 5 bytes: only the last block fits there, so time 3 | 1 instead of 2 | 2.
    assert partition_by_cost([1, 1, 1, 1], 2, memory=[1, 1, 1, 5], memory_caps=[10, 5]) == [3]


def test_activations_scale_with_the_schedule():
    assert activation_scale(2, 4, "gpipe") == [1.0, 1.0]
    assert activation_scale(2, 4, "1f1b") == [0.5, 0.25]
    assert activation_scale(3, 1, "1f1b") == [1.0, 1.0, 1.0]
    costs, static, act = [1, 1, 1, 1], [0, 0, 0, 0], [4, 1, 1, 1]
    # 1F1B: stage 1 holds 2 of 4 micro-batches, so [4, 1] needs 2.5 > 2.4 and [4] needs 2.0.
    scale = activation_scale(2, 4, "1f1b")
    kw = {"activation": act, "activation_scale": scale, "memory_caps": [2.4]}
    assert partition_by_cost(costs, 2, static, **kw) == [1]
    with pytest.raises(ValueError, match="stage 1 .* needs 4 B"):  # GPipe holds the whole batch
        partition_by_cost(costs, 2, static, activation=act, memory_caps=[2.4])


def test_no_fit_names_the_stage_and_the_cap_that_would_fit():
    names = ["a", "b", "c"]
    msg = r"no 2-stage split fits the memory caps: at best stage 2 \(b\.\.c\) needs 6 B but its cap is 4 B; "
    with pytest.raises(ValueError, match=msg + "a cap of 6 B per stage would fit, or use more stages$"):
        partition_by_cost([1, 1, 1], 2, memory=[3, 3, 3], memory_caps=[4], names=names)
    with pytest.raises(ValueError, match=r"block a alone exceeds every cap: lower the batch"):
        partition_by_cost([1, 1], 2, memory=[5 * 2**30, 1], memory_caps=[4 * 2**30], names=["a", "b"])
    with pytest.raises(ValueError, match=r"caps 1\.50x as large would fit"):
        partition_by_cost([1, 1, 1], 2, memory=[3, 3, 3], memory_caps=[2, 4])
    with pytest.raises(ValueError, match="memory_caps"):
        partition_by_cost([1, 1, 1], 2, memory=[3, 3, 3], memory_caps=[4, 4, 4])


def test_hand_split_points():
    assert plan_from_split_points(RESNET_BLOCKS, ["layer3"]) == [6]
    assert plan_from_split_points(RESNET_BLOCKS, ["layer2", "layer4"]) == [5, 7]
    assert plan_from_split_points(RESNET_BLOCKS, []) == []
    with pytest.raises(
        ValueError, match=r"split_points\[1\]='layer9' is not a block; valid names in order: conv1, bn1"
    ):
        plan_from_split_points(RESNET_BLOCKS, ["layer2", "layer9"])
    with pytest.raises(ValueError, match="first block, so stage 1 would be empty"):
        plan_from_split_points(RESNET_BLOCKS, ["conv1"])
    with pytest.raises(ValueError, match=r"split_points\[1\]='layer2' does not come after 'layer3'"):
        plan_from_split_points(RESNET_BLOCKS, ["layer3", "layer2"])


def test_bubble_formula():
    assert bubble(1, 4) == 0
    assert bubble(2, 1) == 0.5
    assert bubble(2, 4) == pytest.approx(0.2)
    assert bubble(4, 8) == pytest.approx(3 / 11)


def fake_costs() -> list[BlockCost]:
    spec = [
        ("a", 2.0, 10, 100),
        ("b", 1.0, 1000, 40),
        ("c", 1.0, 500, 20),
    ]  # name, seconds, params, saved bytes
    return [BlockCost(n, t, p, 4 * p, 4 * p, 4 * p, act, 8) for n, t, p, act in spec]


def test_plan_predicts_time_memory_and_prints_a_table():
    plan = make_plan(fake_costs(), [1], micro_batches=4)
    assert [s.blocks for s in plan.stages] == [("a",), ("b", "c")]
    assert [s.time_s for s in plan.stages] == [2.0, 2.0]
    assert plan.step_time_s == pytest.approx(2.0 * 5 / 4)  # (M + K - 1) t / M
    assert plan.stages[1].memory_bytes == 12 * 1500 + 60  # params, grads, momentum + whole-batch activations
    one_f = make_plan(fake_costs(), [1], micro_batches=4, schedule="1f1b")
    assert [s.activation_bytes for s in one_f.stages] == [50, 15]
    assert make_plan(fake_costs(), [2]).step_time_s == 4.0  # M = 1: the naive split runs stages in turn
    text = format_plan(plan)
    assert (
        "b, c" in text
        and "2000.0 ms" in text
        and "bubble 20.0%" in text
        and "predicted step 2500.0 ms" in text
    )


def test_plan_from_costs_follows_the_settings():
    costs = fake_costs()
    assert plan_from_costs(costs, 2).split_indices == (1,)
    assert plan_from_costs(costs, 2, partition="params").split_indices == (
        2,
    )  # 1010 | 500 beats 10 | 1500 parameters
    hand = plan_from_costs(costs, 2, split_points=["c"])
    assert hand.split_indices == (2,) and hand.method == "split_points"
    with pytest.raises(ValueError, match="split_points has 2 names for 2 stages; give 1"):
        plan_from_costs(costs, 2, split_points=["b", "c"])
    with pytest.raises(ValueError, match="partition='flops' is unknown"):
        plan_from_costs(costs, 2, partition="flops")
