"""timm's classifiers as ``model.name=timm/ARCH`` (the ``timm`` extra): built for the data's classes, trained by the
CLI, weights by tag from a prepared Hugging Face cache or from a local .safetensors file with the head named in one
line, and every refusal one line: an unknown architecture, a detection recipe, a split strategy, weights offline
and not cached, timm not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm  # the timm extra: requirements-dev.txt installs it, so the suite runs these tests
import torch
from safetensors.torch import save_file

from gputrain.cli import main
from gputrain.config import ModelConfig
from gputrain.data.classfolder import make_classfolder
from gputrain.models import build_configured_model
from predict_runs import QUIET, _eval, _run


def _resnet18_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """timm's ResNet-18 layout with its 1000-class head, values of its own initialisation moved at random (BatchNorm
    variances stay positive), as the hub stores it."""
    torch.manual_seed(5)
    state = {k: (v + 0.01 * torch.rand_like(v) if v.is_floating_point() else v).contiguous()
             for k, v in timm.create_model("resnet18", pretrained=False).state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return state


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_a_tag_in_the_hugging_face_cache_starts_from_those_tensors_with_a_new_head(hf_home: Path, capsys) -> None:
    # The cache's layout as huggingface_hub writes it: refs/main names the snapshot holding the file.
    repo = hf_home / "hub" / "models--timm--resnet18.a1_in1k"
    commit = "0123456789abcdef0123456789abcdef01234567"
    saved = _resnet18_safetensors(repo / "snapshots" / commit / "model.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = build_configured_model(ModelConfig(name="timm/resnet18", weights="DEFAULT"), "resnet18",
                                   kind="classification", num_classes=4, input_size=(32, 32))
    own = model.state_dict()
    assert own["fc.weight"].shape == (4, 512)
    assert all(torch.equal(own[k], v) for k, v in saved.items() if not k.startswith("fc."))
    line = capsys.readouterr().err.strip()
    assert line.startswith("gputrain: model.weights=DEFAULT (model.safetensors): loaded ")
    assert line.endswith("kept fresh (not in the weights or another shape): fc.{weight,bias}")


def test_offline_without_the_cached_file_is_one_line_naming_the_file_to_place(hf_home: Path, tmp_path: Path,
                                                                             capsys) -> None:
    make_classfolder(tmp_path / "cls", classes=2, per_class=2, size=32, seed=0)
    args = ["train", "imagefolder-resnet50", f"data.root={tmp_path / 'cls'}", "data.image_size=32", "--out",
            str(tmp_path / "run"), "--accelerator", "cpu", "model.name=timm/resnet18"]
    cases = {
        "cannot fetch model.safetensors of timm/resnet18.a1_in1k (": ["model.weights=DEFAULT"],
        "download https://huggingface.co/timm/resnet18.a2_in1k/resolve/main/model.safetensors and pass "
        "model.weights=/path/to/model.safetensors": ["model.weights=a2_in1k"],
        "is not a weights tag of timm's resnet18; valid: DEFAULT, a1_in1k": ["model.weights=in1k"],
        "is not a timm model; closest: timm/resnet18": ["model.name=timm/resnt18"],
        "strategy pipeline cannot split timm/resnet18": ["--strategy", "pipeline", "--devices", "2"],
    }
    for expected, extra in cases.items():
        capsys.readouterr()
        assert main([*args, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gputrain: error: ") and expected in err[0], err
    capsys.readouterr()
    assert main(["train", "coco-maskrcnn", f"data.root={tmp_path / 'cls'}", "model.name=timm/resnet18"]) == 2
    assert "timm's models are classifiers, and this recipe's task trains a detection model" in capsys.readouterr().err


def test_without_timm_installed_a_timm_name_is_one_line(tmp_path: Path) -> None:
    make_classfolder(tmp_path / "cls", classes=2, per_class=2, size=32, seed=0)
    code = ("import sys; sys.modules['timm'] = None; from gputrain.cli import main; "  # import timm: ImportError
            f"sys.exit(main(['train', 'imagefolder-resnet50', 'data.root={tmp_path / 'cls'}', "
            "'model.name=timm/convnext_atto']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("gputrain: error: model.name='timm/convnext_atto' needs timm, which is not "
                                   "installed: pip install 'gputrain[timm]' (timm==1.0.31)")


def test_a_timm_model_trains_from_a_local_file_evaluates_and_exports(tmp_path: Path, capsys) -> None:
    make_classfolder(tmp_path / "train", classes=4, per_class=6, size=32, seed=0)
    make_classfolder(tmp_path / "val", classes=4, per_class=3, size=32, seed=1)
    weights = tmp_path / "resnet18.safetensors"
    _resnet18_safetensors(weights)
    run = tmp_path / "run"
    _run(["train", "imagefolder-resnet50", "--epochs", "1", "--batch-size", "8", "--out", run, *QUIET,
          f"data.root={tmp_path / 'train'}", f"data.val_root={tmp_path / 'val'}", "data.image_size=32",
          "model.name=timm/resnet18", f"model.weights={weights}", "optim.lr=0.01"])
    assert "loaded 120 of 122 tensors; kept fresh (not in the weights or another shape): fc.{weight,bias}" in \
        capsys.readouterr().err
    final = json.loads((run / "summary.json").read_text())["final"]
    metrics = _eval(run / "checkpoints/last.pt", tmp_path / "eval")
    assert metrics["val/accuracy"] == final["val/accuracy"] and metrics["val/loss"] == pytest.approx(final["val/loss"])
    from gputrain.tools.export import export_onnx

    assert export_onnx(run / "checkpoints/last.pt", tmp_path / "m.onnx") <= 1e-4
