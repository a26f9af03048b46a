"""State the loop carries besides :class:`~gputrain.checkpoint.state.TrainState`: the epoch's loss sums, seeding."""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING

import torch

from gputrain.dist import comm

if TYPE_CHECKING:
    from gputrain.checkpoint.state import TrainState
    from gputrain.precision import Precision


def seed_everything(seed: int) -> None:
    """Seed torch and Python; data order does not depend on these (the samplers own it)."""
    torch.manual_seed(seed)
    random.seed(seed)


class LossWindow:
    """The epoch's sample-weighted training loss: a device-side sum since the last flush, and host totals.

    Sums are float64, in which adding float32 losses times sample counts is exact in practice: the totals do
    not depend on where the windows were cut, so a run that stopped mid-epoch (or on its last step), saved
    :meth:`carry` and resumed logs the uninterrupted run's values, in the epoch line, metrics.jsonl and curves.

    A step the loss scaler skipped (16-mixed: its gradients overflowed) trained nothing: :meth:`end_step` leaves its
    losses out of the sum, and its samples count as trained (throughput, ``train/samples``) but not in the
    loss's mean. So one overflowed forward (an inf loss) neither ends the run nor turns the logged loss into inf.
    """

    def __init__(self, device: torch.device, carried: dict[str, float] | None = None) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.samples = 0
        self.skipped = 0
        """Samples of the open window in steps the loss scaler skipped (their losses are not in ``loss_sum``)."""
        # The open step's losses, kept apart until the step ends: an inf loss of a skipped step never enters the sum.
        self._step_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._step_samples = 0
        self.flushed_samples = 0.0
        """Samples (over all ranks) this run trained in the window the last :meth:`flush` closed."""
        self.flushed_counted = 0.0
        """Samples of the last flushed window's steps that trained (the resumed part included): its loss's weight."""
        carried = carried or {}
        self.epoch_loss_sum = float(carried.get("epoch_loss_sum", 0.0))
        self.epoch_samples = float(carried.get("epoch_samples", 0.0))
        self.epoch_skipped = float(carried.get("epoch_skipped", 0.0))
        self.carried_samples = self.epoch_samples + float(carried.get("window_samples", 0.0))
        """Samples of this epoch trained before a resume (not by this process: they count for no throughput)."""
        # The all-reduced part of the open window that was trained before the resume, added at its flush.
        self._open = (float(carried.get("window_loss_sum", 0.0)), float(carried.get("window_samples", 0.0)),
                      float(carried.get("window_skipped", 0.0)))
        self.skipped_steps = int(carried.get("window_skipped_steps", 0))
        """Steps of the open window the loss scaler skipped (every rank skips the same ones: not reduced)."""
        self.flushed_skipped_steps = 0

    def add(self, loss: torch.Tensor | None, n: int) -> None:
        """Add a micro-batch's mean loss over ``n`` samples; None (no loss on this rank) adds nothing."""
        if loss is None:
            return
        self._step_sum.add_(loss.detach().to(self._step_sum.device, torch.float64), alpha=n)
        self._step_samples += n

    def step_loss_finite(self) -> bool:
        """Whether the open step's losses are finite on every rank: a collective, asked only of a step the loss
        scaler skipped (every rank skips the same steps), and a host sync."""
        bad = (~torch.isfinite(self._step_sum)).to(torch.float64).reshape(1)
        return not bool(comm.all_reduce(bad, "max").item())

    def end_step(self, *, stepped: bool) -> None:
        """Close an optimizer step: its losses join the window, unless the loss scaler skipped it (no host sync)."""
        if stepped:
            self.loss_sum.add_(self._step_sum)
        else:
            self.skipped += self._step_samples
            self.skipped_steps += 1
        self.samples += self._step_samples
        self._step_sum.zero_()
        self._step_samples = 0

    def _reduced(self) -> tuple[float, float, float]:
        """The open window over all ranks: (loss sum, samples, skipped samples); a collective."""
        counts = torch.tensor([float(self.samples), float(self.skipped)], dtype=torch.float64,
                              device=self.loss_sum.device)
        total, n, skipped = comm.all_reduce(torch.cat([self.loss_sum.view(1), counts])).tolist()
        return total + self._open[0], n + self._open[1], skipped + self._open[2]

    def flush(self) -> float:
        """All-reduce the window (a collective: every rank calls it at the same step); returns its mean loss.

        The mean is over the samples of the steps that trained: NaN when the loss scaler skipped every step.
        """
        total, n, skipped = self._reduced()
        self.flushed_samples = n - self._open[1]  # trained by this run: not the window's part before a resume
        self.flushed_counted = n - skipped
        self.flushed_skipped_steps, self.skipped_steps = self.skipped_steps, 0
        self.epoch_loss_sum += total
        self.epoch_samples += n
        self.epoch_skipped += skipped
        self.loss_sum.zero_()
        self.samples = self.skipped = 0
        self._open = (0.0, 0.0, 0.0)
        return total / (n - skipped) if n > skipped else float("nan")

    @property
    def epoch_loss(self) -> float:
        """The epoch's mean loss so far, over the samples of the steps that trained (NaN if none did)."""
        counted = self.epoch_samples - self.epoch_skipped
        return self.epoch_loss_sum / counted if counted > 0 else (0.0 if not self.epoch_samples else float("nan"))

    def carry(self) -> dict[str, float]:
        """What a checkpoint keeps of the epoch so far (a collective; the window stays open)."""
        total, n, skipped = self._reduced()
        return {"epoch_loss_sum": self.epoch_loss_sum, "epoch_samples": self.epoch_samples,
                "epoch_skipped": self.epoch_skipped, "window_loss_sum": total, "window_samples": n,
                "window_skipped": skipped, "window_skipped_steps": float(self.skipped_steps)}


