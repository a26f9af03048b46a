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
import gputrain.config.schema as schema_module
from gputrain.config import RunConfig, builtin_recipes, load_config
from gputrain.config.checks import INT32_MAX, RANGES, Range, range_of


def _numeric_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, type, bool]]:
    """(dotted name, field, number type, is a list) of every int/float field, from the annotations."""
    out = []
    hints = typing.get_type_hints(cls, vars(schema_module))
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


# -- the ranges as docs/config.md states them, written out by hand (issue 28 item 11) ------------------------------
# The table test above builds its "just outside" values from RANGES itself, so a bound flipped in RANGES (lt=1 ->
# le=1) moves its expectation with it. These literal values and messages come from the documented table instead.
_ATOM = "must be at least 1 and at most 2147483647"
_ZERO = "must be at least 0 and at most 2147483647"
_SEED = "must be at least 0 and at most 4294967295"
REFUSED = [
    ("optim.lr=0", "optim.lr=0.0 must be in (0, 100]"),
    ("optim.lr=100.5", "optim.lr=100.5 must be in (0, 100]"),
    ("scheduler.power=0", "scheduler.power=0.0 must be in (0, 100]"),
    ("scheduler.power=101", "scheduler.power=101.0 must be in (0, 100]"),
    ("optim.momentum=1", "optim.momentum=1.0 must be in [0, 1)"),
    ("optim.momentum=-0.1", "optim.momentum=-0.1 must be in [0, 1)"),
    ("optim.weight_decay=1.5", "optim.weight_decay=1.5 must be in [0, 1]"),
    ("optim.weight_decay=-0.5", "optim.weight_decay=-0.5 must be in [0, 1]"),
    ("scheduler.min_lr_ratio=1.01", "scheduler.min_lr_ratio=1.01 must be in [0, 1]"),
    ("scheduler.min_lr_ratio=-0.01", "scheduler.min_lr_ratio=-0.01 must be in [0, 1]"),
    ("scheduler.gamma=0", "scheduler.gamma=0.0 must be in (0, 1]"),
    ("scheduler.gamma=1.5", "scheduler.gamma=1.5 must be in (0, 1]"),
    ("data.val_fraction=1", "data.val_fraction=1.0 must be in [0, 1), e.g. 0.2 for an 8:2 split"),
    ("data.val_fraction=-0.1", "data.val_fraction=-0.1 must be in [0, 1), e.g. 0.2 for an 8:2 split"),
    ("optim.pretrained_lr_scale=0", "optim.pretrained_lr_scale=0.0 must be in (0, 1000], e.g. 0.1 for pretrained "
                                    "layers 10x slower than the head"),
    ("optim.pretrained_lr_scale=1001", "optim.pretrained_lr_scale=1001.0 must be in (0, 1000], e.g. 0.1 for "
                                       "pretrained layers 10x slower than the head"),
    ("trainer.grad_clip_norm=-1", "trainer.grad_clip_norm=-1.0 must be in [0, 1000000]"),
    ("trainer.grad_clip_norm=1000001", "trainer.grad_clip_norm=1000001.0 must be in [0, 1000000]"),
    ("trainer.timeout_s=0", "trainer.timeout_s=0.0 must be in (0, 10000000]"),
    ("trainer.timeout_s=10000001", "trainer.timeout_s=10000001.0 must be in (0, 10000000]"),
    ("trainer.ema_decay=1", "trainer.ema_decay=1.0 must be in [0, 1), e.g. 0.99998 as torchvision's ResNet-50 v2 "
                            "recipe; 0 is off"),
    ("trainer.ema_every_n_steps=0", f"trainer.ema_every_n_steps=0 {_ATOM}"),
    ("trainer.seed=-1", f"trainer.seed=-1 {_SEED}"),
    ("trainer.seed=4294967296", f"trainer.seed=4294967296 {_SEED}"),
    ("data.split_seed=-1", f"data.split_seed=-1 {_SEED}"),
    ("data.split_seed=4294967296", f"data.split_seed=4294967296 {_SEED}"),
    *((f"{name}=0", f"{name}=0 {_ATOM}") for name in (
        "trainer.epochs", "trainer.batch_size", "trainer.accumulate_grad_batches", "optim.reference_batch",
        "scheduler.step_epochs", "parallel.micro_batches")),
    ("trainer.epochs=2147483648", f"trainer.epochs=2147483648 {_ATOM}"),
    ("trainer.batch_size=2147483648", f"trainer.batch_size=2147483648 {_ATOM}"),
    *((f"{name}=-1", f"{name}=-1 {_ZERO}") for name in (
        "trainer.eval_batch_size", "trainer.max_steps_per_epoch", "trainer.log_every_n_steps",
        "trainer.eval_every_n_epochs", "trainer.checkpoint_every_n_epochs", "trainer.checkpoint_every_n_steps",
        "scheduler.warmup_steps", "data.num_classes")),
    ("trainer.max_steps_per_epoch=2147483648", f"trainer.max_steps_per_epoch=2147483648 {_ZERO}"),
    ("trainer.devices=0", "trainer.devices=0 must be in [1, 1024]"),
    ("trainer.devices=1025", "trainer.devices=1025 must be in [1, 1024]"),
    ("parallel.stages=0", "parallel.stages=0 must be in [1, 1024]"),
    ("parallel.stages=1025", "parallel.stages=1025 must be in [1, 1024]"),
    ("trainer.dp_device_ids=[0,-1]", "trainer.dp_device_ids=[0, -1] (-1) must be in [0, 1023]"),
    ("trainer.dp_device_ids=[1024]", "trainer.dp_device_ids=[1024] (1024) must be in [0, 1023]"),
    ("trainer.dp_output_device=-1", "trainer.dp_output_device=-1 must be in [0, 1023]"),
    ("trainer.dp_output_device=1024", "trainer.dp_output_device=1024 must be in [0, 1023]"),
    ("trainer.keep_last=1", "trainer.keep_last=1 must be in [2, 1000000]"),
    ("trainer.keep_last=1000001", "trainer.keep_last=1000001 must be in [2, 1000000]"),
    ("trainer.pictures=-1", "trainer.pictures=-1 must be in [0, 1024], 0 draws no pictures"),
    ("trainer.pictures=1025", "trainer.pictures=1025 must be in [0, 1024], 0 draws no pictures"),
    ("data.image_size=-1", "data.image_size=-1 must be in [0, 65536]"),
    ("data.image_size=65537", "data.image_size=65537 must be in [0, 65536]"),
    ("data.num_workers=-1", "data.num_workers=-1 must be in [0, 1024], or auto (the cores of the node divided by "
                            "its processes)"),
    ("data.num_workers=1025", "data.num_workers=1025 must be in [0, 1024], or auto (the cores of the node divided "
                              "by its processes)"),
    ("parallel.stage_memory_gib=[0]", "parallel.stage_memory_gib=[0.0] (0.0) must be in (0, 1048576]"),
    ("parallel.stage_memory_gib=[1048577]", "parallel.stage_memory_gib=[1048577.0] (1048577.0) must be in "
                                            "(0, 1048576]"),
    ("launch.nnodes=0", "launch.nnodes=0 must be in [1, 65536]"),
    ("launch.nnodes=65537", "launch.nnodes=65537 must be in [1, 65536]"),
    ("launch.node_rank=-1", "launch.node_rank=-1 must be in [0, 65535]"),
    ("launch.node_rank=65536", "launch.node_rank=65536 must be in [0, 65535]"),
    ("launch.max_restarts=-1", "launch.max_restarts=-1 must be in [0, 1000]"),
    ("launch.max_restarts=1001", "launch.max_restarts=1001 must be in [0, 1000]"),
]


