"""The Trainer: join the job, build the run once (:mod:`gputrain.engine.setup`), then a small loop of epochs.

The loop never branches on strategy or precision: everything that differs between ways of running sits behind
the strategy and precision plugins; which samples each step trains on is decided by the framework's
:class:`~gputrain.data.samplers.EpochPlan`; checkpoints go through one
:class:`~gputrain.checkpoint.checkpointer.Checkpointer`; hooks see a read-only
:class:`~gputrain.engine.hooks.RunContext`.
"""

from __future__ import annotations

import dataclasses
import difflib
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from gputrain.checkpoint.state import TrainState
from gputrain.config.checks import validate
from gputrain.config.load import to_dict
from gputrain.config.schema import RunConfig, TrainerConfig
from gputrain.dist import DistInfo, init_distributed, restart_attempt
from gputrain.dist.stop import StopRequest
from gputrain.engine import forensics, record, setup
from gputrain.engine.built import BuiltRun
from gputrain.engine.context import build_context
from gputrain.engine.epoch import run_epoch
from gputrain.engine.evaluate import evaluate_batches, evaluate_only
from gputrain.engine.hooks import Hook, RunContext
from gputrain.engine.state import LossWindow, seed_everything
from gputrain.errors import Interrupted, NonFiniteError
from gputrain.strategies import registered
from gputrain.tasks.base import Task


