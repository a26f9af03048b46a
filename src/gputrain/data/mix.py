"""MixUp and CutMix that train the same model on any number of processes: pairs and draws fixed by the global step.

torchvision's reference mixes each GPU's batch with itself rolled by one, one draw per batch (``v2.MixUp`` and
``v2.CutMix`` in its collate), so which images are mixed, and how, depends on how many GPUs share the global batch.
Here the epoch plan deals the global batch in pairs of consecutive samples, each pair to one rank (:class:`EpochPlan`
with ``unit=2``); the two images of a pair are mixed with each other. The choice between MixUp and CutMix, the
mixing ratio and CutMix's box are drawn once per global step, from ``(seed, epoch, step)``: every pair of the step
shares them, on whichever rank it lies. A trailing sample without a partner (an odd step) is left as it is.

The draws and the pixels are torchvision's own: the pairs are laid out as one batch of two images whose channels
are the pairs' channels side by side (``(2, pairs x C, H, W)``), so one call of ``v2.MixUp``/``v2.CutMix`` mixes
every pair with one ratio and one box. Given the labels ``[0, 1]`` of 2 classes, the same call returns the ratio it
applied (CutMix's adjusted to its clipped box), with which each pair's one-hot labels are mixed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from gputrain.config.schema import RunConfig


class PairMixer:
    """Mixes a rank's training batch pair by pair, as the global step's draw says (``data.mixup_alpha``,
    ``data.cutmix_alpha``); the labels become class probabilities, which ``cross_entropy`` takes."""

    def __init__(self, *, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int) -> None:
        from torchvision.transforms import (
            v2,  # here: importing torchvision costs a process about 1.8 s of CPU
        )

        choices: list[v2.Transform] = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=2))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=2))
        if not choices:
            raise ValueError("PairMixer needs data.mixup_alpha or data.cutmix_alpha above 0")
        self.transform = choices[0] if len(choices) == 1 else v2.RandomChoice(choices)
        self.num_classes, self.seed = num_classes, seed

    @classmethod
    def for_run(cls, cfg: RunConfig, *, num_classes: int, global_batch: int) -> PairMixer | None:
        """The run's mixer (None when both alphas are 0), checked against what it mixes: class labels (a task with
        ``num_classes``), two by two in each device's batch."""
        d, t = cfg.data, cfg.trainer
        if not (d.mixup_alpha or d.cutmix_alpha):
            return None
        if not num_classes:
            raise ValueError("data.mixup_alpha/cutmix_alpha mix class labels, and this run's task has no num_classes; "
                             "use task classification (or a Task with num_classes), or drop them")
        if t.batch_size % 2:  # a resume on another world size can make the per-device batch odd
            raise ValueError(f"data.mixup_alpha/cutmix_alpha mix each device's batch two by two, and this run's batch "
                             f"is {t.batch_size} per device (global batch {global_batch}); run on a number of devices "
                             "that gives an even per-device batch")
        return cls(mixup_alpha=d.mixup_alpha, cutmix_alpha=d.cutmix_alpha, num_classes=num_classes, seed=t.seed)

    def __call__(self, images: Tensor, labels: Tensor, *, epoch: int, step: int) -> tuple[Tensor, Tensor]:
        """``images`` ``(B, C, H, W)`` float and ``labels`` ``(B,)`` class ids, pairs consecutive: the mixed images
        and ``(B, num_classes)`` probabilities."""
        soft = F.one_hot(labels.long(), self.num_classes).to(images.dtype)
        paired = images.shape[0] // 2 * 2
        if paired == 0:
            return images, soft
        lam, mixed = self._mix(images[:paired], epoch, step)
        a, b = soft[:paired:2], soft[1:paired:2]
        pairs = torch.stack([lam * a + (1 - lam) * b, lam * b + (1 - lam) * a], dim=1).flatten(0, 1)
        return torch.cat([mixed, images[paired:]]), torch.cat([pairs, soft[paired:]])

    def _mix(self, images: Tensor, epoch: int, step: int) -> tuple[float, Tensor]:
        """One draw from ``(seed, epoch, step)`` applied to every pair: the ratio of each image's own pixels, and
        the mixed images in their order."""
        n, c, h, w = images.shape
        side_by_side = images.reshape(n // 2, 2, c, h, w).transpose(0, 1).reshape(2, n // 2 * c, h, w)
        saved = torch.get_rng_state()  # the CPU generator: what torchvision draws from, restored after
        torch.default_generator.manual_seed(((self.seed * 1_000_003 + epoch) * 2_147_483_647 + step) % 2**63)
        try:
            out, ratio = self.transform(side_by_side, torch.tensor([0, 1], device=images.device))
        finally:
            torch.set_rng_state(saved)
        mixed = out.reshape(2, n // 2, c, h, w).transpose(0, 1).reshape(n, c, h, w)
        return float(ratio[0, 0]), mixed
