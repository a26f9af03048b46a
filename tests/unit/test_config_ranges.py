"""Every number in the config has a declared range and a value outside it is refused in one line (issue 15 item 4)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

import gputrain.config as config_module
from gputrain.config import RunConfig, builtin_recipes, load_config
from gputrain.config_checks import INT32_MAX, RANGES, Range, range_of


def _numeric_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, type, bool]]:
    """(dotted name, field, number type, is a list) of every int/float field, from the annotations."""
    out = []
    hints = typing.get_type_hints(cls, vars(config_module))
    for f in dataclasses.fields(cls):
        hint, name = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            out += _numeric_fields(hint, f"{name}.")
            continue
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
        is_list = typing.get_origin(args[0]) is list
        inner = typing.get_args(args[0])[0] if is_list else args[0]
        if inner in (int, float):
            out.append((name, f, inner, is_list))
    return out


FIELDS = _numeric_fields(RunConfig)


def _bad_values(allowed: Range, kind: type) -> list[float]:
    """Values just outside each bound, and (for floats) the non-finite ones."""
    bad = []
    if allowed.ge is not None:
        bad.append(allowed.ge - 1)
    if allowed.gt is not None:
        bad.append(allowed.gt)
    if allowed.le is not None:
        bad.append(allowed.le + 1)
    if allowed.lt is not None:
        bad.append(allowed.lt)
    if kind is float:
        bad += [math.inf, -math.inf, math.nan]
    return [int(v) if kind is int else v for v in bad]


def test_the_walk_finds_the_numbers_we_know_of():
    names = {name for name, *_ in FIELDS}
    assert {"optim.lr", "trainer.epochs", "data.val_fraction", "trainer.dp_device_ids",
            "parallel.stage_memory_gib", "launch.max_restarts"} <= names
    assert "trainer.overwrite" not in names  # a bool is not a number here


@pytest.mark.parametrize("name,field,kind,is_list", FIELDS, ids=[f[0] for f in FIELDS])
def test_every_numeric_field_declares_a_range_and_refuses_values_outside_it(name, field, kind, is_list):
    allowed = range_of(name, field)
    assert allowed is not None, (f"{name} has no declared range: add it to gputrain.config_checks.RANGES or "
                                 "declare metadata=bounds(...) on the field")
    assert allowed.describe().startswith("must be ")
    cases = _bad_values(allowed, kind)
    assert cases, f"{name}: the range {allowed} has no bound to cross"
    for bad in cases:
        text = "nan" if isinstance(bad, float) and math.isnan(bad) else ".inf" if bad == math.inf else (
            "-.inf" if bad == -math.inf else repr(bad))
        override = f"{name}=[{text}]" if is_list else f"{name}={text}"
        with pytest.raises(ValueError) as err:
            load_config(None, [override])
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith(f"{name}="), message
        assert allowed.describe().removeprefix("must be ") in message, message


def test_values_on_the_bounds_are_taken():
    cfg = load_config(None, ["optim.lr=100", "optim.momentum=0", "data.val_fraction=0", "trainer.seed=4294967295",
                             f"trainer.epochs={INT32_MAX}", "trainer.grad_clip_norm=0"])
    assert (cfg.optim.lr, cfg.trainer.seed, cfg.trainer.epochs) == (100, 4294967295, INT32_MAX)


@pytest.mark.parametrize("recipe", builtin_recipes())
def test_built_in_recipes_are_in_range(recipe):
    load_config(recipe)


def test_ranges_table_names_only_fields_that_exist():
    names = {name for name, *_ in FIELDS}
    assert set(RANGES) <= names, set(RANGES) - names


def test_wrong_type_in_a_recipe_file_names_the_file_and_line(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("task: autoencoder\ntrainer:\n  batch_size: 4\n  epochs: ten\n")
    with pytest.raises(ValueError) as err:
        load_config(str(recipe))
    assert str(err.value).startswith(f"recipe {recipe} line 4: bad value for trainer.epochs: Value 'ten'")
    assert "\n" not in str(err.value)


def test_lr_1e39_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gputrain", "train", "autoencoder", "optim.lr=1e39"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["gputrain: error: optim.lr=1e+39 must be in (0, 100]"]
    assert list(Path(tmp_path).iterdir()) == []


def test_a_python_api_config_is_checked_as_the_command_line_checks_it():
    from gputrain import Trainer

    with pytest.raises(ValueError, match=r"^trainer\.epochs=0 must be at least 1"):
        Trainer(epochs=0)
    with pytest.raises(ValueError, match=r"^optim\.lr=inf must be finite"):
        Trainer(config_module.RunConfig(optim=config_module.OptimConfig(lr=float("inf"))))
