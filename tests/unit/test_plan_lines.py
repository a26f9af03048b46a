"""The plan's table and lines read one way (issue 43 item 5): the fits column says yes only for a plan the choice
may take (its 10 % margin), sizes are shown in units that show them, and no plan fitting is a `gputrain: error:`
line."""

from __future__ import annotations

from gputrain.tools.plan.memory import StepMemory
from gputrain.tools.plan.plans import Plan, choose, fits_cell, why

MIB = 2**20


def _plan(label: str, peak_mib: float, budget_mib: float, step_s: float = 1.0) -> Plan:
    memory = StepMemory(parameters=int(peak_mib * MIB), gradients=0, optimizer=0, activations=0, other=0)
    return Plan(label, 1, 8, 8, (memory,), step_s, int(budget_mib * MIB))


def test_the_fits_column_and_the_choice_use_one_rule():
    tight = _plan("single", peak_mib=95, budget_mib=100, step_s=0.5)  # within the budget, not within the margin
    roomy = _plan("ddp", peak_mib=50, budget_mib=100, step_s=1.0)
    assert (fits_cell(tight), fits_cell(roomy)) == ("no (10% margin)", "yes")
    assert fits_cell(_plan("fsdp", peak_mib=120, budget_mib=100)) == "NO"
    assert choose([tight, roomy]) is roomy  # the faster one is left out, as its cell says
    assert roomy.as_json()["fits"] is True and tight.as_json()["fits"] is False and tight.as_json()["within_budget"]


def test_the_chosen_line_shows_small_sizes_in_units_that_show_them():
    line = why(_plan("ddp", peak_mib=5.5, budget_mib=12), [])
    assert "predicted peak 5.50 MiB per device of 12.00 MiB" in line, line
