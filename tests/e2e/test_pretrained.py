"""model.weights: a torchvision name through a prepared hub cache, a URL served on 127.0.0.1, the offline line."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torchvision

from forked_cli import run_gputrain
from gputrain.config import ModelConfig
from gputrain.models import build_configured_model
from gputrain.models.pretrained import fetch, weights_source
from local_http import serving

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
RESNET18_FILE = Path(torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url).name  # resnet18-f37072fd.pth


def _imagenet_resnet18(path: Path) -> dict[str, torch.Tensor]:
    """A state_dict of torchvision's ImageNet ResNet-18 layout (1000 classes), random values, saved at ``path``."""
    torch.manual_seed(7)
    state = torchvision.models.resnet18(weights=None).state_dict()
    state = {k: (torch.randn_like(v) if v.is_floating_point() else v) for k, v in state.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def test_a_name_in_the_hub_cache_starts_from_exactly_those_tensors_with_a_new_head(torch_home, capsys):
    saved = _imagenet_resnet18(torch_home / "hub" / "checkpoints" / RESNET18_FILE)
    cfg = ModelConfig(name="resnet18", kwargs={"cifar_stem": False}, weights="DEFAULT")
    model = build_configured_model(cfg, "resnet18", num_classes=10)
    own = model.state_dict()
    assert own["fc.weight"].shape == (10, 512)
    for key, value in saved.items():
        if not key.startswith("fc."):
            assert torch.equal(own[key], value), key
    line = capsys.readouterr().err.strip()
    assert line.startswith("gputrain: model.weights=DEFAULT (resnet18-f37072fd.pth): loaded 120 of 122 tensors")
    assert line.endswith("kept fresh (not in the weights or another shape): fc.{weight,bias}")


def test_the_cifar_stem_names_the_tensors_it_could_not_load(torch_home, capsys):
    saved = _imagenet_resnet18(torch_home / "hub" / "checkpoints" / RESNET18_FILE)
    model = build_configured_model(ModelConfig(name="resnet18", kwargs={"cifar_stem": True}, weights="IMAGENET1K_V1"),
                                   "resnet18", num_classes=10)
    assert torch.equal(model.state_dict()["layer1.0.conv1.weight"], saved["layer1.0.conv1.weight"])
    assert not torch.equal(model.state_dict()["conv1.weight"][..., :3, :3], saved["conv1.weight"][..., :3, :3])
    assert "kept fresh (not in the weights or another shape): conv1.weight, fc.{weight,bias}" in capsys.readouterr().err


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"^model.weights='IMAGENET1K_V9' is not a weights name of torchvision's "
                                         r"resnet50; valid: IMAGENET1K_V1, IMAGENET1K_V2, DEFAULT$"):
        weights_source("resnet50", {}, "IMAGENET1K_V9")
    with pytest.raises(ValueError, match="COCO weights for Mask R-CNN on resnet50 only"):
        weights_source("maskrcnn_resnet50_fpn", {"backbone": "resnet18"}, "COCO_V1")


def test_deeplab_takes_its_backbones_weights(torch_home):
    saved = _imagenet_resnet18(torch_home / "hub" / "checkpoints" / RESNET18_FILE)
    cfg = ModelConfig(name="deeplabv3plus", kwargs={"backbone": "resnet18", "aspp_channels": 8,
                                                     "decoder_channels": 8}, weights="DEFAULT")
    model = build_configured_model(cfg, "deeplabv3plus", num_classes=3)
    assert torch.equal(model.state_dict()["backbone.layer4.1.conv2.weight"], saved["layer4.1.conv2.weight"])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    root = tmp_path / "served"
    root.mkdir()
    with serving(root) as (url, gets):
        yield url, root, gets


def test_a_download_whose_hash_prefix_differs_is_refused_in_one_line(torch_home, server):
    url, root, _ = server
    _imagenet_resnet18(root / "resnet18-deadbeef.pth")  # torch.hub checks the sha256 prefix in the name
    with pytest.raises(ValueError, match=r"cannot download .*resnet18-deadbeef.pth \(invalid hash value"):
        fetch(weights_source("resnet18", {}, f"{url}/resnet18-deadbeef.pth"))
    assert not (torch_home / "hub" / "checkpoints" / "resnet18-deadbeef.pth").exists()


