"""The same global batch gives the same weights: DDP on 2 real ranks, 1 process, accumulation."""

from __future__ import annotations

import json

import pytest
import torch

from autoencoder_runs import _max_diff, _train
from gputrain.models.vision import ConvAutoencoder
from multiproc import run_ranks


def _ddp_runs(info, out: str) -> dict[str, dict[str, torch.Tensor]]:
    # Both DDP runs in one launch of 2 ranks: process start-up (a torch import per rank) is paid once.
    return {"ddp": _train(f"{out}/ddp", "ddp", 2, 8), "ddp_accumulate": _train(f"{out}/acc", "ddp", 2, 4, accumulate=2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder, each rank's DDP runs, single with the global batch 16): what the tests below compare."""
    out = tmp_path_factory.mktemp("parity")
    ranks = run_ranks(_ddp_runs, str(out))
    return out, ranks, _train(str(out / "single"), "single", 1, 16)


def test_ddp_two_ranks_equals_one_process_with_double_batch(runs):
    _, ranks, single = runs
    initial = (torch.manual_seed(0), ConvAutoencoder().state_dict())[1]
    assert _max_diff(single, initial) > 1e-3, "training must have moved the weights for the test to mean anything"
    assert _max_diff(ranks[0]["ddp"], ranks[1]["ddp"]) == 0.0  # replicas stay identical
    assert _max_diff(ranks[0]["ddp"], single) <= 1e-5


def test_accumulating_two_batches_equals_one_double_batch(tmp_path, runs):
    accumulated = _train(str(tmp_path / "acc"), "single", 1, 8, accumulate=2)
    assert _max_diff(accumulated, runs[2]) <= 1e-5


def test_accumulation_with_ddp_skips_allreduce_but_matches(runs):
    # 2 ranks x batch 4 x 2 micro-batches == 1 process x batch 16.
    _, ranks, single = runs
    assert _max_diff(ranks[0]["ddp_accumulate"], single) <= 1e-5


def test_resume_from_mid_run_checkpoint_matches_uninterrupted(tmp_path):
    full = _train(str(tmp_path / "full"), "single", 1, 16, epochs=3)
    run = tmp_path / "interrupted"
    _train(str(run), "single", 1, 16, epochs=1)
    resumed = _train(str(run), "single", 1, 16, epochs=3, resume="auto")
    assert _max_diff(full, resumed) == 0.0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if "val/loss" in r] == [1, 2, 3]  # the resumed run appended


def test_saved_weights_have_no_module_prefix(runs):
    folder = runs[0] / "ddp" / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["epoch_0001.pt", "epoch_0002.pt", "last.pt"]
    for path in folder.glob("*.pt"):
        state = torch.load(path, weights_only=True)
        assert state["model"]
        assert not any(k.startswith("module.") for k in state["model"])
