"""State the loop carries besides :class:`~gputrain.checkpoint.state.TrainState`: the epoch's loss sums, seeding."""

from __future__ import annotations

import random

import torch

from gputrain.dist import comm


def seed_everything(seed: int) -> None:
    """Seed torch and Python; data order does not depend on these (the samplers own it)."""
    torch.manual_seed(seed)
    random.seed(seed)


class LossWindow:
    """The epoch's sample-weighted training loss: a device-side sum since the last flush, and host totals.

    Sums are float64, in which adding float32 losses times sample counts is exact in practice: the totals do
    not depend on where the windows were cut, so a run that stopped mid-epoch (or on its last step), saved
    :meth:`carry` and resumed logs the uninterrupted run's values, in the epoch line, metrics.jsonl and curves.
    """

    def __init__(self, device: torch.device, carried: dict[str, float] | None = None) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.samples = 0
        self.flushed_samples = 0.0
        """Samples (over all ranks) this run trained in the window the last :meth:`flush` closed."""
        carried = carried or {}
        self.epoch_loss_sum = float(carried.get("epoch_loss_sum", 0.0))
        self.epoch_samples = float(carried.get("epoch_samples", 0.0))
        self.carried_samples = self.epoch_samples + float(carried.get("window_samples", 0.0))
        """Samples of this epoch trained before a resume (not by this process: they count for no throughput)."""
        # The all-reduced part of the open window that was trained before the resume, added at its flush.
        self._open_sum = float(carried.get("window_loss_sum", 0.0))
        self._open_samples = float(carried.get("window_samples", 0.0))

    def add(self, loss: torch.Tensor | None, n: int) -> None:
        """Add a micro-batch's mean loss over ``n`` samples; None (no loss on this rank) adds nothing."""
        if loss is None:
            return
        self.loss_sum.add_(loss.detach().to(self.loss_sum.device, torch.float64), alpha=n)
        self.samples += n

    def _reduced(self) -> tuple[float, float]:
        """The open window over all ranks: (loss sum, samples); a collective."""
        both = torch.stack([self.loss_sum, torch.tensor(float(self.samples), dtype=torch.float64,
                                                        device=self.loss_sum.device)])
        total, n = comm.all_reduce(both).tolist()
        return total + self._open_sum, n + self._open_samples

    def flush(self) -> float:
        """All-reduce the window (a collective: every rank calls it at the same step); returns its mean loss."""
        total, n = self._reduced()
        self.flushed_samples = n - self._open_samples  # trained by this run: not the window's part before a resume
        self.epoch_loss_sum += total
        self.epoch_samples += n
        self.loss_sum.zero_()
        self.samples = 0
        self._open_sum = self._open_samples = 0.0
        return total / n if n else float("nan")

    def carry(self) -> dict[str, float]:
        """What a checkpoint keeps of the epoch so far (a collective; the window stays open)."""
        total, n = self._reduced()
        return {"epoch_loss_sum": self.epoch_loss_sum, "epoch_samples": self.epoch_samples,
                "window_loss_sum": total, "window_samples": n}
