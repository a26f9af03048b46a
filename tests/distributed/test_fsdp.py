"""FSDP2 on 2 real gloo ranks equals one process; its checkpoints (full and sharded) load anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.checkpoint.sharded import dcp_to_full, load_sharded, save_sharded
from gputrain.config import OptimConfig, RunConfig
from gputrain.dist import DistInfo
from gputrain.strategies.fsdp import FSDP, optimizer_state_by_fqn, optimizer_state_by_index, shard_units
from gputrain.strategies.single import SingleDevice
from gputrain.tasks.base import Task
from multiproc import run_ranks

N_TRAIN, N_VAL = 37, 9  # 37 = 3 x 12 + 1: the last step has one sample, so rank 1 joins it with an empty slice
BATCH = 3  # per rank; one process uses 2 x BATCH for the same global batch


class SmallNet(nn.Module):
    """A container holding most parameters (split into units) and a parameter of the root's own."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(4, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 5)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.body(torch.relu(self.stem(x)))).flatten(1)) * self.scale


def _model(seed: int = 0) -> SmallNet:
    torch.manual_seed(seed)
    return SmallNet()


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g))


def _trainer(out: Path, strategy: str, devices: int, batch: int, accumulate: int, epochs: int, resume: str,
             optim: str) -> Trainer:
    # SGD with momentum follows the gradient's scale, so clipping to a wrong (per-shard) norm would show;
    # Adam gives the optimizer state more entries to convert and load.
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=0.2, momentum=0.9) if optim == "sgd" else
                    OptimConfig(name="adam", lr=0.01))
    return Trainer(cfg, strategy=strategy, devices=devices, accelerator="cpu", batch_size=batch,
                   accumulate_grad_batches=accumulate, eval_batch_size=4, epochs=epochs, out=str(out),
                   progress_bar=False, loggers=[], log_every_n_steps=1, grad_clip_norm=0.25, resume=resume)


def _fit(out: Path, strategy: str, devices: int, batch: int, accumulate: int = 1, epochs: int = 2,
         resume: str = "", seed: int = 0, optim: str = "adam") -> dict:
    trainer = _trainer(out, strategy, devices, batch, accumulate, epochs, resume, optim)
    summary = trainer.fit(_model(seed), _data(N_TRAIN, 1), _data(N_VAL, 2), loss=nn.functional.cross_entropy)
    weights = trainer.strategy.model_state_dict(trainer.module)
    optim = trainer.strategy.optimizer_state_dict(trainer.module, trainer.optimizer)
    return {"trainer": trainer, "summary": summary, "weights": weights, "optimizer": optim}


def _step_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r and "lr" in r]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _optim_diff(a: dict, b: dict) -> float:
    # initial_lr is the LR scheduler's note in the optimizer; DCP loads the keys the live optimizer
    # has, and the bare optimizers built below have no scheduler.
    def groups(state: dict) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "initial_lr"} for g in state["param_groups"]]

    assert groups(a) == groups(b)
    assert a["state"].keys() == b["state"].keys()
    return max(_max_diff(a["state"][i], b["state"][i]) for i in a["state"])


# -- pure: no processes --------------------------------------------------------------------------------
def test_units_are_resnet_stages_and_head_and_containers_are_split():
    # layer4 holds 72% of ResNet-18: its two blocks are units, so no unit gathers most of the model.
    assert shard_units(torchvision.models.resnet18()) == ["layer1", "layer2", "layer3", "layer4.0", "layer4.1", "fc"]
    assert shard_units(torchvision.models.resnet50()) == ["layer1", "layer2", "layer3", "layer4.0", "layer4.1",
                                                          "layer4.2", "fc"]
    # body holds most of SmallNet: its convolutions become units; `scale` stays with the root.
    assert shard_units(SmallNet()) == ["stem", "body.0", "body.2", "head"]
    assert shard_units(nn.Linear(3, 3)) == []


def test_optimizer_state_converts_between_names_and_indices():
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    by_name = get_optimizer_state_dict(model, optimizer)
    assert "head.weight" in by_name["state"]
    by_index = optimizer_state_by_index(by_name)
    assert _optim_diff(by_index, optimizer.state_dict()) == 0.0
    back = optimizer_state_by_fqn(by_index, model, optimizer)
    assert back["param_groups"] == by_name["param_groups"]
    assert _max_diff(back["state"]["head.weight"], by_name["state"]["head.weight"]) == 0.0


