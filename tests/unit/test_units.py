"""Pure logic, no processes: samplers and the epoch plan, schedules, config, checkpoint files, derived model
arguments, and the per-device batch a resume uses."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from gputrain.checkpoint import atomic_save, load_checkpoint
from gputrain.config import SchedulerConfig, load_config
from gputrain.data.samplers import EpochPlan, StepBatchSampler, epoch_permutation, eval_shard
from gputrain.optim import lr_factor


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [359, 360, 7])
def test_eval_shards_cover_every_sample_once(n, world):
    shards = [eval_shard(n, r, world) for r in range(world)]
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def _step_sets(n: int, world: int, batch: int, accumulate: int, drop_last: bool = False) -> list[list[int]]:
    plan = EpochPlan(n, seed=3, epoch=1, dp_size=world, batch_size=batch, accumulate=accumulate, drop_last=drop_last)
    return [sorted(i for micro in plan.micro_batches(k) for share in micro for i in share)
            for k in range(plan.num_steps)]


@pytest.mark.parametrize("n", [97, 101, 128, 5])
@pytest.mark.parametrize(("world", "batch", "accumulate"), [(1, 32, 1), (2, 16, 1), (3, 8, 1), (2, 8, 2), (4, 4, 2)])
def test_every_sample_once_and_steps_equal_one_process_with_the_global_batch(n, world, batch, accumulate):
    steps = _step_sets(n, world, batch, accumulate)
    assert sorted(i for step in steps for i in step) == list(range(n))  # no sample twice, none skipped
    reference = _step_sets(n, 1, world * batch * accumulate, 1)  # one process, the same global batch
    assert steps == reference


def test_rank_batches_of_a_short_last_step_may_be_empty_but_are_never_padded():
    plan = EpochPlan(97, seed=0, epoch=0, dp_size=2, batch_size=16, accumulate=1)
    last = plan.micro_batches(plan.num_steps - 1)
    assert [len(share) for share in last[-1]] == [1, 0]
    samplers = [StepBatchSampler(97, dp_rank=r, dp_size=2, batch_size=16) for r in range(2)]
    seen = [i for s in samplers for batch in s for _, i in batch]
    assert sorted(seen) == list(range(97))
    assert [len(s) for s in samplers] == [4, 3]


def test_mid_epoch_start_step_yields_exactly_the_unseen_samples():
    full = StepBatchSampler(101, dp_rank=0, dp_size=1, batch_size=10)
    full.set_epoch(2)
    resumed = [StepBatchSampler(101, dp_rank=r, dp_size=2, batch_size=5) for r in range(2)]
    for s in resumed:
        s.set_epoch(2, start_step=4)  # 4 steps of 10 done before the checkpoint
    before = [i for batch in list(full)[:4] for _, i in batch]
    after = [i for s in resumed for batch in s for _, i in batch]
    assert sorted(before + after) == list(range(101)) and not set(before) & set(after)


def test_train_order_depends_on_seed_and_epoch_only():
    assert epoch_permutation(50, 1, 2) == epoch_permutation(50, 1, 2)
    assert epoch_permutation(50, 1, 2) != epoch_permutation(50, 1, 3)
    assert epoch_permutation(50, 1, 2) != epoch_permutation(50, 2, 2)


def test_drop_last_drops_only_the_short_last_global_batch():
    steps = _step_sets(7, 2, 2, 1, drop_last=True)
    assert len(steps) == 1 and len(steps[0]) == 4


def test_lr_schedules():
    cosine = SchedulerConfig(name="cosine", warmup_steps=10)
    assert lr_factor(0, 110, 10, cosine) == pytest.approx(0.1)
    assert lr_factor(9, 110, 10, cosine) == pytest.approx(1.0)
    assert lr_factor(60, 110, 10, cosine) == pytest.approx(0.5)
    assert lr_factor(110, 110, 10, cosine) == pytest.approx(0.0)
    poly = SchedulerConfig(name="poly", power=1.0)
    assert lr_factor(50, 100, 10, poly) == pytest.approx(0.5)
    step = SchedulerConfig(name="step", step_epochs=2, gamma=0.1)
    assert lr_factor(19, 100, 10, step) == pytest.approx(1.0)
    assert lr_factor(20, 100, 10, step) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="scheduler.name='linearx'"):
        lr_factor(0, 10, 1, SchedulerConfig(name="linearx"))


def test_config_overrides_and_type_errors():
    cfg = load_config("autoencoder", ["trainer.epochs=3", "optim.lr=0.1", "trainer.loggers=[csv,wandb]"])
    assert (cfg.trainer.epochs, cfg.optim.lr, cfg.trainer.loggers) == (3, 0.1, ["csv", "wandb"])
    assert cfg.model.name == "conv_autoencoder"
    with pytest.raises(ValueError, match="trainer.epochs"):
        load_config("autoencoder", ["trainer.epochs=three"])
    with pytest.raises(ValueError, match="trainer.epohcs"):
        load_config("autoencoder", ["trainer.epohcs=3"])
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        load_config("nope")


def test_an_unknown_recipe_names_the_near_one_or_the_file_of_that_name_here(tmp_path, monkeypatch):
    """Found by a new user (round 5): `gputrain train tiny-ae` said only "unknown recipe" beside tiny-ae.yaml."""
    with pytest.raises(ValueError, match=r"^unknown recipe 'autoencodr' \(did you mean autoencoder\?\); built-in"):
        load_config("autoencodr")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-ae.yaml").write_text("task: autoencoder\n")
    with pytest.raises(ValueError, match=r"^unknown recipe 'tiny-ae'; to train the recipe file tiny-ae.yaml, name it "
                                         r"with its suffix: gputrain train tiny-ae.yaml$"):
        load_config("tiny-ae")


def test_atomic_save_keeps_old_checkpoint_when_write_fails(tmp_path):
    path = tmp_path / "last.pt"
    atomic_save({"model": {"w": torch.ones(2)}}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"model": {"w": torch.zeros(2)}, "bad": Unpicklable()}, path)
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left behind


def test_load_refuses_malicious_pickle_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"model": Exploit()}))
    with pytest.raises(ValueError, match="evil.pt cannot be loaded safely"):
        load_checkpoint(path)
    assert not marker.exists()


def test_truncated_checkpoint_error_names_file(tmp_path):
    path = tmp_path / "last.pt"
    atomic_save({"model": {"w": torch.ones(100)}}, path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="last.pt cannot be loaded safely"):
        load_checkpoint(path)


def test_task_records_derived_model_arguments_in_config():
    from gputrain.config import ModelConfig
    from gputrain.models import build_configured_model

    cfg = ModelConfig(kwargs={"cifar_stem": False})
    model = build_configured_model(cfg, "resnet18", num_classes=7)
    assert cfg.name == "resnet18" and cfg.kwargs == {"num_classes": 7, "cifar_stem": False}
    assert model.fc.out_features == 7
    explicit = ModelConfig(name="resnet18", kwargs={"num_classes": 3})
    assert build_configured_model(explicit, "resnet50", num_classes=7).fc.out_features == 3


# -- sampling, known answers written by hand (issue 28 item 11) ---------------------------------------------------
def test_an_accumulating_epoch_deals_these_samples_to_each_rank_and_a_short_last_step_leaves_rank_1_none():
    # 9 samples in order, batch 2 on 2 ranks, accumulation 2: global batch 8, so step 0 holds samples 0-7 in two
    # micro-batches of 4 dealt by stride, and step 1 holds sample 8 alone (rank 1 gets nothing to read).
    plan = EpochPlan(9, seed=0, epoch=0, dp_size=2, batch_size=2, accumulate=2, shuffle=False)
    assert (plan.global_batch, plan.num_steps, plan.step_size(0), plan.step_size(1)) == (8, 2, 8, 1)
    assert plan.micro_batches(0) == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]
    assert plan.micro_batches(1) == [[[8], []]]
    ranks = [StepBatchSampler(9, dp_rank=r, dp_size=2, batch_size=2, accumulate=2, shuffle=False) for r in range(2)]
    for s in ranks:
        s.set_epoch(3)
    assert list(ranks[0]) == [[(3, 0), (3, 2)], [(3, 4), (3, 6)], [(3, 8)]]
    assert list(ranks[1]) == [[(3, 1), (3, 3)], [(3, 5), (3, 7)]]
    assert [len(s) for s in ranks] == [3, 2]
    for s in ranks:
        s.set_epoch(4, start_step=1)  # resumed after step 0 of epoch 4
    assert [list(s) for s in ranks] == [[[(4, 8)]], []] and [len(s) for s in ranks] == [1, 0]


def test_drop_last_keeps_only_whole_global_batches():
    plan = EpochPlan(9, seed=0, epoch=0, dp_size=2, batch_size=2, accumulate=2, drop_last=True, shuffle=False)
    assert (plan.num_samples, plan.num_steps) == (8, 1)
    assert plan.micro_batches(0) == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]


def test_the_evaluation_sampler_gives_each_rank_every_world_size_th_sample():
    from gputrain.data.samplers import EvalSampler

    assert [list(EvalSampler(11, rank=r, world_size=3)) for r in range(3)] == [
        [0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert [len(EvalSampler(11, rank=r, world_size=3)) for r in range(3)] == [4, 4, 3]
    assert list(EvalSampler(4)) == [0, 1, 2, 3]


def test_no_two_seeds_share_an_epochs_order():
    orders = {(seed, epoch): tuple(epoch_permutation(40, seed, epoch)) for seed in range(4) for epoch in range(4)}
    assert len(set(orders.values())) == 16, "two (seed, epoch) pairs draw the same order"


def test_reading_a_seeded_sample_leaves_the_callers_generator_as_it_was():
    """Augmentation draws from its own (seed, epoch, index) stream; dropout's stream in the caller goes on untouched."""
    from gputrain.data.samplers import SeededSamples

    class Draws(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(2)

    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    samples = SeededSamples(Draws(), seed=5)
    first = samples[(0, 1)]
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(samples[(0, 1)], first)


# -- resume: the per-device batch that keeps the checkpoint's global batch ---------------------------------------
def test_a_resume_keeps_the_global_batch_counting_accumulation():
    from gputrain.config.resolve import resumed_batch_size

    assert resumed_batch_size(16, 2, 2, 4, "run/last.pt") == 4  # as saved: 4 x 2 ranks x 2 accumulation
    assert resumed_batch_size(16, 4, 2, 4, "run/last.pt") == 2  # 4 ranks: 2 each
    assert resumed_batch_size(16, 1, 4, 1, "run/last.pt") == 4  # one rank, 4 micro-batches
    assert resumed_batch_size(24, 2, 3, 2, "run/last.pt") == 4
    with pytest.raises(ValueError) as err:  # 12 = 2 ranks x 4 micro-batches x 1.5
        resumed_batch_size(12, 2, 4, 1, "run/last.pt")
    assert str(err.value) == ("checkpoint run/last.pt was trained with global batch 12, which 2 process(es) x "
                              "accumulation 4 cannot split evenly; resume on 1, 3 process(es), or set "
                              "trainer.accumulate_grad_batches so that it divides")
    with pytest.raises(ValueError, match=r"global batch 10, which 4 process\(es\) x accumulation 1 cannot split "
                                         r"evenly; resume on 1, 2, 5, 10 process\(es\)"):
        resumed_batch_size(10, 4, 1, 2, "run/last.pt")
