"""FSDP runs that write sharded (torch.distributed.checkpoint) checkpoints resume on another process count."""

from __future__ import annotations

import torch

from accounting import max_diff, small_cnn, train
from gputrain.checkpoint import model_weights
from gputrain.config import ParallelConfig
from multiproc import run_ranks

SHARDED = ParallelConfig(sharded_checkpoint=True)


def _fsdp_worker(info, root: str) -> dict[str, torch.Tensor]:
    train(f"{root}/sharded", strategy="fsdp", devices=2, batch_size=8, n=37, epochs=1, parallel=SHARDED)
    weights, _, _ = train(f"{root}/sharded-on2", strategy="fsdp", devices=2, batch_size=8, n=37, epochs=2,
                          parallel=SHARDED, resume=f"{root}/sharded/checkpoints/last.pt")
    return weights


def test_sharded_checkpoint_of_two_ranks_resumes_on_one_and_on_two(tmp_path):
    full, _, _ = train(tmp_path / "full", batch_size=16, n=37, epochs=2)
    on_two = run_ranks(_fsdp_worker, str(tmp_path), world_size=2)[0]
    checkpoints = tmp_path / "sharded" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("*.dcp")) == ["epoch_0001.dcp"]  # each rank wrote its shards there
    on_one, _, _ = train(tmp_path / "sharded-on1", batch_size=16, n=37, epochs=2, resume=str(checkpoints / "last.pt"))
    assert max_diff(on_two, full) <= 1e-5
    assert max_diff(on_one, full) <= 1e-5
    plain = small_cnn()
    plain.load_state_dict(model_weights(checkpoints / "last.pt"), strict=True)  # eval/export read the folder