@pytest.mark.parametrize(("override", "message"), REFUSED, ids=[o for o, _ in REFUSED])
def test_each_documented_bound_refuses_the_value_just_outside_it_with_this_line(override, message):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert str(err.value) == message


ACCEPTED = [  # every bound that is inclusive, and values just inside the exclusive ones
    "optim.lr=100", "optim.lr=1e-12", "scheduler.power=100", "optim.momentum=0", "optim.momentum=0.999",
    "optim.weight_decay=0", "optim.weight_decay=1", "scheduler.min_lr_ratio=0", "scheduler.min_lr_ratio=1",
    "scheduler.gamma=1", "scheduler.gamma=1e-9", "data.val_fraction=0", "data.val_fraction=0.999",
    "optim.pretrained_lr_scale=1000", "trainer.grad_clip_norm=0", "trainer.grad_clip_norm=1000000",
    "trainer.timeout_s=10000000", "trainer.seed=0", "trainer.seed=4294967295", "data.split_seed=4294967295",
    "trainer.epochs=2147483647", "trainer.batch_size=1", "trainer.accumulate_grad_batches=2147483647",
    "trainer.eval_batch_size=0", "trainer.max_steps_per_epoch=0", "scheduler.warmup_steps=0", "data.num_classes=0",
    "trainer.devices=1024", "parallel.stages=1024", "trainer.dp_device_ids=[0,1023]", "trainer.dp_output_device=0",
    "trainer.keep_last=2", "trainer.keep_last=1000000", "trainer.pictures=0", "trainer.pictures=1024",
    "data.image_size=0", "data.image_size=65536", "data.num_workers=1024", "parallel.stage_memory_gib=[1048576]",
    "launch.nnodes=65536", "launch.node_rank=65535", "launch.max_restarts=1000",
]


def test_each_documented_bound_that_is_inclusive_is_taken():
    for override in ACCEPTED:
        load_config(None, [override, *(["launch.nnodes=65536"] if override.startswith("launch.node_rank") else [])])


def test_node_rank_must_be_below_nnodes():
    load_config(None, ["launch.nnodes=2", "launch.node_rank=1"])
    with pytest.raises(ValueError) as err:
        load_config(None, ["launch.nnodes=2", "launch.node_rank=2"])
    assert str(err.value) == "launch.node_rank=2 must be in [0, launch.nnodes=2)"


def test_the_trainer_refuses_the_combinations_the_command_line_refuses():
    """``Trainer(...)`` (the Python API) checks combinations too, not only ranges: each is the CLI's line."""
    from gputrain import Trainer

    refused = [
        (dict(overwrite=True, resume="auto"),
         "trainer.overwrite=true would delete the run that trainer.resume=auto continues; choose one"),
        (dict(compile=True, strategy="dp"),
         "trainer.compile=true does not work with strategy dp (nn.DataParallel copies the model to each GPU at every "
         "step); use --strategy ddp, or trainer.compile=false"),
        (dict(monitor_mode="highest"), "trainer.monitor_mode='highest' is not min or max"),
        (dict(channels_last="yes"),
         "trainer.channels_last='yes' must be auto, true or false (from Python: 'auto', True or False)"),
    ]
    for options, message in refused:
        with pytest.raises(ValueError) as err:
            Trainer(**options)
        assert str(err.value) == message, options
    with pytest.raises(ValueError) as err:
        Trainer(config_module.RunConfig(launch=config_module.LaunchConfig(nnodes=2, node_rank=2)))
    assert str(err.value) == "launch.node_rank=2 must be in [0, launch.nnodes=2)"
    Trainer(overwrite=True, compile=True, strategy="ddp", monitor_mode="max", channels_last=True)  # each alone is fine
