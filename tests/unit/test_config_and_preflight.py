"""Pure pieces of a user's first hour: config validation and YAML errors, strict JSON, the config and fit of a
checkpoint, and the preflight checks (precision on a CPU, dp's devices, missing extras, data make, odd image sizes).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from gputrain.cli import preflight
from gputrain.config import load_config
from gputrain.data.imagefolder import ImageFiles
from gputrain.data.images import DataError
from gputrain.runs.loggers import JsonlLogger, strict_json
from gputrain.runs.records import append_record
from gputrain.tools.from_checkpoint import config_from_checkpoint, load_fitting, python_run_message
from gputrain.tools.make_data import make_dataset

# -- config validation and YAML errors --------------------------------------------------------


@pytest.mark.parametrize("override, field", [
    ("trainer.devices=0", "trainer.devices=0"), ("trainer.devices=-1", "trainer.devices=-1"),
    ("trainer.epochs=0", "trainer.epochs=0"), ("trainer.batch_size=0", "trainer.batch_size=0"),
    ("data.val_fraction=1.0", "data.val_fraction=1.0"), ("optim.lr=0", "optim.lr=0.0"),
])
def test_nonsense_values_are_refused_naming_the_field(override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_config("autoencoder", [override])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("task: autoencoder\ntrainer:\n  epochs: 3\n  loggers: [csv\n")
    with pytest.raises(ValueError) as err:
        load_config(str(recipe))
    assert str(recipe) in str(err.value) and "line 4" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^unknown config key trainer.epohcs: .*Did you mean") as err:
        load_config("autoencoder", ["trainer.epohcs=3"])
    assert "\n" not in str(err.value)
    # A misspelt key in the file is named as a key, a wrong value as a value (a new user read "bad value" as the
    # value being wrong).
    recipe.write_text("task: autoencoder\ntrainer:\n  epoch: 3\n")
    with pytest.raises(ValueError, match=f"^recipe {recipe} line 3: unknown key trainer.epoch: .*fix the file$"):
        load_config(str(recipe))
    with pytest.raises(ValueError, match="^bad config value for trainer.epochs: Value 'three'"):
        load_config("autoencoder", ["trainer.epochs=three"])


# -- strict JSON ------------------------------------------------------------------------------


def _strict_loads(text: str):
    def refuse(token: str):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_metrics_jsonl_and_summaries_are_strict_json(tmp_path):
    logger = JsonlLogger(tmp_path / "metrics.jsonl")
    logger.log({"train/loss": math.nan, "val/loss": math.inf, "lr": 0.1, "n": torch.tensor(2.5)}, step=1, epoch=0)
    logger.close()
    record = _strict_loads((tmp_path / "metrics.jsonl").read_text())
    assert record["train/loss"] is None and record["val/loss"] is None and record["lr"] == 0.1 and record["n"] == 2.5
    assert _strict_loads(strict_json({"final": {"a": [1.0, -math.inf]}})) == {"final": {"a": [1.0, None]}}


def test_events_appended_beside_the_logger_stay_whole_in_metrics_jsonl(tmp_path):
    """The pace and membership records are appended to metrics.jsonl by another writer while the logger holds it
    open. Fault: a fresh run's logger opened with "w", which writes at its own offset over the appended record
    (it vanished, or left a torn line: a CI failure, 2026-11-29)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"from": "an earlier run"}\n')
    logger = JsonlLogger(path)  # a fresh run starts the file over
    logger.log({"train/loss": 1.0}, step=1, epoch=0)
    append_record(path, {"event": "pace", "steps": 3, "note": "an event longer than the logged line after it"})
    logger.log({"train/loss": 0.5}, step=2, epoch=0)
    logger.close()
    records = [_strict_loads(line) for line in path.read_text().splitlines()]
    assert [r.get("event", r.get("step")) for r in records] == [1, "pace", 2]
    JsonlLogger(path, append=True).close()  # a resumed run continues it
    assert len(path.read_text().splitlines()) == 3


# -- checkpoint config and fit ----------------------------------------------------------------


def _tiny(width: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.Conv2d(width, 3, 3))


def test_a_misfit_is_one_line_naming_shapes_and_the_deciding_field():
    saved = {"task": "autoencoder", "model": {"name": "pkg:tiny", "kwargs": {"width": 4}}}
    cfg = load_config(None, ["model.name=pkg:tiny", "model.kwargs.width=8"])
    with pytest.raises(ValueError) as err:
        load_fitting(_tiny(8), _tiny(4).state_dict(), path="last.pt", cfg=cfg, saved=saved)
    message = str(err.value)
    assert "0.weight is 4x3x3x3 in the checkpoint but 8x3x3x3 in the model" in message
    assert "model.kwargs.width=8 here but 4 in training" in message and "\n" not in message
    model = load_fitting(_tiny(4), _tiny(4).state_dict(), path="last.pt")
    assert isinstance(model, nn.Module)


