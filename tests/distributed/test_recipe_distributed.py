"""The reference recipe's run-level options keep gputrain's promises, on 2 real gloo ranks (issue 44): the EMA of the
weights (``trainer.ema_decay``), and MixUp, CutMix and repeated augmentation.

One start of 2 ranks (the ``ranks`` fixture) trains a small model with BatchNorm under ddp and under fsdp (sharded
checkpoints), each once straight through and once crashed mid-epoch and resumed, evaluates the ddp run's EMA
weights on 2 ranks, and trains with MixUp, CutMix and repeats on (straight through, and crashed and resumed); the
test process trains the 1-process references and resumes a 2-rank checkpoint on 1 process.
Checked: ddp's EMA equals one process's, fsdp's equals ddp's and each rank holds half of it; a resume mid-epoch ends
with the uninterrupted EMA bit for bit on the same world size and within float tolerance on another; the sharded
folder holds the EMA; the EMA evaluates to the logged ``val_ema`` metrics on 1 and 2 ranks; ``val_ema/loss`` can
pick best.pt. With MixUp, CutMix and each sample twice an epoch, ddp ends with one process's weights and a resume
with the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gputrain import Trainer
from gputrain.checkpoint import load_checkpoint
from gputrain.dist import DistInfo
from gputrain.tasks.base import Task
from multiproc import run_ranks
from training_recipe_runs import CRASH_AFTER, N_VAL, data, ema_model, ema_of, fit, local_ema_numel, weights_of

PARTS = {  # what each test reads of the ranks' runs
    "test_ddp_and_fsdp_emas_equal_one_process_and_fsdp_keeps_half_on_each_rank": {"ema", "memory"},
    "test_a_resume_mid_epoch_ends_with_the_uninterrupted_ema": {"ema"},
    "test_the_ema_evaluates_to_the_logged_val_ema_on_one_and_two_ranks": {"ema", "eval"},
    "test_mixup_cutmix_and_repeats_train_one_processs_weights_on_two_ranks_and_resume_exactly": {"mix"},
    "test_pipeline_stages_each_average_their_layers_and_resume_exactly": {"pipeline"},
    "test_ddp_with_modules_kept_in_float32_under_bf16_autocast_equals_one_process": {"fp32"},
}
"""All of them in ``make test``; in ``make mutants`` a planted fault's one or two tests train only what they read."""


