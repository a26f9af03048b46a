"""Exact data accounting with real gloo ranks: any dataset size, any world size, and mid-epoch resume across them.

N ranks with batch B must end an epoch with the weights of one process with batch N*B, having
trained each sample once, for dataset sizes that do not divide into global batches; a run
checkpointed in the middle of an epoch on 2 processes and resumed on 1 (or the reverse) trains
exactly the samples it had not yet trained.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from accounting import StopAtStep, max_diff, train
from multiproc import RankFailed, run_ranks

SIZES = (97, 101, 128)
GLOBAL_BATCH = 24  # divisible by 1, 2 and 3 ranks, with and without accumulation 2 (for 2 ranks)


def _combos(world: int) -> list[tuple[int, int]]:
    """(dataset size, accumulation) pairs run at this world size."""
    accumulations = (1, 2) if GLOBAL_BATCH % (2 * world) == 0 else (1,)
    return [(n, a) for n in SIZES for a in accumulations]


def _matrix_worker(info, out: str) -> dict:
    results = {}
    for n, accumulate in _combos(info.world_size):
        batch = GLOBAL_BATCH // (info.world_size * accumulate)
        weights, seen, _ = train(f"{out}/w{info.world_size}-n{n}-a{accumulate}", strategy="ddp",
                                 devices=info.world_size, batch_size=batch, n=n, accumulate=accumulate, epochs=1)
        results[(n, accumulate)] = (weights, seen)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_n_ranks_equal_one_process_at_any_dataset_size(tmp_path, world, request):
    # 2 ranks: the launch the mid-epoch resume test below shares (see two_ranks).
    per_rank = ([r["matrix"] for r in request.getfixturevalue("two_ranks")[1]] if world == 2
                else run_ranks(_matrix_worker, str(tmp_path), world_size=world))
    references = {n: train(tmp_path / f"single-{n}", batch_size=GLOBAL_BATCH, n=n, epochs=1)[0] for n in SIZES}
    for n, accumulate in _combos(world):
        reference = references[n]
        weights = [r[(n, accumulate)][0] for r in per_rank]
        seen = Counter(i for r in per_rank for i in r[(n, accumulate)][1])
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}, f"n={n}: a sample twice or skipped"
        assert max_diff(weights[0], reference) <= 1e-5, f"n={n} accumulate={accumulate}"
        assert max_diff(weights[0], weights[-1]) == 0.0  # replicas identical


def test_accumulation_in_one_process_equals_the_bigger_batch_at_an_odd_size(tmp_path):
    big, seen, _ = train(tmp_path / "big", batch_size=24, n=101, epochs=1)
    small, _, _ = train(tmp_path / "acc", batch_size=6, accumulate=4, n=101, epochs=1)
    assert sorted(seen) == list(range(101))
    assert max_diff(big, small) <= 1e-5


# -- mid-epoch resume across world sizes -------------------------------------------------------------
N, EPOCHS, EVERY, CRASH = 101, 2, 3, 4  # 101 samples at global batch 16: 7 steps an epoch; crash in epoch 1


def _crash(out: str, devices: int, workers: int) -> None:
    """A run that checkpoints every 3 steps and dies after step 4: its newest checkpoint is mid-epoch, step 3."""
    with pytest.raises(RuntimeError, match="planned crash"):
        train(out, strategy="ddp" if devices > 1 else "single", devices=devices, batch_size=16 // devices, n=N,
              epochs=EPOCHS, workers=workers, checkpoint_every_n_steps=EVERY, hooks=[StopAtStep(CRASH)])


def _resume(out: str, devices: int, workers: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    weights, seen, run = train(out, strategy="ddp" if devices > 1 else "single", devices=devices,
                               batch_size=16 // devices, n=N, epochs=EPOCHS, workers=workers, resume="auto")
    assert run.resumed and run.state.epoch == EPOCHS
    return weights, seen


def _two_rank_worker(info, root: str, workers: int) -> dict:
    import shutil

    import torch.distributed as dist

    full, _, _ = train(f"{root}/full2", strategy="ddp", devices=2, batch_size=8, n=N, epochs=EPOCHS, workers=workers)
    _crash(f"{root}/from2", 2, workers)
    dist.barrier()
    if info.rank == 0:  # the same interrupted run, resumed here on 2 ranks and by the test on 1
        shutil.copytree(f"{root}/from2", f"{root}/from2-on2")
        shutil.copytree(f"{root}/from2", f"{root}/from2-on1")
    dist.barrier()
    return {"full": full, "1->2": _resume(f"{root}/from1", 2, workers), "2->2": _resume(f"{root}/from2-on2", 2, workers)}


def _both_worker(info, root: str) -> dict:
    return {"matrix": _matrix_worker(info, f"{root}/matrix"), "resume": _two_rank_worker(info, root, 0)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 2-rank launch (its process start-up paid once) for two tests: the dataset-size matrix at 2 ranks, and
    the mid-epoch runs on 2 ranks, which resume the 1-process run crashed here first. (root folder, by rank)."""
    root = tmp_path_factory.mktemp("two_ranks")
    _crash(str(root / "from1"), 1, 0)
    return root, run_ranks(_both_worker, str(root), world_size=2)


