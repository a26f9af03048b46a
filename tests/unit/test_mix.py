"""MixUp, CutMix and repeated augmentation (issue 44): what they do to a pair of images and its labels, and that the
epoch plan makes them independent of the number of processes.

The mixing is torchvision's (``v2.MixUp``, ``v2.CutMix``) applied to every pair of a step with one draw from
``(seed, epoch, step)``; the plan deals each pair to one rank and repeats each sample in a row. The 2-rank parity and
resume checks: tests/distributed/test_recipe_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from gputrain.config import load_config
from gputrain.data.mix import PairMixer
from gputrain.data.samplers import EpochPlan, SeededSamples

IMAGES = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
LABELS = torch.tensor([0, 1, 2, 3, 1, 0])


def _mix(mixup: float, cutmix: float, step: int, images: torch.Tensor = IMAGES, labels: torch.Tensor = LABELS):
    return PairMixer(mixup_alpha=mixup, cutmix_alpha=cutmix, num_classes=4, seed=0)(images, labels, epoch=1, step=step)


def test_mixup_blends_each_pair_by_the_ratio_its_labels_carry():
    mixed, soft = _mix(0.2, 0.0, step=3)
    lam = float(soft[0, 0])  # sample 0 is class 0, its partner class 1
    assert 0 < lam < 1 and soft.shape == (6, 4)
    for a, b in ((0, 1), (2, 3), (4, 5)):
        torch.testing.assert_close(mixed[a], lam * IMAGES[a] + (1 - lam) * IMAGES[b])
        torch.testing.assert_close(mixed[b], lam * IMAGES[b] + (1 - lam) * IMAGES[a])
        expected = lam * torch.eye(4)[LABELS[a]] + (1 - lam) * torch.eye(4)[LABELS[b]]
        torch.testing.assert_close(soft[a], expected)
    torch.testing.assert_close(soft.sum(1), torch.ones(6))


def test_cutmix_pastes_one_box_into_every_pair_and_the_labels_carry_its_area():
    mixed, soft = _mix(0.0, 1.0, step=1)  # a step whose box is not empty
    own = (mixed[0] == IMAGES[0]).all(0)  # pixels of sample 0 that stayed its own
    assert 0 < int(own.sum()) < 64
    assert float(soft[0, 0]) == pytest.approx(float(own.float().mean()))
    for a, b in ((0, 1), (2, 3), (4, 5)):  # the same box in every pair, filled from the partner
        assert torch.equal(mixed[a][:, ~own], IMAGES[b][:, ~own]) and torch.equal(mixed[a][:, own], IMAGES[a][:, own])
        assert torch.equal(mixed[b][:, ~own], IMAGES[a][:, ~own])


def test_draws_follow_the_step_and_a_sample_without_a_partner_is_left_alone():
    first, again, other = _mix(1.0, 1.0, step=2), _mix(1.0, 1.0, step=2), _mix(1.0, 1.0, step=4)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    state = torch.get_rng_state()
    mixed, soft = _mix(0.2, 0.0, step=3, images=IMAGES[:5], labels=LABELS[:5])
    assert torch.equal(torch.get_rng_state(), state)  # the run's own generator is left where it was
    assert torch.equal(mixed[4], IMAGES[4]) and torch.equal(soft[4], torch.eye(4)[LABELS[4]])


def test_every_pair_is_dealt_to_one_rank_so_mixing_is_the_same_on_any_number_of_ranks():
    """A step's mixed samples, by index, are the same whether one process or 2 or 4 ranks read it."""
    data = torch.rand(23, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(23) % 4

    def mixed_by_index(dp: int) -> dict[int, torch.Tensor]:
        plan = EpochPlan(23, seed=0, epoch=0, dp_size=dp, batch_size=8 // dp, unit=2)
        out = {}
        for k in range(plan.num_steps):
            for micro in plan.micro_batches(k):
                for share in micro:
                    if share:
                        images, _ = _mix(1.0, 1.0, step=k, images=data[share], labels=labels[share])
                        out |= dict(zip(share, images, strict=True))
        return out

    one = mixed_by_index(1)
    assert len(one) == 23 and any(not torch.equal(one[i], data[i]) for i in one)
    for dp in (2, 4):
        many = mixed_by_index(dp)
        assert all(torch.equal(many[i], one[i]) for i in one), dp


def test_the_samples_a_tool_reads_back_are_indices_not_repetitions():
    """``gputrain parity`` compares the samples each mode's first steps trained: with repeats too."""
    from types import SimpleNamespace

    from gputrain.data.samplers import StepBatchSampler
    from gputrain.engine.context import _first_batches

    sampler = StepBatchSampler(10, dp_rank=0, dp_size=1, batch_size=4, repeats=2)
    order = sampler.plan.order
    assert _first_batches(SimpleNamespace(batch_sampler=sampler), 2) == order[:8]  # type: ignore[arg-type]


def test_parity_compares_a_steps_repeated_samples_as_one_process_read_them():
    from gputrain.tools.diagnose.parity_compare import ModeResult

    def rank(samples: list[list[int]]) -> dict:
        return {"samples": samples, "losses": [0.0], "unused": [], "state": {}, "bn": {}}

    single = ModeResult.from_ranks("single", [rank([[3, 5, 3, 5]])])
    ddp = ModeResult.from_ranks("ddp", [rank([[3, 3]]), rank([[5, 5]])], dp=2)
    pipeline = ModeResult.from_ranks("pipeline", [rank([[3, 5, 3, 5]]), rank([[3, 5, 3, 5]])])
    assert single.samples == ddp.samples == pipeline.samples == [[3, 3, 5, 5]]


def test_repeats_train_each_pair_in_a_row_each_augmented_anew():
    plan = EpochPlan(10, seed=0, epoch=0, dp_size=2, batch_size=2, repeats=3)
    order = plan.order  # each pair three times in a row: a b a b a b
    assert len(order) == 10 and order[:6] == order[:2] * 3 and order[0] != order[1] and len(set(order)) == 4
    keys = [key for k in range(plan.num_steps) for micro in plan.micro_keys(k) for share in micro for key in share]
    assert sorted(keys) == sorted((i, order[:p].count(i)) for p, i in enumerate(order))

    class Noise(Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.rand(2)  # a random augmentation

    seeded = SeededSamples(Noise(), seed=0)
    assert torch.equal(seeded[(0, 4, 1)], seeded[(0, 4, 1)])
    assert not torch.equal(seeded[(0, 4, 0)], seeded[(0, 4, 1)])
    assert torch.equal(seeded[(0, 4)], SeededSamples(Noise(), seed=0)[(0, 4)])  # without repeats: keys as before


@pytest.mark.parametrize("overrides, message", [
    (["data.mixup_alpha=-0.1"], "data.mixup_alpha=-0.1 must be in [0, 100]"),
    (["data.cutmix_alpha=0.5", "trainer.batch_size=7"], "mix the samples of each device's batch two by two, and "
                                                         "trainer.batch_size=7 is odd; use an even batch size, e.g. 8"),
    (["data.repeated_augment=0"], "data.repeated_augment=0 must be in [1, 64]"),
    (["trainer.monitor=val_ema/accuracy"], "trainer.monitor=val_ema/accuracy reads the EMA's validation, and "
                                           "trainer.ema_decay=0 keeps no EMA; set trainer.ema_decay"),
])
def test_bad_values_are_one_line(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config("imagefolder-resnet50", overrides)


def test_mixing_on_another_task_is_refused():
    with pytest.raises(ValueError, match="data.mixup_alpha=0.2 applies to classification, and task segmentation"):
        load_config("ade20k-deeplabv3plus", ["data.mixup_alpha=0.2"])