def _worker(info: DistInfo, root: str, parts: set[str]) -> dict[str, Any]:
    base, out = Path(root), {}
    for strategy in ("ddp", "fsdp") if "ema" in parts else ():
        sharded = strategy == "fsdp"
        full = fit(base / strategy, strategy=strategy, devices=2, sharded=sharded)
        out[strategy] = ema_of(full)
        out[f"{strategy}_numel"] = local_ema_numel(full)
        fit(base / f"{strategy}_resumed", strategy=strategy, devices=2, crash=True, sharded=sharded)
        out[f"{strategy}_crashed"] = sorted(p.name for p in (base / f"{strategy}_resumed/checkpoints").glob("*.pt"))
        resumed = fit(base / f"{strategy}_resumed", strategy=strategy, devices=2, resume="auto", sharded=sharded)
        out[f"{strategy}_resumed"] = ema_of(resumed)
    if "fp32" in parts:  # trainer.fp32_modules under bf16-mixed autocast (issue 41), naming the root: all in float32
        out["fp32"] = weights_of(fit(base / "fp32", strategy="ddp", devices=2, precision="bf16-mixed",
                                     fp32_modules=["Sequential"]))
    if "pipeline" in parts:  # the batch of 6 in 2 micro-batches over 2 stages, each averaging its own layers
        out["pipeline"] = ema_of(fit(base / "pipeline", strategy="pipeline", devices=2, stages=True, batch_size=6))
        fit(base / "pipeline_resumed", strategy="pipeline", devices=2, stages=True, batch_size=6, crash=True)
        out["pipeline_resumed"] = ema_of(fit(base / "pipeline_resumed", strategy="pipeline", devices=2, stages=True,
                                             batch_size=6, resume="auto"))
    if "memory" in parts:  # memory over the first two steps, with an EMA and without one
        fit(base / "fsdp_memory", strategy="fsdp", devices=2, ema_every_n_steps=32, measure_memory=True)
        fit(base / "fsdp_plain", strategy="fsdp", devices=2, ema_decay=0.0, measure_memory=True)
    if "mix" in parts:
        out["mix"] = weights_of(fit(base / "mix", strategy="ddp", devices=2, mix=True))
        fit(base / "mix_resumed", strategy="ddp", devices=2, mix=True, crash=True)
        out["mix_resumed"] = weights_of(fit(base / "mix_resumed", strategy="ddp", devices=2, mix=True,
                                            resume="auto"))
    if "eval" in parts:
        model = ema_model()
        model.load_state_dict(load_checkpoint(base / "ddp" / "checkpoints" / "last.pt", weights="ema")["model"])
        out["eval_2_ranks"] = Trainer(strategy="ddp", devices=2, accelerator="cpu", eval_batch_size=4,
                                      out=str(base / "eval"), progress_bar=False, loggers=[]).validate(
            model, data(N_VAL, 2), task=Task(nn.functional.cross_entropy))
    return out


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    # A test missing from PARTS is a KeyError here: a new test names what it reads.
    parts = set().union(*(PARTS[item.originalname] for item in request.session.items
                          if item.module is request.module))
    root = tmp_path_factory.mktemp("recipe")
    return root, run_ranks(_worker, str(root), parts)


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _logged(run: Path, key: str) -> list[float]:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def test_ddp_and_fsdp_emas_equal_one_process_and_fsdp_keeps_half_on_each_rank(ranks, tmp_path):
    """Fault: fsdp's EMA kept as full tensors (the formulas themselves: tests/unit/test_recipe_options.py)."""
    root, (rank0, rank1) = ranks
    single = ema_of(fit(tmp_path / "single", strategy="single", devices=1))
    weights = load_checkpoint(root / "ddp" / "checkpoints" / "last.pt")["model"]
    assert _diff(rank0["ddp"], weights) > 1e-3  # the average trails the weights
    assert _diff(rank0["ddp"], single) < 1e-5
    assert _diff(rank0["fsdp"], rank0["ddp"]) < 1e-5
    for rank in (rank0, rank1):
        held, whole = rank["fsdp_numel"]
        assert held < 0.6 * whole, f"a rank holds {held} of the EMA's {whole} elements under fsdp"
        assert rank["ddp_numel"] == (whole, whole)
    # Measured by MemTracker (FSDPMemTracker) over the first two steps, beside a run without the EMA: each rank's
    # peak grows by its shard of the parameters and the buffers, never by the whole model.
    model = ema_model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    with_ema, without = (json.loads((root / run / "memory.json").read_text())["ranks"] for run in ("fsdp_memory", "fsdp_plain"))
    for a, b in zip(with_ema, without, strict=True):
        grown = a["peak_bytes"] - b["peak_bytes"]
        assert 0.4 * params <= grown <= 0.6 * params + buffers, (grown, params, buffers)  # shards split unevenly
        # Counted with the parameters, where the plan counts it (else MemTracker files it under whatever the step
        # was doing when the first update touched it).
        assert a["parts"]["parameters"] - b["parts"]["parameters"] == grown, (a["parts"], b["parts"])


def test_a_resume_mid_epoch_ends_with_the_uninterrupted_ema(ranks, tmp_path):
    """Faults: the EMA missing from a checkpoint file or a sharded folder; its update count not restored."""
    root, (rank0, _) = ranks
    for strategy in ("ddp", "fsdp"):  # the same world size: bit for bit
        assert rank0[f"{strategy}_crashed"][-1] == f"step_{CRASH_AFTER - 1:06d}.pt"  # it stopped mid-epoch 2
        assert _diff(rank0[f"{strategy}_resumed"], rank0[strategy]) == 0.0, strategy
    saved = load_checkpoint(root / "fsdp_resumed" / "checkpoints" / f"step_{CRASH_AFTER - 1:06d}.pt")
    assert saved["sharded"] and saved["ema"]["updates"] == CRASH_AFTER - 1 and "weights" not in saved["ema"]
    # On another world size: the 2-rank mid-epoch checkpoint resumed on 1 process.
    crashed = tmp_path / "one"
    crashed.mkdir()
    step = root / "ddp_resumed" / "checkpoints" / f"step_{CRASH_AFTER - 1:06d}.pt"
    one = ema_of(fit(crashed, strategy="single", devices=1, resume=str(step)))
    assert _diff(one, rank0["ddp"]) < 1e-5