def _gputrain(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_gputrain(args, env=env, timeout=300)


def test_offline_without_the_cached_file_is_one_line_naming_file_url_and_folder(tmp_path):
    home = tmp_path / "empty_home"
    done = _gputrain("train", "cifar10-resnet18", "--data-root", str(tmp_path), "model.weights=DEFAULT",
                     env={**ENV, "TORCH_HOME": str(home)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"gputrain: error: model.weights='DEFAULT': cannot download https://download.pytorch.org/models/{RESNET18_FILE} "
        f"(" + done.stderr.split("(", 1)[1].split(")", 1)[0] + f"); put the file {RESNET18_FILE} in "
        f"{home / 'hub' / 'checkpoints'} (or set TORCH_HOME) and run again"]
    assert not (tmp_path / "runs").exists()


def test_two_processes_download_once_per_node_and_train_from_the_weights(tmp_path, server):
    url, root, gets = server
    _imagenet_resnet18(root / "r18.pth")
    data = tmp_path / "cifar"
    made = _gputrain("data", "make", "cifar10", "--out", str(data), "--count", "40", env=ENV)
    assert made.returncode == 0, made.stderr
    home = tmp_path / "home"
    done = _gputrain("train", "cifar10-resnet18", "--strategy", "ddp", "--devices", "2", "--epochs", "1",
                     "--batch-size", "4", "--data-root", str(data), "--out", str(tmp_path / "run"),
                     f"model.weights={url}/r18.pth", "trainer.max_steps_per_epoch=1", "trainer.pictures=0",
                     "trainer.progress_bar=false", "trainer.loggers=[]", env={**ENV, "TORCH_HOME": str(home)})
    assert done.returncode == 0, done.stderr
    assert gets == ["/r18.pth"]  # the launcher fetched once; both ranks loaded the cached file
    assert (home / "hub" / "checkpoints" / "r18.pth").is_file()
    assert done.stderr.count("gputrain: model.weights=") == 1  # rank 0 says what it loaded
    assert "config.yaml" in {p.name for p in (tmp_path / "run").iterdir()}
    assert f"weights: {url}/r18.pth" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_gputrain_checkpoint_given_as_a_file_starts_from_its_model_with_a_new_head(tmp_path, capsys):
    """model.weights=RUN/checkpoints/last.pt: the checkpoint's model (not its optimizer or config) is what loads."""
    from gputrain.cli import main
    from gputrain.data.cifar10 import make_cifar10

    data = make_cifar10(tmp_path / "cifar", train_per_class=2, test_per_class=1)
    assert main(["train", "cifar10-resnet18", "--epochs", "1", "--batch-size", "4", "--data-root", str(data),
                 "--out", str(tmp_path / "run"), "--accelerator", "cpu", "trainer.max_steps_per_epoch=1",
                 "trainer.pictures=0", "trainer.progress_bar=false", "trainer.loggers=[]"]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    saved = torch.load(checkpoint, weights_only=True)["model"]
    capsys.readouterr()
    model = build_configured_model(ModelConfig(name="resnet18", kwargs={"cifar_stem": True},
                                               weights=str(checkpoint)), "resnet18", num_classes=4)
    own = model.state_dict()
    assert own["fc.weight"].shape == (4, 512) and len(saved) == 122
    for key, value in saved.items():
        if not key.startswith("fc."):
            assert torch.equal(own[key], value), key
    assert capsys.readouterr().err.strip() == (
        f"gputrain: model.weights={checkpoint} (last.pt): loaded 120 of 122 tensors; kept fresh (not in the weights "
        "or another shape): fc.{weight,bias}")


def test_a_state_dict_saved_from_a_ddp_wrapped_model_loads_without_its_module_prefix(tmp_path):
    torch.manual_seed(5)
    state = {k: (torch.randn_like(v) if v.is_floating_point() else v)
             for k, v in torchvision.models.resnet18(weights=None, num_classes=10).state_dict().items()}
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "ddp.pth")
    model = build_configured_model(ModelConfig(name="resnet18", kwargs={"cifar_stem": False},
                                               weights=str(tmp_path / "ddp.pth")), "resnet18", num_classes=10)
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items())


def test_any_torchvision_models_weights_by_name_load_with_a_head_for_the_data(torch_home, capsys):
    # MobileNetV3-Small's ImageNet weights, as torchvision names their file, prepared in the hub cache (random values).
    url = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1.url
    torch.manual_seed(3)
    saved = {k: (torch.randn_like(v) if v.is_floating_point() else v)
             for k, v in torchvision.models.mobilenet_v3_small(weights=None).state_dict().items()}
    (torch_home / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(saved, torch_home / "hub" / "checkpoints" / Path(url).name)
    cfg = ModelConfig(name="mobilenet_v3_small", weights="IMAGENET1K_V1")
    model = build_configured_model(cfg, "resnet18", kind="classification", num_classes=4, input_size=(32, 32))
    own = model.state_dict()
    assert own["classifier.3.weight"].shape == (4, 1024)
    assert all(torch.equal(own[k], v) for k, v in saved.items() if not k.startswith("classifier.3."))
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"gputrain: model.weights=IMAGENET1K_V1 ({Path(url).name}): loaded ")
    assert line.endswith("kept fresh (not in the weights or another shape): classifier.3.{weight,bias}")
    with pytest.raises(ValueError, match=r"^model.weights='COCO_V1' is not a weights name of torchvision's "
                                         r"mobilenet_v3_small; valid: IMAGENET1K_V1, DEFAULT$"):
        weights_source("mobilenet_v3_small", {}, "COCO_V1")
