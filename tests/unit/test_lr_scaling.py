"""Learning-rate scaling by the global batch: a pure function."""

from __future__ import annotations

import math

import pytest

from gputrain.optim import scaled_lr


@pytest.mark.parametrize(("rule", "expected"), [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_scaling_rules(rule, expected):
    assert scaled_lr(0.1, 1024, 256, rule) == pytest.approx(expected)


def test_reference_batch_gives_the_lr_unchanged_and_halving_the_batch_halves_linear():
    assert scaled_lr(0.05, 128, 128, "linear") == 0.05 and scaled_lr(0.05, 128, 128, "sqrt") == 0.05
    assert scaled_lr(0.05, 64, 128, "linear") == pytest.approx(0.025)
    assert scaled_lr(0.05, 64, 128, "sqrt") == pytest.approx(0.05 / math.sqrt(2))


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"^optim.scale_lr='cubic' is unknown; choose none, linear or sqrt$"):
        scaled_lr(0.1, 64, 256, "cubic")
    with pytest.raises(ValueError, match=r"^optim.reference_batch=0 must be a positive"):
        scaled_lr(0.1, 64, 0, "linear")
    with pytest.raises(ValueError, match=r"optim.reference_batch=-3"):
        scaled_lr(0.1, 64, -3, "none")