def test_eval_config_comes_from_the_checkpoint_and_overrides_win(tmp_path):
    saved = load_config("autoencoder", ["model.kwargs.width=4", "trainer.out=runs/x", "trainer.devices=2",
                                        "data.root=somewhere"])
    from gputrain.config import to_dict

    state = {"model": {}, "config": to_dict(saved)}
    cfg, note = config_from_checkpoint(state, "last.pt", recipe=None, overrides=["trainer.batch_size=3"])
    assert cfg.model.kwargs == {"width": 4} and cfg.data.root == "somewhere" and cfg.trainer.batch_size == 3
    assert (cfg.trainer.out, cfg.trainer.devices, note) == ("", 1, "")  # where it ran is not carried over
    cfg, _ = config_from_checkpoint(state, "last.pt", recipe=None, overrides=["model.kwargs.width=8"])
    assert cfg.model.kwargs == {"width": 8}
    with pytest.raises(ValueError, match="holds no saved config"):
        config_from_checkpoint({"model": {}}, "last.pt", recipe=None, overrides=[])
    python_run = {"model": {}, "config": {"task": "custom", "model": {"name": "my.mod:Net", "kwargs": {}}}}
    with pytest.raises(ValueError, match="trained from Python with model my.mod:Net"):
        config_from_checkpoint(python_run, "last.pt", recipe=None, overrides=[])
    assert "export_model(model, 'last.pt'" in python_run_message("last.pt", python_run["config"], "export")


def test_another_recipe_never_merges_its_model_options_into_a_checkpoint():
    """Issue 15 item 3: cifar10-resnet18's model.kwargs.cifar_stem reached the autoencoder's builder."""
    from gputrain.config import to_dict

    saved = to_dict(load_config("autoencoder", ["model.kwargs.width=4", "trainer.batch_size=5"]))
    state = {"model": {}, "config": saved}
    cfg, note = config_from_checkpoint(state, "last.pt", recipe="cifar10-resnet18", overrides=["trainer.batch_size=3"])
    assert (cfg.task, cfg.model.name, cfg.model.kwargs) == ("autoencoder", "conv_autoencoder", {"width": 4})
    assert cfg.trainer.batch_size == 3 and cfg.data == load_config(None, layers=[saved]).data
    assert note == ("gputrain: eval ignores recipe cifar10-resnet18 (task=classification model.name=resnet18): "
                    "last.pt was trained as task=autoencoder model.name=conv_autoencoder, so it is used with the config "
                    "saved in it; drop the recipe to silence this")
    # The same task and model: the recipe says how to run (trainer), the checkpoint what the model is.
    cfg, note = config_from_checkpoint(state, "last.pt", recipe="autoencoder", overrides=[])
    assert note == "" and cfg.model.kwargs == {"width": 4}
    assert cfg.trainer.batch_size == load_config("autoencoder").trainer.batch_size


# -- preflight --------------------------------------------------------------------------------


def test_16_bit_recipe_defaults_fall_back_on_cpu_and_explicit_ones_warn():
    precision, line = preflight.cpu_precision("16-mixed", "cpu", explicit=False)
    assert precision == "32" and "falls back to 32" in line and "--precision 16-mixed" in line
    precision, line = preflight.cpu_precision("16-mixed", "cpu", explicit=True)
    assert precision == "16-mixed" and "warning" in line and "float16 autocast runs many times slower" in line
    # bfloat16 runs as asked on a CPU with native bfloat16 (a new user's finding: it was called 20x slower), and
    # warns or falls back on one without.
    import torch

    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert preflight.cpu_precision("bf16-mixed", "cpu", explicit=False) == ("bf16-mixed", "")
    else:
        precision, line = preflight.cpu_precision("bf16-mixed", "cpu", explicit=False)
        assert precision == "32" and "this CPU has no native bfloat16" in line
    assert preflight.cpu_precision("32", "cpu", explicit=False) == ("32", "")


def test_dp_says_what_devices_does_and_missing_extras_name_the_install():
    note = preflight.devices_note("dp", 2, "cpu")
    assert "--devices 2 starts no more processes" in note and "on a CPU it uses one device" in note
    assert preflight.devices_note("ddp", 2, "cpu") == ""
    from gputrain import extras
    from gputrain.errors import MissingExtra

    with pytest.raises(MissingExtra, match=r"pip install 'gputrain\[loggers\]'"):
        extras.EXTRAS["no_such_package_xyz"] = "loggers"
        try:
            extras.require("no_such_package_xyz", "trainer.loggers=[x]")
        finally:
            del extras.EXTRAS["no_such_package_xyz"]


def test_data_make_refuses_negative_counts(tmp_path):
    with pytest.raises(ValueError, match="count=-5"):
        make_dataset("imagefolder", tmp_path / "x", count=-5)
    assert not (tmp_path / "x").exists()


def test_images_of_different_sizes_name_the_first_odd_file(tmp_path):
    from torchcodec.encoders import PngEncoder

    for i, side in enumerate((40, 40, 32, 40)):
        PngEncoder(torch.zeros(3, side, side + 1, dtype=torch.uint8)).to_file(tmp_path / f"f{i}.png")
    files = sorted(tmp_path.glob("*.png"))
    with pytest.raises(DataError) as err:
        ImageFiles(files)
    assert str(files[2]) in str(err.value) and "33x32" in str(err.value) and "41x40" in str(err.value)
    assert "data.image_size" in str(err.value)
    assert ImageFiles(files, image_size=16)[2].shape == (3, 16, 16)  # resized: no check needed


def test_a_missing_data_root_beside_a_folder_of_a_near_name_names_that_folder(tmp_path):
    """Found by a new user (round 5): data/frame (for data/frames) was told to make sample data into data/frame."""
    from gputrain.cli.preflight import check_data_paths

    (tmp_path / "frames").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"does not exist; did you mean {tmp_path / 'frames'}\? Else make "):
        check_data_paths(load_config("autoencoder", [f"data.root={tmp_path / 'frame'}"]))
    with pytest.raises(FileNotFoundError, match=r"does not exist; make sample data with "):
        check_data_paths(load_config("autoencoder", [f"data.root={tmp_path / 'elsewhere'}"]))