# -- 2 ranks -------------------------------------------------------------------------------------------
def _fsdp_train_worker(info: DistInfo, root: str) -> dict:
    root_path = Path(root)
    run = _fit(root_path / "fsdp", "fsdp", 2, BATCH, optim="sgd")
    trainer = run.pop("trainer")
    result = run | {"losses": _step_losses(root_path / "fsdp") if info.is_main else [],
                    "units": trainer.strategy.units,
                    "shard_numel": sum(p.to_local().numel() for p in trainer.module.parameters())}
    # Resume on 2 ranks from the epoch-1 checkpoint: the same final weights as the uninterrupted run.
    epoch1 = sorted((root_path / "fsdp" / "checkpoints").glob("epoch_0001*.pt"))
    resumed = _fit(root_path / "fsdp_resumed", "fsdp", 2, BATCH, resume=str(epoch1[0]), seed=7, optim="sgd")
    result["resumed_weights"] = resumed["weights"]
    # Exact evaluation of given weights: 9 samples, eval batch 4 -> rank 0 runs 2 batches, rank 1 one.
    model = _model(seed=3)
    model.load_state_dict(torch.load(epoch1[0], weights_only=True)["model"])
    validator = Trainer(strategy="fsdp", devices=2, accelerator="cpu", eval_batch_size=4,
                        out=str(root_path / "fsdp_eval"), progress_bar=False, loggers=[])
    result["validate"] = validator.validate(model, _data(N_VAL, 2), task=Task(nn.functional.cross_entropy))
    return result


@pytest.mark.slow
def test_fsdp_two_ranks_matches_one_process_and_its_checkpoints_load_anywhere(tmp_path):
    fsdp = run_ranks(_fsdp_train_worker, str(tmp_path))
    single = _fit(tmp_path / "single", "single", 1, 2 * BATCH, optim="sgd")
    assert fsdp[0]["units"] == ["stem", "body.0", "body.2", "head"]
    total = sum(p.numel() for p in SmallNet().parameters())
    assert max(r["shard_numel"] for r in fsdp) < total  # each rank really holds only a shard

    # Same loss at every step (7 steps an epoch, the 7th with one sample) and the same final weights.
    losses, reference = fsdp[0]["losses"], _step_losses(tmp_path / "single")
    assert len(losses) == len(reference) == 14
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) <= 1e-5
    assert _max_diff(single["weights"], _model().state_dict()) > 1e-3, "training must move the weights"
    assert fsdp[1]["weights"] == {}  # gathered on rank 0 only
    assert _max_diff(fsdp[0]["weights"], single["weights"]) <= 1e-5
    assert _optim_diff(fsdp[0]["optimizer"], single["optimizer"]) <= 1e-5
    # Evaluation during fit counted every validation sample once, as one process did.
    assert fsdp[0]["summary"]["final"]["val/samples"] == single["summary"]["final"]["val/samples"] == N_VAL
    assert abs(fsdp[0]["summary"]["final"]["val/loss"] - single["summary"]["final"]["val/loss"]) <= 1e-5

    # The checkpoint is an ordinary one: plain keys, strict load into the plain model.
    ckpt = sorted((tmp_path / "fsdp" / "checkpoints").glob("epoch_0001*.pt"))[0]
    saved = torch.load(ckpt, weights_only=True)
    plain = _model(seed=5)
    plain.load_state_dict(saved["model"], strict=True)
    # Resumed on 2 ranks (above) and on 1 process with `single`: both end where the uninterrupted run did.
    assert _max_diff(fsdp[0]["resumed_weights"], fsdp[0]["weights"]) <= 1e-6
    on_one = _fit(tmp_path / "single_resumed", "single", 1, 2 * BATCH, resume=str(ckpt), seed=9, optim="sgd")
    assert _max_diff(on_one["weights"], fsdp[0]["weights"]) <= 1e-5

    # Trainer.validate on 2 ranks gives what one process gives for the same weights.
    one = Trainer(strategy="single", devices=1, accelerator="cpu", eval_batch_size=4,
                  out=str(tmp_path / "single_eval"), progress_bar=False, loggers=[])
    expected = one.validate(plain, _data(N_VAL, 2), task=Task(nn.functional.cross_entropy))
    got = fsdp[0]["validate"]
    assert got["val/samples"] == expected["val/samples"] == N_VAL
    assert abs(got["val/loss"] - expected["val/loss"]) <= 1e-6


