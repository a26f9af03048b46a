"""``--strategy auto``'s choice among the plans (issue 30), on hand-made plans: the margin kept, the fastest preferred."""

from __future__ import annotations

from gputrain.tools.plan.memory import StepMemory
from gputrain.tools.plan.plans import Plan, choose


def test_the_choice_keeps_the_margin_and_prefers_the_fastest():
    def plan(name: str, peak: int, step: float) -> Plan:
        return Plan(name, 2, 8, 4, (StepMemory(peak, 0, 0, 0, 0),), step, budget=1000)

    fast_but_tight, slow = plan("ddp", 950, 1.0), plan("fsdp", 800, 2.0)
    assert fast_but_tight.fits and not fast_but_tight.fits_with_margin
    assert choose([fast_but_tight, slow]) is slow
    assert choose([plan("ddp", 850, 1.0), slow]).strategy == "ddp"
    assert choose([plan("ddp", 901, 1.0)]) is None
    # What --strategy auto hands the ranks: ddp's batch per process is the global batch's share (8 over 2).
    assert "trainer.batch_size=4" in plan("ddp", 1, 1.0).overrides()
    assert "trainer.batch_size=8" in Plan("pipeline", 2, 8, 8, (StepMemory(1, 0, 0, 0, 0),), 1.0, budget=10,
                                          micro_batches=2, schedule="1f1b", split_points=("layer3",)).overrides()