def test_the_ema_evaluates_to_the_logged_val_ema_on_one_and_two_ranks(ranks, tmp_path):
    """Fault: validation of the EMA run with the live weights' BatchNorm statistics."""
    root, (rank0, _) = ranks
    run = root / "ddp"
    logged, live = _logged(run, "val_ema/loss"), _logged(run, "val/loss")
    assert len(logged) == 2 and logged[-1] != live[-1]
    assert rank0["eval_2_ranks"]["val/loss"] == logged[-1]
    model = ema_model()
    model.load_state_dict(load_checkpoint(run / "checkpoints" / "last.pt", weights="ema")["model"])
    one = Trainer(strategy="single", accelerator="cpu", eval_batch_size=4, out=str(tmp_path / "eval"),
                  progress_bar=False, loggers=[]).validate(model, data(N_VAL, 2), task=Task(nn.functional.cross_entropy))
    assert one["val/loss"] == pytest.approx(logged[-1], rel=1e-6, abs=1e-7)
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    assert best["state"]["epoch"] in (1, 2)  # picked by trainer.monitor=val_ema/loss


def test_mixup_cutmix_and_repeats_train_one_processs_weights_on_two_ranks_and_resume_exactly(ranks, tmp_path):
    """Faults: pairs not dealt whole to one rank; the draw taken per rank, not per global step."""
    root, (rank0, _) = ranks
    single = weights_of(fit(tmp_path / "mix", strategy="single", devices=1, mix=True))
    unmixed = weights_of(fit(tmp_path / "plain", strategy="single", devices=1, mix=True, alphas=(0.0, 0.0)))
    assert _diff(single, unmixed) > 1e-3  # mixing changed what was trained
    assert _diff(rank0["mix"], single) < 1e-5
    assert _diff(rank0["mix_resumed"], rank0["mix"]) == 0.0
    # The 2-rank checkpoint from the middle of epoch 2, resumed on 1 process: the same pairs and draws follow.
    step = root / "mix_resumed" / "checkpoints" / f"step_{CRASH_AFTER - 1:06d}.pt"
    (tmp_path / "one").mkdir()
    one = weights_of(fit(tmp_path / "one", strategy="single", devices=1, mix=True, resume=str(step)))
    assert _diff(one, rank0["mix"]) < 1e-5


def test_pipeline_stages_each_average_their_layers_and_resume_exactly(ranks, tmp_path):
    """The EMA under pipeline equals one process accumulating the same 2 micro-batches, gathered from both stages."""
    _, (rank0, _) = ranks
    single = ema_of(fit(tmp_path / "single", strategy="single", devices=1, stages=True, batch_size=3,
                        accumulate_grad_batches=2))
    assert _diff(rank0["pipeline"], single) < 1e-5
    assert _diff(rank0["pipeline_resumed"], rank0["pipeline"]) == 0.0


def test_ddp_with_modules_kept_in_float32_under_bf16_autocast_equals_one_process(ranks, tmp_path):
    """trainer.fp32_modules keeps parity. Under bf16 autocast, ddp and one process differ by bfloat16's rounding
    (0.14 here after 14 steps), which no tolerance separates from a fault; with the whole model named (the root
    Sequential) every module runs in float32: ddp equals one process, and both equal precision 32."""
    _, (rank0, _) = ranks
    kept = weights_of(fit(tmp_path / "fp32", strategy="single", devices=1, precision="bf16-mixed",
                          fp32_modules=["Sequential"]))
    autocast = weights_of(fit(tmp_path / "bf16", strategy="single", devices=1, precision="bf16-mixed"))
    full = weights_of(fit(tmp_path / "32", strategy="single", devices=1, precision="32"))
    assert _diff(autocast, full) > 1e-3  # bfloat16 autocast trains otherwise
    assert _diff(kept, full) < 1e-6
    assert _diff(rank0["fp32"], kept) < 1e-5