def _fsdp_accumulate_dcp_worker(info: DistInfo, root: str) -> dict:
    root_path = Path(root)
    run = _fit(root_path / "fsdp_acc", "fsdp", 2, BATCH, accumulate=2)
    trainer = run.pop("trainer")
    save_sharded(trainer.strategy, trainer.module, trainer.optimizer, root_path / "dcp_2ranks")
    # Load, on 2 ranks, into a freshly initialised sharded model: the one saved on 2 ranks and the one
    # saved by a single process.
    loaded = {}
    for name in ("dcp_2ranks", "dcp_1proc"):
        strategy = FSDP(info)
        module = strategy.setup_module(_model(seed=11))
        optimizer = torch.optim.Adam(module.parameters(), lr=0.5)
        load_sharded(strategy, module, optimizer, root_path / name)
        loaded[name] = (strategy.model_state_dict(module), strategy.optimizer_state_dict(module, optimizer))
    return run | {"loaded": loaded}


@pytest.mark.slow
def test_fsdp_accumulation_matches_and_sharded_checkpoint_loads_on_any_process_count(tmp_path):
    # A sharded checkpoint written by one process, for the 2 ranks to load.
    one = _fit(tmp_path / "one", "single", 1, 2 * BATCH, epochs=1)
    save_sharded(one["trainer"].strategy, one["trainer"].module, one["trainer"].optimizer, tmp_path / "dcp_1proc")

    fsdp = run_ranks(_fsdp_accumulate_dcp_worker, str(tmp_path))
    single = _fit(tmp_path / "single", "single", 1, 4 * BATCH)  # 2 ranks x 3 x accumulation 2
    assert _max_diff(fsdp[0]["weights"], single["weights"]) <= 1e-5
    assert _max_diff(fsdp[0]["weights"], _model().state_dict()) > 1e-3

    # Saved on 2 ranks, loaded on 2 (fresh model) and on 1 process.
    weights, optim = fsdp[0]["weights"], fsdp[0]["optimizer"]
    assert _max_diff(fsdp[0]["loaded"]["dcp_2ranks"][0], weights) == 0.0
    assert _optim_diff(fsdp[0]["loaded"]["dcp_2ranks"][1], optim) == 0.0
    plain, strategy = _model(seed=13), SingleDevice(DistInfo())
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.5)
    load_sharded(strategy, plain, optimizer, tmp_path / "dcp_2ranks")
    assert _max_diff(plain.state_dict(), weights) == 0.0
    assert _optim_diff(optimizer.state_dict(), optim) == 0.0
    # Converted to full tensors: the plain model loads it strictly, a plain optimizer takes its state.
    full = dcp_to_full(tmp_path / "dcp_2ranks")
    other = _model(seed=17)
    other.load_state_dict(full["model"], strict=True)
    assert _max_diff(other.state_dict(), weights) == 0.0
    assert _optim_diff(full["optimizer"], optim) == 0.0
    # Saved by one process, loaded on 2 ranks.
    assert _max_diff(fsdp[0]["loaded"]["dcp_1proc"][0], one["weights"]) == 0.0
    assert _optim_diff(fsdp[0]["loaded"]["dcp_1proc"][1], one["optimizer"]) == 0.0


def test_sharded_checkpoint_errors_name_the_folder_and_the_keys(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        dcp_to_full(tmp_path)
    model = _model()
    save_sharded(SingleDevice(DistInfo()), model, torch.optim.SGD(model.parameters(), lr=0.1), tmp_path / "ck")
    with pytest.raises(ValueError, match=r"does not fit this model: missing \[.bias., .weight.\]"):
        load_sharded(SingleDevice(DistInfo()), nn.Linear(2, 2), None, tmp_path / "ck")


def _fsdp_clip_worker(info: DistInfo, root: str) -> dict[str, torch.Tensor]:
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.2)), strategy="fsdp", devices=2, accelerator="cpu",
                      batch_size=BATCH, epochs=1, out=f"{root}/fsdp", progress_bar=False, loggers=[],
                      grad_clip_norm=CLIP, max_steps_per_epoch=2)
    trainer.fit(_model(), _data(4 * BATCH, 1), loss=nn.functional.cross_entropy)
    return trainer.strategy.model_state_dict(trainer.module)


CLIP = 1e-3
"""Far below any gradient norm here: every step is clipped, so a wrong norm changes every step's update."""


def test_fsdp_clips_to_the_norm_over_all_shards(tmp_path):
    fsdp = run_ranks(_fsdp_clip_worker, str(tmp_path))[0]
    single = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.2)), strategy="single", devices=1,
                     accelerator="cpu", batch_size=2 * BATCH, epochs=1, out=str(tmp_path / "single"),
                     progress_bar=False, loggers=[], grad_clip_norm=CLIP, max_steps_per_epoch=2)
    single.fit(_model(), _data(4 * BATCH, 1), loss=nn.functional.cross_entropy)
    want = single.strategy.model_state_dict(single.module)
    assert _max_diff(want, _model().state_dict()) > 1e-5, "training must move the weights"
    assert _max_diff(fsdp, want) <= 1e-6
