"""issue 30 (in progress): ``--memory-budget`` sizes, with hand-written answers."""

from __future__ import annotations

import pytest

from gputrain.tools.plan.budget import available_ram, device_budget, parse_size


@pytest.mark.parametrize(("text", "want"), [
    ("12GiB", 12 * 1024**3), ("16gib", 17179869184), ("800MB", 800_000_000), ("1.5 GB", 1_500_000_000),
    ("4096", 4096), ("64KiB", 65536), ("2tb", 2 * 10**12), ("7b", 7),
])
def test_sizes_parse_to_bytes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "twelve", "12 GiBs", "-1GB", "0", "1e9", "12 G"])
def test_a_size_that_cannot_be_read_is_one_line_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"^--memory-budget .*(give a size|more than 0)") as err:
        parse_size(text)
    assert "\n" not in str(err.value)


def test_a_cpu_budget_is_the_available_ram():
    budget = device_budget("cpu")
    assert budget == pytest.approx(available_ram(), rel=0.2) and 0 < budget <= 2**50