class SkippedSteps:
    """Steps the loss scaler skipped (16-mixed: inf/NaN gradients), told apart from a run that diverged.

    A skipped step is how float16 training normally recovers from an overflow: the scaler keeps the weights and
    halves its scale. A forward that overflowed float16 (the loss itself inf/NaN) is skipped the same way, so it
    does not end the run; the first one is reported in one warning line. Only when the scaler skips
    :data:`LIMIT` steps in a row does the run end (the caller raises what :meth:`count` returns), saying which
    overflowed: the forward (the loss) or only the gradients. Every rank skips the same steps (the scaler's verdict
    covers all ranks' gradients) and reads the same overflow flag, so every rank raises at the same step with the
    same line. The count starts again after a resume.
    """

    LIMIT = 25
    """Consecutive skipped steps that end a run: the scale has then fallen by 2**25 (65,536 -> about 0.002)."""

    def __init__(self, is_main: bool, precision: Precision) -> None:
        self.is_main, self.precision = is_main, precision
        self.limit = self.LIMIT
        """:data:`LIMIT`, or the run's steps when it has fewer: a run whose every step overflowed in the forward
        trained nothing."""
        self.in_a_row = 0
        self.loss_overflows_in_a_row = 0
        self.warned = False

    def count(self, stepped: bool, window: LossWindow, state: TrainState) -> tuple[str, str] | None:
        """Record one optimizer step, before ``window.end_step``; at the limit, what to raise: (what, fix)."""
        if stepped:
            self.in_a_row = self.loss_overflows_in_a_row = 0
            return None
        self.in_a_row += 1
        loss_overflowed = not window.step_loss_finite()
        self.loss_overflows_in_a_row += loss_overflowed
        if loss_overflowed and not self.warned:
            self.warned = True
            if self.is_main:
                print(f"gputrain: warning: the loss overflowed float16 at epoch {state.epoch + 1} step "
                      f"{state.global_step} (trainer.precision=16-mixed); the loss scaler skipped that step, which is "
                      "left out of the logged loss (train/skipped_steps counts the skipped steps)", file=sys.stderr,
                      flush=True)
        # A short run whose every step overflowed in the forward trained nothing; skips whose loss was finite are the
        # scaler finding its scale (the first steps of any 16-mixed run), which only LIMIT of in a row ends.
        if self.in_a_row < self.LIMIT and self.loss_overflows_in_a_row < self.limit:
            return None
        scale = self.precision.log_values().get("train/loss_scale", float("nan"))
        cause = (f"the loss itself was inf/NaN in {self.loss_overflows_in_a_row} of them, so float16 overflows in the "
                 "forward: use trainer.precision=bf16-mixed on a GPU that has bfloat16, or 32"
                 if self.loss_overflows_in_a_row else
                 "the loss was finite in each, so the backward makes NaN/inf gradients at any scale: lower optim.lr "
                 "or set trainer.grad_clip_norm, and compare with trainer.precision=32")
        return (f"the gradients of {self.in_a_row} steps in a row (trainer.precision=16-mixed)",
                f"the loss scaler skipped each and lowered its scale to {scale:.3g}; {cause}")
