"""``trainer.compile``: compiled training ends where eager training ends (1e-4), in one process, under DDP on 2
real ranks, and per stage of a model split over devices (issue 16 item 1).

Inductor compiles on a CPU too (the C++ backend), so these run the real compiler, not a stand-in; its cache
(/tmp/torchinductor_USER) makes a second run fast, a cold one pays a g++ build per fused kernel (seconds each). So
the runs compile as little as proves the promise: a model with one of each of the autoencoder's layers (6 kernels
for its training graphs, the autoencoder's 10), and its training graphs alone: no validation (an eval graph under
no_grad) and no samples.png (batches of 1: a dynamic-shape graph) after the last step; neither changes the weights
compared.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoencoder_runs import _max_diff, _train
from multiproc import run_ranks

pytestmark = pytest.mark.slow


class TwoBlocks(nn.Module):
    """The autoencoder's layout with one layer of each kind: a chain of two blocks, which fsdp shards into two units
    and model_parallel and pipeline split into two stages. Its code between them is 4x2x2, wider than 1x1: a compiled
    stage may pass it (and its gradient) on channels-last, which gloo refuses unless the stage makes it contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(10))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(4, 3, 10, stride=10))

    def chain_blocks(self) -> list[tuple[str, nn.Module]]:
        return [("encoder", self.encoder), ("decoder", self.decoder)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


# Training only: what these tests compare are the trained weights (see the module's docstring).
TRAINING_ONLY = {"eval_every_n_epochs": 10**9, "pictures": 0}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _eager_and_compiled(out: str, strategy: str, devices: int, **options: object) -> tuple[float | None, int, int]:
    """Max weight difference after 2 epochs (None on a rank that holds no full state dict: FSDP's and pipeline's
    are gathered on rank 0), and the graphs dynamo compiled for each run (0 for eager)."""
    options = {"model_fn": TwoBlocks, **TRAINING_ONLY, **options}
    before = _graphs()
    eager = _train(f"{out}/eager", strategy, devices, 8, **options)
    after_eager = _graphs()
    compiled = _train(f"{out}/compiled", strategy, devices, 8, compile=True, **options)
    return _max_diff(eager, compiled) if eager else None, after_eager - before, _graphs() - after_eager


def test_compiled_training_ends_where_eager_training_ends(tmp_path):
    diff, eager_graphs, compiled_graphs = _eager_and_compiled(str(tmp_path), "single", 1)
    assert eager_graphs == 0 and compiled_graphs >= 1  # it really ran compiled
    assert diff < 1e-4


STRATEGIES = ("ddp", "fsdp", "pipeline")


def _ranks(info, out: str) -> dict[str, tuple[float, int, int]]:
    # One launch for the three strategies: process start-up is paid once.
    return {s: _eager_and_compiled(f"{out}/{s}", s, 2) for s in STRATEGIES}


def test_compiled_ddp_fsdp_and_pipeline_on_two_ranks_end_where_eager_ends(tmp_path):
    results = run_ranks(_ranks, str(tmp_path))
    for rank, by_strategy in enumerate(results):
        for strategy, (diff, eager_graphs, compiled_graphs) in by_strategy.items():
            assert eager_graphs == 0 and compiled_graphs >= 1, (rank, strategy)
            assert rank > 0 or diff is not None, strategy
            assert diff is None or diff < 1e-4, (rank, strategy, diff)


def test_each_stage_of_a_split_model_is_compiled_and_trains_as_eager(tmp_path):
    diff, eager_graphs, compiled_graphs = _eager_and_compiled(str(tmp_path), "model_parallel", 1)
    assert eager_graphs == 0 and compiled_graphs >= 2  # one graph per stage at least
    assert diff < 1e-4
