"""Hooks: what happens around the loop (checkpoints, logging, progress) without living in it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gputrain.loop import Trainer


class Hook:
    """Override what you need. Every rank calls every method; rank-0-only work checks ``trainer.dist.is_main``."""

    def before_fit(self, trainer: Trainer) -> None: ...

    def before_epoch(self, trainer: Trainer) -> None: ...

    def before_optimizer_step(self, trainer: Trainer) -> None:
        """After the step's backward passes, before clipping and the optimizer: gradients are readable."""

    def after_step(self, trainer: Trainer, logs: dict[str, float] | None) -> None:
        """After each optimizer step; ``logs`` holds rank-reduced metrics on logging steps, else None."""

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After training and evaluation of an epoch; ``metrics`` are reduced over ranks."""

    def after_eval_batch(self, trainer: Trainer, done: int, total: int) -> None:
        """After each validation batch of this rank (``done`` of its ``total``)."""

    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...

    def on_exception(self, trainer: Trainer, error: BaseException) -> None: ...
