"""Console progress on rank 0 only: a tqdm bar (a plain line a minute where the output is no terminal: a log, a
pipe, a batch job) and an epoch summary line."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from gputrain.engine.hooks import Hook, RunContext


class ProgressHook(Hook):
    """A bar per epoch (when ``bar``) and one summary line per epoch, on rank 0."""

    LINE_EVERY_S = 60.0
    """Off a terminal tqdm hides the bar; a long epoch would say nothing until its end: a line this often instead."""

    def __init__(self, bar: bool = True, eval_every_s: float = 10.0) -> None:
        self.show_bar = bar
        self.bar: tqdm | None = None
        self.eval_every_s = eval_every_s
        self._eval_last = 0.0
        self._epoch_start = self._line_last = 0.0
        self._loss: float | None = None
        self._steps = 0  # a disabled tqdm bar counts nothing

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
            self._epoch_start = self._line_last = time.monotonic()
            self._loss, self._steps = None, 0

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self._steps += 1
            since = ctx.seconds_since_checkpoint  # what a node lost now would cost (trainer.checkpoint_every_*)
            saved = {} if since is None else {"saved": f"{since / 60:.0f}m ago" if since >= 60 else f"{since:.0f}s ago"}
            if logs and "train/loss" in logs:
                self._loss = logs["train/loss"]
                self.bar.set_postfix(loss=f"{self._loss:.4g}", **saved, refresh=False)
            if self.bar.disable:
                self._plain_line(ctx, saved)

    def _plain_line(self, ctx: RunContext, saved: dict[str, str]) -> None:
        now = time.monotonic()
        if now - self._line_last < self.LINE_EVERY_S:
            return
        self._line_last = now
        done, total = self._steps, ctx.steps_per_epoch
        rate = done / max(now - self._epoch_start, 1e-9)
        parts = [f"step {done}/{total}", f"{rate:.3g} steps/s"]
        if rate > 0 and total > done:
            parts.append(f"about {(total - done) / rate:.0f} s left")
        if self._loss is not None:
            parts.append(f"loss {self._loss:.4g}")
        if saved:
            parts.append(f"saved {saved['saved']}")
        print(f"epoch {ctx.state.epoch + 1}/{ctx.cfg.trainer.epochs}: " + ", ".join(parts), flush=True)

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
