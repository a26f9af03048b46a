"""Issue 15's planted faults that only slow tests (or nothing) caught, each now failing a fast test: the
segmentation validation loss over labelled pixels, linear lr scaling from the global batch, and augmentation that
changes from epoch to epoch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gputrain.config import OptimConfig
from tiny_fit import _fit


# -- issue 15's planted faults that only slow tests (or nothing) caught ---------------------------------
def test_segmentation_validation_loss_is_the_mean_over_labelled_pixels():
    """Fault: each batch's loss weighted by all its pixels, void ones included."""
    from gputrain.metrics.segmentation import SegmentationEvaluator

    g = torch.Generator().manual_seed(3)
    logits, targets = torch.randn(5, 4, 6, 6, generator=g), torch.randint(0, 4, (5, 6, 6), generator=g)
    for image, void_rows in enumerate((0, 1, 3, 5, 2)):  # a different number of void pixels in each image
        targets[image, :void_rows] = 255
    evaluator = SegmentationEvaluator(4)
    for batch in ([0, 1], [2, 3], [4]):
        evaluator.update(logits[batch], targets[batch], F.cross_entropy(logits[batch], targets[batch],
                                                                        ignore_index=255), len(batch))
    metrics = evaluator.compute(torch.device("cpu"))
    exact = F.cross_entropy(logits.double(), targets, ignore_index=255)  # one mean over every labelled pixel
    assert metrics["pixels"] == 5 * 36 - 6 * (0 + 1 + 3 + 5 + 2)
    assert metrics["loss"] == pytest.approx(float(exact), rel=1e-6)


def test_linear_lr_scaling_uses_the_global_batch_with_accumulation(tmp_path):
    """Fault: lr scaled from the per-device batch (8) instead of the global batch (8 x accumulation 2)."""
    optim = OptimConfig(name="sgd", lr=0.01, momentum=0.9, scale_lr="linear", reference_batch=8)
    t = _fit(tmp_path, optim=optim, epochs=1, n=32, accumulate_grad_batches=2)
    assert t.global_batch == 16
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.02)


def test_augmentation_changes_from_epoch_to_epoch_and_repeats_within_one():
    """Fault: the augmentation seed ignores the epoch (every epoch the same random crop/flip)."""
    from torch.utils.data import Dataset

    from gputrain.data.samplers import SeededSamples

    class RandomAugment(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(3)  # stands for a random transform: it draws from torch's generator

    samples = SeededSamples(RandomAugment(), seed=0)
    assert torch.equal(samples[(0, 2)], samples[(0, 2)])  # the same sample in the same epoch: the same draw
    assert not torch.equal(samples[(0, 2)], samples[(1, 2)])  # the next epoch draws anew
    assert not torch.equal(samples[(0, 2)], samples[(0, 3)])
