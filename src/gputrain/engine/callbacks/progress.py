"""Console progress on rank 0 only: a tqdm bar and an epoch summary line."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from gputrain.engine.hooks import Hook, RunContext


class ProgressHook(Hook):
    """A bar per epoch (when ``bar``) and one summary line per epoch, on rank 0."""

    def __init__(self, bar: bool = True, eval_every_s: float = 10.0) -> None:
        self.show_bar = bar
        self.bar: tqdm | None = None
        self.eval_every_s = eval_every_s
        self._eval_last = 0.0

    def after_eval_batch(self, ctx: RunContext, done: int, total: int) -> None:
        # A long evaluation (COCO on a CPU) otherwise looks like a hang: a line every few seconds.
        if not ctx.dist.is_main:
            return
        now = time.monotonic()
        if done == 1:
            self._eval_last = now
        elif now - self._eval_last >= self.eval_every_s:
            self._eval_last = now
            tqdm.write(f"evaluating: {done}/{total} batches on rank 0")

    def before_epoch(self, ctx: RunContext) -> None:
        if ctx.dist.is_main and self.show_bar:
            self.bar = tqdm(
                total=ctx.steps_per_epoch, desc=f"epoch {ctx.state.epoch + 1}/{ctx.cfg.trainer.epochs}",
                leave=False, mininterval=1.0, dynamic_ncols=True, disable=None,  # None: off when not a TTY
            )

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if logs and "train/loss" in logs:
                since = ctx.seconds_since_checkpoint  # what a node lost now would cost (trainer.checkpoint_every_*)
                saved = {} if since is None else {"saved": f"{since / 60:.0f}m ago" if since >= 60 else f"{since:.0f}s ago"}
                self.bar.set_postfix(loss=f"{logs['train/loss']:.4g}", **saved, refresh=False)

    def after_epoch(self, ctx: RunContext, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if ctx.dist.is_main:
            shown = {k: v for k, v in metrics.items() if k.startswith(("train/loss", "val/", "val_ema/"))}
            text = "  ".join(f"{k}={v:.4g}" for k, v in shown.items())
            tqdm.write(f"epoch {ctx.state.epoch}: {text}  ({metrics.get('time/epoch_s', 0):.1f} s)")

    def on_exception(self, ctx: RunContext, error: BaseException) -> None:
        if self.bar is not None:
            self.bar.close()
