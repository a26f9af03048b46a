"""FSDP runs that write sharded (torch.distributed.checkpoint) checkpoints resume on another process count."""

from __future__ import annotations

import torch

from accounting import max_diff, small_cnn, train
from gputrain.checkpoint import load_checkpoint, model_weights
from gputrain.config import ParallelConfig
from multiproc import run_ranks

SHARDED = ParallelConfig(sharded_checkpoint=True)


def _fsdp_worker(info, root: str) -> dict[str, torch.Tensor]:
    # Saved in the background (torch.distributed.checkpoint.async_save) at every step: each file is committed after
    # its folder, and a folder is pruned only once no file names it.
    train(f"{root}/sharded", strategy="fsdp", devices=2, batch_size=8, n=37, epochs=1, parallel=SHARDED,
          async_checkpoint=True, checkpoint_every_n_steps=1, keep_last=2)
    weights, _, _ = train(f"{root}/sharded-on2", strategy="fsdp", devices=2, batch_size=8, n=37, epochs=2,
                          parallel=SHARDED, resume=f"{root}/sharded/checkpoints/last.pt")
    return weights


def test_sharded_checkpoint_of_two_ranks_resumes_on_one_and_on_two(tmp_path):
    full, _, _ = train(tmp_path / "full", batch_size=16, n=37, epochs=2)
    on_two = run_ranks(_fsdp_worker, str(tmp_path), world_size=2)[0]
    checkpoints = tmp_path / "sharded" / "checkpoints"
    named = {load_checkpoint(p)["sharded"] for p in checkpoints.glob("*.pt")}
    assert named == {"step_000002.dcp", "epoch_0001.dcp"}  # keep_last=2 (last.pt is epoch_0001's); step 1 pruned
    assert {p.name for p in checkpoints.glob("*.dcp")} == named  # each rank wrote its shards there; none orphaned
    on_one, _, _ = train(tmp_path / "sharded-on1", batch_size=16, n=37, epochs=2, resume=str(checkpoints / "last.pt"))
    assert max_diff(on_two, full) <= 1e-5
    assert max_diff(on_one, full) <= 1e-5
    plain = small_cnn()
    plain.load_state_dict(model_weights(checkpoints / "last.pt"), strict=True)  # eval/export read the folder
