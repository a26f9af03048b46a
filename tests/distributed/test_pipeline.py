"""pipeline (2 gloo ranks, one stage each, 4 micro-batches) computes what `single` does, saves what it would.

Real ranks through :func:`multiproc.run_ranks`. Every rank reads the same batches; only the last
stage computes the loss, which reaches metrics.jsonl through the normal all-reduced logging.

Exactness: each pipeline chunk's loss is weighted by its own size (chunks of a short batch differ)
and the schedule's own averaging is off, so without BatchNorm the reference is `single` with the
same batch. With BatchNorm each chunk is normalised by its own statistics, so the reference is
`single` accumulating the same micro-batches (``batch / M`` x ``accumulate_grad_batches = M``).
Weights are compared relative to each tensor's scale (BatchNorm's running variance is large).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.config import OptimConfig, ParallelConfig, RunConfig
from gputrain.tasks.classification import ClassificationTask
from multiproc import run_ranks

TOL = 1e-5
CLASSES = 5


def small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, CLASSES))


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=CLASSES)


def data(n: int, size: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def fit(out: str, model: nn.Module, train: TensorDataset, val: TensorDataset | None, *, strategy: str, devices: int,
        batch: int, accumulate: int = 1, schedule: str = "gpipe", split: str = "2", epochs: int = 2,
        lr: float = 0.05, clip: float = 0.0, resume: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    parallel = ParallelConfig(micro_batches=4, split_points=[split] if split else [], schedule=schedule)
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=lr, momentum=0.9), parallel=parallel)
    trainer = Trainer(cfg, strategy=strategy, devices=devices, accelerator="cpu", batch_size=batch,
                      accumulate_grad_batches=accumulate, epochs=epochs, out=out, progress_bar=False, loggers=[],
                      log_every_n_steps=1, grad_clip_norm=clip, resume=resume)
    summary = trainer.fit(model, train, val, task=ClassificationTask(CLASSES))
    state = {k: v.detach().cpu().clone() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}
    return state, summary["final"]


def validate(out: str, checkpoint: str, val: TensorDataset, *, strategy: str, devices: int) -> dict[str, float]:
    model = small_cnn()
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"], strict=True)
    cfg = RunConfig(parallel=ParallelConfig(micro_batches=4, split_points=["2"]))
    trainer = Trainer(cfg, strategy=strategy, devices=devices, accelerator="cpu", batch_size=8, out=out,
                      progress_bar=False, loggers=[])
    return trainer.validate(model, val, task=ClassificationTask(CLASSES))


def step_losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "step" in r and "train/samples" not in r]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) / max(1.0, float(b[k].double().abs().max()))
               for k in a if a[k].is_floating_point())


def _small_cnn_worker(info, tmp: str) -> dict:
    train, val = data(37, 8), data(37, 8, seed=2)
    gpipe = fit(f"{tmp}/gpipe", small_cnn(), train, val, strategy="pipeline", devices=2, batch=8, clip=0.5)
    onef1b = fit(f"{tmp}/1f1b", small_cnn(), train, val, strategy="pipeline", devices=2, batch=8, clip=0.5,
                 schedule="1f1b")
    ckpt = f"{tmp}/gpipe/checkpoints/last.pt"
    return {"gpipe": gpipe, "1f1b": onef1b,
            "eval_ddp": validate(f"{tmp}/eval_ddp", ckpt, val, strategy="ddp", devices=2),
            "eval_pipeline": validate(f"{tmp}/eval_pipeline", ckpt, val, strategy="pipeline", devices=2)}


@pytest.mark.slow
def test_small_cnn_gpipe_and_1f1b_match_single_and_save_a_plain_checkpoint(tmp_path):
    # 37 samples at batch 8: the last step's 5 samples run as chunks 2, 2 (one schedule step) and 1 (another).
    ranks = run_ranks(_small_cnn_worker, str(tmp_path))
    train, val = data(37, 8), data(37, 8, seed=2)
    single, single_final = fit(str(tmp_path / "single"), small_cnn(), train, val, strategy="single", devices=1,
                               batch=8, clip=0.5)
    assert max_rel_diff(single, small_cnn().state_dict()) > 1e-3, "training must move the weights"
    for schedule in ("gpipe", "1f1b"):
        weights, final = ranks[0][schedule]
        assert ranks[1][schedule][0] == {}, "the full state_dict is gathered on rank 0 only"
        assert step_losses(tmp_path / schedule) == pytest.approx(step_losses(tmp_path / "single"), abs=TOL)
        assert max_rel_diff(weights, single) <= TOL
        assert final["val/loss"] == pytest.approx(single_final["val/loss"], abs=TOL)
        assert final["val/samples"] == 37 and final["val/accuracy"] == single_final["val/accuracy"]
    saved = torch.load(tmp_path / "gpipe" / "checkpoints" / "last.pt", weights_only=True)
    small_cnn().load_state_dict(saved["model"], strict=True)
    # Gathered optimizer state is what one process holds: momentum per parameter, by the plain model's order.
    reference = torch.load(tmp_path / "single" / "checkpoints" / "last.pt", weights_only=True)["optimizer"]
    assert saved["optimizer"]["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        assert torch.allclose(saved["optimizer"]["state"][i]["momentum_buffer"], state["momentum_buffer"], atol=1e-4)
    # The checkpoint evaluates the same on 1 process, 2 DDP ranks and 2 pipeline stages (37 samples, odd).
    alone = validate(str(tmp_path / "eval_single"), str(tmp_path / "gpipe" / "checkpoints" / "last.pt"), val,
                     strategy="single", devices=1)
    # A pipeline checkpoint's saved config names strategy pipeline; on one process it is the plain model.
    one_stage = validate(str(tmp_path / "eval_one_stage"), str(tmp_path / "gpipe" / "checkpoints" / "last.pt"), val,
                         strategy="pipeline", devices=1)
    for metrics in (ranks[0]["eval_ddp"], ranks[0]["eval_pipeline"], one_stage):
        assert metrics["val/samples"] == 37
        assert metrics["val/loss"] == pytest.approx(alone["val/loss"], abs=TOL)
        assert metrics["val/accuracy"] == alone["val/accuracy"]


def _resnet_worker(info, tmp: str) -> tuple[dict[str, torch.Tensor], dict]:
    return fit(f"{tmp}/pipe", resnet18(), data(40, 64), None, strategy="pipeline", devices=2, batch=16,
               schedule="1f1b", split="layer3", epochs=1, lr=0.001)


@pytest.mark.slow
def test_resnet18_1f1b_with_batchnorm_matches_single_accumulating_the_same_micro_batches(tmp_path):
    # Steps of 16, 16 and 8 samples in chunks of 4: the last step runs 2 chunks, as GPipe (1F1B needs
    # at least as many chunks as stages; the arithmetic is the same). 64x64 inputs: see test_model_parallel.
    weights, _ = run_ranks(_resnet_worker, str(tmp_path))[0]
    single, _ = fit(str(tmp_path / "single"), resnet18(), data(40, 64), None, strategy="single", devices=1,
                    batch=4, accumulate=4, epochs=1, lr=0.001)
    assert step_losses(tmp_path / "pipe") == pytest.approx(step_losses(tmp_path / "single"), abs=TOL)
    assert max_rel_diff(weights, single) <= TOL
    saved = torch.load(tmp_path / "pipe" / "checkpoints" / "last.pt", weights_only=True)
    torchvision.models.resnet18(num_classes=CLASSES).load_state_dict(saved["model"], strict=True)


def _resume_worker(info, tmp: str) -> dict[str, torch.Tensor]:
    # split="": the measured partition, chosen on the first batch, after the optimizer exists (and, when
    # resuming, after the whole model and optimizer state were loaded): the latest the split can happen.
    train = data(37, 8)
    fit(f"{tmp}/from_pipeline", small_cnn(), train, None, strategy="pipeline", devices=2, batch=8, epochs=1, split="")
    resumed, _ = fit(f"{tmp}/from_single", small_cnn(), train, None, strategy="pipeline", devices=2, batch=8,
                     resume="auto", split="")
    return resumed


@pytest.mark.slow
def test_checkpoints_resume_across_single_and_pipeline(tmp_path):
    train = data(37, 8)
    full, _ = fit(str(tmp_path / "full"), small_cnn(), train, None, strategy="single", devices=1, batch=8)
    fit(str(tmp_path / "from_single"), small_cnn(), train, None, strategy="single", devices=1, batch=8, epochs=1)
    # The worker continues the single run on 2 stages, and trains 1 epoch on 2 stages for single to continue.
    on_pipeline = run_ranks(_resume_worker, str(tmp_path))[0]
    on_single, _ = fit(str(tmp_path / "from_pipeline"), small_cnn(), train, None, strategy="single", devices=1,
                       batch=8, resume="auto")
    assert max_rel_diff(on_pipeline, full) <= TOL
    assert max_rel_diff(on_single, full) <= TOL
    # The resumed pipeline's checkpoint holds every stage's fresh momentum, none left over from loading.
    saved = torch.load(tmp_path / "from_single" / "checkpoints" / "last.pt", weights_only=True)["optimizer"]
    reference = torch.load(tmp_path / "full" / "checkpoints" / "last.pt", weights_only=True)["optimizer"]
    assert saved["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        assert torch.allclose(saved["state"][i]["momentum_buffer"], state["momentum_buffer"], atol=1e-4)


def _short_batch_worker(info, tmp: str) -> dict[str, torch.Tensor]:
    # 13 samples at batch 8: steps of 8 (chunks 2, 2, 2, 2) and 5 (chunks 2, 2 in one schedule step, then 1).
    weights, _ = fit(f"{tmp}/pipe", small_cnn(), data(13, 8), None, strategy="pipeline", devices=2, batch=8,
                     epochs=1, clip=0.5)
    return weights


def test_two_stages_match_single_on_a_short_batch_with_unequal_chunks(tmp_path):
    # The fast guard of the chunk arithmetic: each chunk's loss weighted by its share of the batch,
    # the schedule's own averaging off (scale_grads=False), the clip norm over both stages.
    weights = run_ranks(_short_batch_worker, str(tmp_path))[0]
    single, _ = fit(str(tmp_path / "single"), small_cnn(), data(13, 8), None, strategy="single", devices=1,
                    batch=8, epochs=1, clip=0.5)
    assert max_rel_diff(single, small_cnn().state_dict()) > 1e-3, "training must move the weights"
    assert step_losses(tmp_path / "pipe") == pytest.approx(step_losses(tmp_path / "single"), abs=TOL)
    assert max_rel_diff(weights, single) <= TOL