class Trainer(BuiltRun):
    """Train any ``nn.Module`` on any ``Dataset`` with any loss, on 1 process or many.

    >>> Trainer(strategy="ddp", devices=2, precision="bf16-mixed", epochs=3).fit(
    ...     model, train_data, val_data, loss=torch.nn.functional.mse_loss)  # doctest: +SKIP

    Keyword arguments are fields of :class:`~gputrain.config.TrainerConfig`; pass ``cfg`` for a whole
    :class:`~gputrain.config.RunConfig` (optimizer, schedule). With ``devices > 1`` the process must
    have been started by a launcher (``gputrain train``, ``torchrun``, :func:`gputrain.launch`).
    """

    def __init__(self, cfg: RunConfig | None = None, *, hooks: list[Hook] | None = None,
                 resume_command: Callable[[Path], str] | None = None, **trainer: Any) -> None:
        cfg = cfg or RunConfig()
        known = {f.name for f in dataclasses.fields(TrainerConfig)}
        unknown = set(trainer) - known
        if unknown:
            close = {name: difflib.get_close_matches(name, known, n=1) for name in sorted(unknown)}
            hints = [f"{name}: did you mean {near[0]}?" for name, near in close.items() if near]
            raise TypeError(f"unknown Trainer option(s) {sorted(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")
                            + f"; valid: {sorted(known)}")
        self.cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))
        """The run's config; from :meth:`fit` on, with every ``auto`` resolved (what ``config.yaml`` records)."""
        validate(self.cfg)  # the ranges and combinations the CLI checks hold for Python-API configs too
        if self.cfg.trainer.strategy != "auto":
            registered(self.cfg.trainer.strategy)  # Trainer(strategy="ddpp") fails here, naming the valid ones
        self.extra_hooks = hooks or []
        self.resume_command = resume_command
        self.state = TrainState()
        self.loop: setup.Loop | None = None
        """What the run trains with, once :meth:`fit` (or :meth:`validate`) built it."""
        self.resumed = False
        self.hooks: list[Hook] = []
        self.window: LossWindow | None = None
        """The running epoch's loss sums (None between epochs): what a checkpoint carries of a partly trained epoch."""
        self.carried_loss: dict[str, float] | None = None
        """The loss sums of a partly trained epoch, from the checkpoint this run resumed from."""
        self._fresh_out: tuple[Path, bool] | None = None
        self._monitor_checked = False
        self.saved_at = time.monotonic()
        """When this process last handed a checkpoint over (or started): ``trainer.checkpoint_every_n_minutes``."""
        self._first_weights: forensics.StateCopy | None = None
        """A fresh run's starting state on the host, until its first checkpoint: where a replay of a non-finite step
        starts when no checkpoint precedes it (issue 41)."""

    # -- the job and the run folder --------------------------------------------------------------
    def prepare(self, *, for_training: bool = True) -> Path:
        """Join the process group and resolve the run folder (a new dated one by default); returns it.

        ``fit`` does this itself; a caller that must know the folder before it builds its data (a task that writes
        its train/val split into the run) calls it first.
        """
        if getattr(self, "out", None) is not None:
            return self.out
        t = self.cfg.trainer
        if for_training and restart_attempt() > 0 and not t.resume:
            # torchrun restarted the workers after a failure: they run the same command, and must continue from
            # the newest valid checkpoint rather than start over.
            self.cfg = dataclasses.replace(self.cfg, trainer=dataclasses.replace(t, resume="auto"))
        self.dist: DistInfo = init_distributed(t.accelerator, timeout_s=t.timeout_s)
        self.out: Path
        self.out, self._fresh_out = record.open_run_folder(self.cfg, self.dist, for_training=for_training,
                                                           api=self.resume_command is None)  # the CLI gives one
        return self.out

    # -- training ------------------------------------------------------------------------------
    def fit(self, model: nn.Module, train_data: Dataset, val_data: Dataset | None = None, *,
            loss: Any = None, task: Task | None = None) -> dict[str, Any]:
        """Train; returns the summary (also written to ``out/summary.json``)."""
        if task is None:
            self.cfg = record.describe_python_run(self.cfg, model)
        try:
            loop = self._build(model, task or Task(loss), train_data, val_data)
            if self.resumed and self.state.epoch >= loop.cfg.trainer.epochs:
                return record.already_finished(self.out, self.state, loop.cfg.trainer.epochs, self.dist.is_main)
            record.announce(loop, model, self.out)
            with StopRequest(self.dist.world_size) as self.stop:
                try:
                    self._call("before_fit")
                    try:
                        summary = self._fit_epochs(loop)
                    except NonFiniteError as diverged:  # the failing step replayed and explained, on every rank
                        raise forensics.explain(loop, diverged, self.state, out=self.out, initial=self._first_weights,
                                                config=self.config_dict) from None
                except BaseException as err:
                    self._call("on_exception", err)
                    raise
                if self.stop.received and self.dist.is_main:  # after the last step: nothing was left to stop
                    print(f"gputrain: {signal.Signals(self.stop.received).name} came after the last epoch had trained: "
                          f"the run finished and is complete in {self.out}; nothing was lost", flush=True)
                return summary
        except BaseException:
            self.discard_untrained_run()
            raise
        finally:
            if self.loop is not None:
                setup.end_workers(self.loop.train_loader, self.loop.val_loader)
                if self.loop.checkpointer is not None:
                    self.loop.checkpointer.close()

    def _build(self, model: nn.Module, task: Task, train_data: Dataset, val_data: Dataset | None) -> setup.Loop:
        out = self.prepare(for_training=True)
        seed_everything(self.cfg.trainer.seed)
        setup.check_same_length(train_data)
        resume = setup.find_resume(self.cfg, self.dist, out)
        asked = self.cfg.trainer.batch_size
        loop = setup.build_runtime(self.cfg, self.dist, task, model, resume)
        self.cfg, self.loop = loop.cfg, loop
        if resume is not None and loop.cfg.trainer.batch_size != asked and self.dist.is_main:
            print(f"gputrain: {resume['_path']} was trained on {resume.get('world_size')} process(es); batch_size "
                  f"{asked} -> {loop.cfg.trainer.batch_size} per device keeps its global batch "
                  f"{resume['global_batch']}", flush=True)
        setup.build_training(loop, train_data, val_data, out)
        if resume is not None:
            self.state, self.carried_loss = setup.restore_training(loop, resume)
            self.resumed = True
            record.record_membership(loop, out, resume, self.state)
        elif loop.strategy.name != "pipeline":
            self._first_weights = forensics.StateCopy(loop, on_host=True)
        # A run shorter than the limit of skipped steps in a row, whose every step the loss scaler skips, fails too.
        loop.skips.limit = min(loop.skips.limit, max(1, loop.steps_per_epoch * loop.cfg.trainer.epochs
                                                     - self.state.global_step))
        self.config_dict = to_dict(loop.cfg)
        from gputrain.engine.defaults import default_hooks

        self.hooks = default_hooks(loop.cfg) + self.extra_hooks
        self.ctx: RunContext = self._context(loop)
        self.saved_at = time.monotonic()  # the minutes of trainer.checkpoint_every_n_minutes count from here
        return loop

    def _fit_epochs(self, loop: setup.Loop) -> dict[str, Any]:
        t = loop.cfg.trainer
        start = time.perf_counter()
        train_time, train_samples = 0.0, 0.0
        metrics: dict[str, float] = {}
        while self.state.epoch < t.epochs:
            self._call("before_epoch")
            # A resumed epoch continues the loss sums its checkpoint carried, so it logs what an uninterrupted run logs.
            self.window = LossWindow(loop.strategy.root_device, self.carried_loss if self.state.step_in_epoch else None)
            self.carried_loss = None
            metrics = run_epoch(loop, self.state, self.window, self._call, after_step=self._after_step,
                                data_waits=self.ctx.data_waits)
            self.window = None
            train_time += metrics["time/train_s"]
            train_samples += metrics["train/images_per_s"] * metrics["time/train_s"]  # trained by this run
            self.state.epoch += 1
            self.state.step_in_epoch = 0
            if loop.val_loader is not None and self.state.epoch % max(t.eval_every_n_epochs, 1) == 0:
                eval_start = time.perf_counter()
                metrics |= {f"val/{k}": v for k, v in self._evaluate(loop).items()}
                if loop.ema is not None:  # the same exact evaluation, of the EMA's weights and statistics
                    with loop.ema.swapped_in():
                        metrics |= {f"val_ema/{k}": v for k, v in self._evaluate(loop, write=False).items()}
                metrics["time/val_s"] = time.perf_counter() - eval_start
                val_count = len(loop.val_loader.dataset)  # type: ignore[arg-type]  # every sample once (exact eval)
                metrics["time/val_images_per_s"] = val_count / max(metrics["time/val_s"], 1e-9)
                if not self._monitor_checked:  # at the run's first evaluation
                    record.check_monitor(t.monitor, metrics, is_main=self.dist.is_main)
                    self._monitor_checked = True
            metrics["time/epoch_s"] = metrics["time/train_s"] + metrics.get("time/val_s", 0.0)
            self._call("after_epoch", metrics)
            if self._first_weights is not None and forensics.checkpoint_written(loop):
                self._first_weights = None  # a replay starts from the newest whole checkpoint from now on
        summary = record.write_summary(loop, self.out, self.state, metrics, wall_s=time.perf_counter() - start,
                                       train_s=train_time, samples=train_samples)
        self._call("after_fit", summary)
        return summary

    def _after_step(self) -> None:
        """After each step and its hooks: stop on an agreed signal, checkpoint every n steps."""
        assert self.loop is not None
        t, loop = self.cfg.trainer, self.loop
        due = bool(t.checkpoint_every_n_minutes) and time.monotonic() - self.saved_at >= 60 * t.checkpoint_every_n_minutes
        signum = self.stop.agreed(now=self.state.step_in_epoch >= loop.steps_per_epoch, due=due)
        if signum:
            saved = self.save(f"step_{self.state.global_step:06d}", wait=True) if loop.checkpointer else None
            where = f"checkpoint {saved}" if saved else "no checkpoint (trainer.enable_checkpointing=false)"
            message = record.interrupted_line(self.state, where, self._resume_command(), self.cfg.launch)
            if self.dist.is_main:
                print(message, flush=True)
            raise Interrupted(signum, message)
        every_n = t.checkpoint_every_n_steps and self.state.global_step % t.checkpoint_every_n_steps == 0
        if (every_n or self.stop.save_due) and self.state.step_in_epoch < loop.steps_per_epoch:
            self.save(f"step_{self.state.global_step:06d}")  # the epoch's last step has its epoch checkpoint

    def save(self, name: str, metrics: dict[str, float] | None = None, *, wait: bool = False) -> Path | None:
        """Write checkpoint ``name`` (a collective: every rank calls it); None when checkpointing is off."""
        loop = self.loop
        if loop is None or loop.checkpointer is None:
            return None
        window = self.window
        extra = {"state": dataclasses.asdict(self.state), "global_batch": loop.global_batch,
                 "config": self.config_dict,
                 # The epoch's loss sums so far (a collective): a resumed epoch logs the uninterrupted run's loss.
                 "loss_window": window.carry() if window is not None else {}}
        if loop.ema is not None:  # a collective: a full checkpoint gathers the EMA as it gathers the model
            extra["ema"] = loop.ema.checkpoint_entry(sharded=loop.checkpointer.sharded)
        saved = loop.checkpointer.save(loop.parts, extra, self.state, name, metrics, wait=wait)
        self.saved_at = time.monotonic()
        return saved

    def _resume_command(self) -> str:
        if self.resume_command is not None:
            return self.resume_command(self.out)
        return f"Trainer(..., resume='auto', out='{self.out}').fit(...)"

    def discard_untrained_run(self) -> None:
        """After a fresh run failed before its first optimizer step, remove what it wrote (rank 0)."""
        if self._fresh_out is not None and self.state.global_step == 0 and self.dist.is_main:
            record.discard_untrained_run(*self._fresh_out)

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Exact evaluation over the validation set: every sample once, metrics from reduced statistics."""
        loop = self.loop
        assert loop is not None and loop.val_loader is not None, "no validation data was given"
        try:
            return self._evaluate(loop)
        finally:
            setup.end_workers(loop.val_loader)  # fit keeps them between epochs; a call of the user's does not

    def _evaluate(self, loop: setup.Loop, *, write: bool = True) -> dict[str, float]:
        loop.strategy.prepare_eval(loop.module)
        metrics = evaluate_batches(loop, self.out if write else None, self.state.epoch,
                                   lambda done, total: self._call("after_eval_batch", done, total))
        loop.module.train()
        return metrics

    def validate(self, model: nn.Module, val_data: Dataset, *, task: Task) -> dict[str, float]:
        """Evaluate ``model`` alone (no training) on any device count; writes ``out/eval.json`` on rank 0."""
        from gputrain.engine.callbacks.progress import ProgressHook

        out = self.prepare(for_training=False)
        loop = setup.build_runtime(self.cfg, self.dist, task, model)
        self.cfg, self.loop = loop.cfg, loop
        loop.module = loop.strategy.setup_module(loop.module)
        loop.val_loader = setup.eval_loader(loop, val_data)
        self.hooks = [ProgressHook(bar=False), *self.extra_hooks]
        self.config_dict = to_dict(loop.cfg)
        self.ctx = self._context(loop)
        try:
            return evaluate_only(loop, out, lambda done, total: self._call("after_eval_batch", done, total))
        finally:
            setup.end_workers(loop.val_loader)

    def model_state_dict(self) -> dict[str, Any]:
        """The trained model's full weights with plain keys (rank 0; ``{}`` elsewhere where sharded); a collective."""
        assert self.loop is not None, "fit first"
        return self.loop.strategy.model_state_dict(self.loop.module)

    def _context(self, loop: setup.Loop) -> RunContext:
        return build_context(loop, config_dict=self.config_dict, out=self.out, resumed=self.resumed,
                             progress=lambda: self.state, save=lambda name, metrics: self.save(name, metrics),
                             saved_at=lambda: self.saved_at)

    def _call(self, event: str, *args: Any) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self.ctx, *args)