def test_mid_epoch_checkpoint_resumes_exactly_on_any_world_size(tmp_path, two_ranks):
    workers = 0  # as in the 2-rank runs of the fixture
    full, full_seen, _ = train(tmp_path / "full", batch_size=16, n=N, epochs=EPOCHS, workers=workers)
    root, ranks = two_ranks
    per_rank = [r["resume"] for r in ranks]
    two_to_one = _resume(str(root / "from2-on1"), 1, workers)

    # Resumed from step 3 of epoch 1: the rest of epoch 1 trains each sample not in its first 3 steps
    # exactly once, then epoch 2 trains every sample once. So the first 48 ids appear once, the rest twice.
    first_steps = set(full_seen[:3 * 16])
    expected = Counter({i: 1 if i in first_steps else 2 for i in range(N)})
    one_to_two = ({k: v for k, v in per_rank[0]["1->2"][0].items()}, [i for r in per_rank for i in r["1->2"][1]])
    for name, (weights, seen) in {"2->1": two_to_one, "1->2": one_to_two}.items():
        assert Counter(seen) == expected, f"{name}: samples replayed or skipped after the resume"
        assert max_diff(weights, full) <= 1e-5, name  # another world size: equal within float tolerance
    # The same world size: bitwise equal to the uninterrupted 2-rank run.
    assert max_diff(per_rank[0]["2->2"][0], per_rank[0]["full"]) == 0.0
    assert max_diff(per_rank[0]["full"], full) <= 1e-5


def test_loader_workers_change_nothing_in_a_run_or_its_mid_epoch_resume(tmp_path):
    """2 loader workers: the same weights as none, and a crash mid-epoch resumes to them bit for bit.

    Samples are seeded by (seed, epoch, index), not by the worker that reads them, so the worker count is
    free to differ between runs and resumes (the cross-world-size resume above runs without workers; this
    one process run keeps the suite's time: 2 ranks x 2 workers took ~70 s).
    """
    plain, _, _ = train(tmp_path / "plain", batch_size=16, n=N, epochs=EPOCHS, workers=0)
    full, full_seen, _ = train(tmp_path / "full", batch_size=16, n=N, epochs=EPOCHS, workers=2)
    assert max_diff(full, plain) == 0.0
    _crash(str(tmp_path / "crashed"), 1, 2)
    weights, seen = _resume(str(tmp_path / "crashed"), 1, 2)
    first_steps = set(full_seen[:3 * 16])
    assert Counter(seen) == Counter({i: 1 if i in first_steps else 2 for i in range(N)})
    assert max_diff(weights, full) == 0.0


def _uneven_worker(info, out: str) -> None:
    train(out, strategy="ddp", devices=2, batch_size=8, n=40 + info.rank, epochs=1)


def test_datasets_of_different_length_per_rank_fail_fast_with_the_counts(tmp_path):
    with pytest.raises(RankFailed) as failed:
        run_ranks(_uneven_worker, str(tmp_path), world_size=2)
    assert "different length on each rank ({0: 40, 1: 41})" in str(failed.value)
