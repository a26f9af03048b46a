"""The training loop: small, with hooks, and blind to strategy and precision.

``Trainer.fit`` sets up (process group, strategy, precision, model, data, optimizer), then
runs epochs of :meth:`Trainer.train_epoch` and :meth:`Trainer.evaluate`. Everything that
differs between ways of running sits behind ``self.strategy`` and ``self.precision``; which
samples each step trains on is decided by the framework's :class:`~gputrain.data.samplers.EpochPlan`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gputrain.config import RunConfig, TrainerConfig, to_dict, to_yaml
from gputrain.config import validate as check_config
from gputrain.data.samplers import SeededSamples, StepBatchSampler
from gputrain.dist import DistInfo, init_distributed, restart_attempt
from gputrain.errors import Interrupted
from gputrain.fast_path import FastPath, resolve_precision, with_resolved, writer_process_pays
from gputrain.hooks.base import Hook
from gputrain.loop_state import TrainState, seed_everything
from gputrain.optim import build_scheduler
from gputrain.precision import build_precision
from gputrain.resume import (
    apply_resume_state,
    load_resume_state,
    resumed_batch_size,
    resumed_line,
    save_checkpoint,
)
from gputrain.run_record import (
    already_finished,
    describe_python_run,
    discard_untrained_run,
    training_options,
    write_summary,
)
from gputrain.signals import StopRequest
from gputrain.strategies import Strategy, build_strategy
from gputrain.tasks.base import Task
from gputrain.train_step import evaluate_batches, run_epoch

CONFIG_HEADER = ("# The resolved config of the run in this folder (every `auto` as it was decided). Train it again\n"
                 "# with `gputrain train RUN/config.yaml`: a new run folder, or --out DIR.\n")


class Trainer:
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
            raise TypeError(f"unknown Trainer option(s) {sorted(unknown)}; valid: {sorted(known)}")
        self.cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))
        check_config(self.cfg)  # the ranges the CLI checks hold for Python-API configs too: one ValueError line
        self.extra_hooks = hooks or []
        self.resume_command = resume_command
        self.state = TrainState()
        self.resumed = False
        self.checkpoints: Any = None
        """The run's :class:`~gputrain.checkpoint.CheckpointStore`; None when checkpointing is off."""
        self.checkpoint_writer: Any = None
        """Writes into ``checkpoints`` (:class:`~gputrain.checkpoint_writer.CheckpointWriter`); None when off."""
        self.hooks: list[Hook] = []
        self.loss_window: Any = None
        """The running epoch's :class:`~gputrain.loop_state.LossWindow` (None between epochs)."""
        self.carried_loss: dict[str, float] | None = None
        """The loss sums of a partly trained epoch, from the checkpoint this run resumed from."""
        self.first_step_s: float | None = None
        """Seconds of this process's first optimizer step (compilation included when ``trainer.compile``)."""

    # -- setup ---------------------------------------------------------------------------
    def prepare(self, *, for_training: bool = True) -> Path:
        """Join the process group, build strategy and precision, and resolve the run folder; returns it.

        ``fit`` does this itself; a caller that must know the folder before it builds its data (a task
        that writes its train/val split into the run) calls it first.
        """
        if getattr(self, "_prepared", False):
            return self.out
        self._prepared = True
        self._setup_runtime(for_training=for_training)
        return self.out

    def _setup_runtime(self, *, for_training: bool) -> None:
        """Process group, strategy, precision and run folder: what training and evaluation share."""
        t = self.cfg.trainer
        if for_training and restart_attempt() > 0 and not t.resume:
            # torchrun restarted the workers after a failure: they run the same command, and must
            # continue from the newest valid checkpoint rather than start over.
            self.cfg = dataclasses.replace(self.cfg, trainer=dataclasses.replace(t, resume="auto"))
            t = self.cfg.trainer
        self.dist: DistInfo = init_distributed(t.accelerator, timeout_s=t.timeout_s)
        precision = resolve_precision(t.precision, self.dist.device)
        if precision != t.precision:  # auto, resolved once: config.yaml and checkpoints say what ran
            self.cfg = dataclasses.replace(self.cfg, trainer=dataclasses.replace(t, precision=precision))
            t = self.cfg.trainer
        self.strategy: Strategy = build_strategy(self.cfg, self.dist)
        expected = self.strategy.processes_per_node(t.devices) * self.cfg.launch.nnodes
        if expected > 1 and self.dist.world_size == 1:
            raise ValueError(
                f"trainer.devices={t.devices} needs {expected} processes but this one was started alone; start it "
                f"with `gputrain train ... --devices {t.devices}`, `torchrun --nproc-per-node {t.devices} script.py` "
                f"or gputrain.launch(fn, devices={t.devices})"
            )
        self.precision = build_precision(t.precision, self.dist.device)
        if self.cfg.data.num_workers == "auto":  # resolved once, so config.yaml and every tool see the count
            from gputrain.data.workers import resolve_num_workers, usable_cores

            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world_size))
            workers = resolve_num_workers("auto", cores=usable_cores(), local_processes=local)
            self.cfg = dataclasses.replace(self.cfg, data=dataclasses.replace(self.cfg.data, num_workers=workers))
        self.out = self._run_folder(for_training)

    def _run_folder(self, for_training: bool) -> Path:
        """Rank 0 resolves and checks the run folder (a new dated one by default); every rank gets its path."""
        from gputrain import run_folder

        t = self.cfg.trainer
        chosen = ""
        if self.dist.is_main:
            out = Path(t.out) if t.out else run_folder.default_run_dir(Path(str(self.cfg.task)).name.split(":")[-1])
            if for_training:
                run_folder.check_run_folder(out, resume=t.resume, overwrite=t.overwrite)
                # A fresh run that fails before its first step leaves nothing behind (discard_untrained_run).
                self._fresh_out = None if t.resume else (out, out.exists())
                if t.overwrite:
                    run_folder.clear_run_folder(out)
                run_folder.mark_run_folder(out)  # ours: a later --overwrite may clear what gputrain wrote here
                if not t.out:
                    run_folder.point_latest(out)
            chosen = str(out)
        return Path(self.strategy.broadcast_object(chosen))

    def _loader(self, data: Dataset, *, train: bool) -> DataLoader:
        t, workers = self.cfg.trainer, int(self.cfg.data.num_workers)  # "auto" was resolved at setup
        synthetic = train and self.cfg.data.synthetic
        workers = 0 if synthetic else workers  # device-resident samples: collated where they are, no workers
        # A generator of the loader's own: starting an epoch's iterator draws a worker seed from it, which
        # from the global generator would shift dropout's stream and break a mid-epoch resume.
        common: dict[str, Any] = dict(collate_fn=self.task.collate_fn(), num_workers=workers,
                                      pin_memory=self.dist.device.type == "cuda" and not synthetic,
                                      persistent_workers=workers > 0,
                                      generator=torch.Generator().manual_seed(t.seed))
        if not train:
            return DataLoader(data, batch_size=t.eval_batch_size or t.batch_size,
                              sampler=self.strategy.eval_sampler(len(data)), **common)  # type: ignore[arg-type]
        self.batch_sampler = StepBatchSampler(
            len(data), dp_rank=self.strategy.dp_rank, dp_size=self.strategy.dp_size,  # type: ignore[arg-type]
            batch_size=t.batch_size, accumulate=t.accumulate_grad_batches, seed=t.seed, drop_last=t.drop_last)
        if synthetic:
            from gputrain.data.synthetic import DeviceResidentSamples

            data = DeviceResidentSamples(data, self.dist.device)
        return DataLoader(SeededSamples(data, t.seed), batch_sampler=self.batch_sampler, **common)

    def _check_same_length(self, train_data: Dataset) -> None:
        """Every rank must plan the same steps: fail fast, with the counts, if datasets differ by rank."""
        lengths = self.strategy.all_gather_objects(len(train_data))  # type: ignore[arg-type]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"the training set has a different length on each rank ({dict(enumerate(lengths))}); every rank "
                "must read the same dataset (the framework shards it), e.g. the same data.root on shared storage"
            )

    def _setup(self, model: nn.Module, task: Task, train_data: Dataset, val_data: Dataset | None) -> None:
        self.prepare(for_training=True)
        self.task = task
        model = self._fast_path(model, task)
        t = self.cfg.trainer  # after the runtime: an elastic restart turns resume on
        seed_everything(t.seed)
        self._check_same_length(train_data)
        resume_state = load_resume_state(self, t.resume) if t.resume else None
        if resume_state is not None:
            batch = resumed_batch_size(resume_state.get("global_batch", 0) or self.planned_global_batch,
                                       self.strategy.dp_size, t.accumulate_grad_batches, t.batch_size,
                                       resume_state["_path"])
            if batch != t.batch_size and self.dist.is_main:
                print(f"gputrain: {resume_state['_path']} was trained on {resume_state.get('world_size')} "
                      f"process(es); batch_size {t.batch_size} -> {batch} per device keeps its global batch "
                      f"{resume_state['global_batch']}", flush=True)
            self.cfg = dataclasses.replace(self.cfg, trainer=dataclasses.replace(t, batch_size=batch))
            t = self.cfg.trainer
        if t.sync_batchnorm and self.dist.world_size > 1:
            from gputrain.nn.sync_batchnorm import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, self.dist.device.type)
        self.strategy.check_batch(t.batch_size, model)
        sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
        self.frozen_share = sum(n for n, trains in sizes if not trains) / max(sum(n for n, _ in sizes), 1)
        self.module = self.strategy.setup_module(model)
        if self.fast.compile_mode:
            self.strategy.compile_module(self.module, self.fast.compile_mode)
        self.optimizer = self.strategy.setup_optimizer(self.module, self._scaled_optim())
        # Weights were initialised from the shared seed; from here on (dropout) each rank draws its own
        # stream. Augmentation does not use it: SeededSamples seeds each sample from (seed, epoch, index).
        seed_everything(t.seed + 100_003 * self.dist.rank)
        self.train_loader = self._loader(train_data, train=True)
        self.val_loader = None if val_data is None else self._loader(val_data, train=False)
        self.steps_per_epoch = self.batch_sampler.plan.num_steps
        if t.max_steps_per_epoch:
            self.steps_per_epoch = min(self.steps_per_epoch, t.max_steps_per_epoch)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.scheduler, total_steps=self.steps_per_epoch * t.epochs,
                                         steps_per_epoch=self.steps_per_epoch)
        if t.enable_checkpointing:
            from gputrain.checkpoint import CheckpointStore, remove_stale_temporaries

            every = t.checkpoint_every_n_steps
            epochs_left = t.epochs - (resume_state["state"].get("epoch", 0) if resume_state is not None else 0)
            if self._writer_process_auto:
                self._writer_process_if_it_pays(epochs_left * (1 + ((self.steps_per_epoch - 1) // every if every else 0)))

            self.checkpoints = CheckpointStore(self.out / "checkpoints", keep_last=t.keep_last, monitor=t.monitor,
                                               monitor_mode=t.monitor_mode, recycle=True)
            if self.dist.is_main:
                remove_stale_temporaries(self.out / "checkpoints")
            from gputrain.checkpoint_writer import CheckpointWriter

            # DCP writes a sharded checkpoint collectively in save_checkpoint; its small file stays in step.
            self.checkpoint_writer = CheckpointWriter(
                self.checkpoints, asynchronous=t.async_checkpoint and not self.cfg.parallel.sharded_checkpoint,
                process=self.fast.checkpoint_process)
        self.hooks = default_hooks(self.cfg) + self.extra_hooks
        if resume_state is not None:
            apply_resume_state(self, resume_state)
            self.resumed = True
            if self.dist.is_main and self.state.epoch < t.epochs:
                print(resumed_line(resume_state["_path"], self.state), flush=True)
        self.config_dict = to_dict(self.cfg)

    def _fast_path(self, model: nn.Module, task: Task) -> nn.Module:
        """Resolve the speed options for this device and task (docs/performance.md); the model in its memory format."""
        from gputrain import fast_path

        # auto alone leaves a run of few saves to the thread (decided in _setup, once the steps per epoch are known)
        self._writer_process_auto = self.cfg.trainer.checkpoint_process == "auto"
        self.fast: FastPath = fast_path.resolve(self.cfg, self.dist.device, fixed_shapes=task.fixed_shapes,
                                                normalize_on_device=getattr(task, "normalizes_on_device", False))
        self.cfg = fast_path.with_resolved(self.cfg, self.fast)
        self.fast.apply_backend_flags()
        return self.fast.prepare_model(model)

    def _writer_process_if_it_pays(self, planned_saves: int) -> None:
        """With ``checkpoint_process=auto``, the writer process off for a run of few saves
        (:data:`~gputrain.fast_path.WRITER_PROCESS_MIN_SAVES`); config.yaml, summary.json and the start-up line say so."""
        fast = writer_process_pays(self.fast, planned_saves)
        if fast != self.fast:
            self.fast, self.cfg = fast, with_resolved(self.cfg, fast)

    @property
    def target_device(self) -> Any:
        """Where targets go: the input device when the model consumes them, else where outputs land."""
        return self.strategy.root_device if self.task.targets_to_model else self.strategy.output_device

    @property
    def planned_global_batch(self) -> int:
        t = self.cfg.trainer
        return t.batch_size * self.strategy.dp_size * t.accumulate_grad_batches

    @property
    def global_batch(self) -> int:
        return self.planned_global_batch

    def _scaled_optim(self) -> Any:
        """The optimizer config with ``lr`` rescaled for the global batch when optim.scale_lr asks for it."""
        from gputrain.optim import scaled_lr

        o = self.cfg.optim
        lr = scaled_lr(o.lr, self.planned_global_batch, o.reference_batch, o.scale_lr)
        self.lr_note = f" lr={lr:g}" + (f" ({o.scale_lr} from {o.lr:g} at batch {o.reference_batch})"
                                         if o.scale_lr != "none" else "")
        return dataclasses.replace(o, lr=lr)

    def _announce(self) -> None:
        if self.dist.is_main:
            t = self.cfg.trainer
            # Where and how this run was started stays out: the file is a recipe for the next run (`gputrain train
            # RUN/config.yaml`), which would otherwise be sent back into this folder and refused there.
            where = dataclasses.replace(t, out="", resume="", overwrite=False)
            (self.out / "config.yaml").write_text(CONFIG_HEADER + to_yaml(dataclasses.replace(self.cfg, trainer=where)))
            writer = self.checkpoint_writer
            checkpoints = "" if writer is None else "background" if writer.asynchronous else "synchronous"
            print(f"gputrain: {self.strategy.describe()} device={self.dist.device} precision={self.precision.name} "
                  f"{self.fast.describe()} {training_options(self.cfg, checkpoints=checkpoints, frozen_share=self.frozen_share)} "
                  f"batch_size={t.batch_size}/process global_batch={self.global_batch}{self.lr_note} "
                  f"out={self.out}", flush=True)

    # -- the loop ------------------------------------------------------------------------
    def fit(
        self, model: nn.Module, train_data: Dataset, val_data: Dataset | None = None, *,
        loss: Any = None, task: Task | None = None,
    ) -> dict[str, Any]:
        """Train; returns the summary (also written to ``out/summary.json``)."""
        if task is None:
            self.cfg = describe_python_run(self.cfg, model)
        try:
            self._setup(model, task or Task(loss), train_data, val_data)
            t = self.cfg.trainer
            if self.resumed and self.state.epoch >= t.epochs:
                return already_finished(self)
            if self.checkpoint_writer is not None and self.dist.is_main:
                self.checkpoint_writer.start()  # it imports torch while the run starts, ready by the first saves
            self._announce()
            with StopRequest(self.dist.world_size) as self.stop:
                try:
                    self._call("before_fit")
                    summary = self._fit_epochs()
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
            if self.checkpoint_writer is not None:
                self.checkpoint_writer.close()  # the writer process leaves (also when setup failed after it started)

    def discard_untrained_run(self) -> None:
        """After a fresh run failed before its first optimizer step, remove what it wrote (rank 0)."""
        fresh = getattr(self, "_fresh_out", None)
        if fresh is not None and self.state.global_step == 0 and self.dist.is_main:
            discard_untrained_run(*fresh)

    def _fit_epochs(self) -> dict[str, Any]:
        t = self.cfg.trainer
        start = time.perf_counter()
        train_time, train_samples = 0.0, 0.0
        metrics: dict[str, float] = {}
        while self.state.epoch < t.epochs:
            self._call("before_epoch")
            metrics = self.train_epoch()
            train_time += metrics["time/train_s"]
            train_samples += metrics["train/images_per_s"] * metrics["time/train_s"]  # trained by this run
            self.state.epoch += 1
            self.state.step_in_epoch = 0
            if self.val_loader is not None and self.state.epoch % max(t.eval_every_n_epochs, 1) == 0:
                eval_start = time.perf_counter()
                metrics |= {f"val/{k}": v for k, v in self.evaluate().items()}
                metrics["time/val_s"] = time.perf_counter() - eval_start
                val_count = len(self.val_loader.dataset)  # type: ignore[arg-type]  # every sample once (exact eval)
                metrics["time/val_images_per_s"] = val_count / max(metrics["time/val_s"], 1e-9)
            metrics["time/epoch_s"] = metrics["time/train_s"] + metrics.get("time/val_s", 0.0)
            self._call("after_epoch", metrics)
        summary = write_summary(self, metrics, time.perf_counter() - start, train_time, train_samples)
        self._call("after_fit", summary)
        return summary

    def train_epoch(self) -> dict[str, float]:
        """One epoch (or its rest, after a mid-epoch resume); see :func:`gputrain.train_step.run_epoch`."""
        return run_epoch(self)

    def after_optimizer_step(self) -> None:
        """Called by the epoch after each step: stop on an agreed signal, checkpoint every n steps."""
        t = self.cfg.trainer
        signum = self.stop.agreed(now=self.state.step_in_epoch >= self.steps_per_epoch)
        if signum:
            name = f"step_{self.state.global_step:06d}"
            saved = save_checkpoint(self, name, wait=True) if self.checkpoints is not None else None
            where = f"checkpoint {saved}" if saved else "no checkpoint (trainer.enable_checkpointing=false)"
            message = (f"interrupted at epoch {self.state.epoch + 1} step {self.state.global_step} ({where}); "
                       f"continue with: {self._resume_command()}")
            if self.dist.is_main:
                print(message, flush=True)
            raise Interrupted(signum, message)
        if t.checkpoint_every_n_steps and self.state.global_step % t.checkpoint_every_n_steps == 0 \
                and self.state.step_in_epoch < self.steps_per_epoch:
            save_checkpoint(self, f"step_{self.state.global_step:06d}")

    def _resume_command(self) -> str:
        if self.resume_command is not None:
            return self.resume_command(self.out)
        return f"Trainer(..., resume='auto', out='{self.out}').fit(...)"

    def evaluate(self, out_dir: Path | None = None) -> dict[str, float]:
        """Exact evaluation over the validation set: every sample once, metrics from reduced statistics."""
        assert self.val_loader is not None, "no validation data was given"
        self.strategy.prepare_eval(self.module)
        metrics = evaluate_batches(self)
        self.module.train()
        return metrics

    def validate(self, model: nn.Module, val_data: Dataset, *, task: Task) -> dict[str, float]:
        """Evaluate ``model`` alone (no training) on any device count; writes ``out/eval.json`` on rank 0."""
        from gputrain.hooks.progress import ProgressHook

        self.prepare(for_training=False)
        self.task = task
        self.hooks = [ProgressHook(bar=False), *self.extra_hooks]
        self.module = self.strategy.setup_module(self._fast_path(model, task))
        self.val_loader = self._loader(val_data, train=False)
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        metrics = {f"val/{k}": v for k, v in evaluate_batches(self).items()}
        metrics["time/val_s"] = time.perf_counter() - start
        metrics["world_size"] = self.dist.world_size
        if self.dist.is_main:
            from gputrain.hooks.logging import strict_json

            (self.out / "eval.json").write_text(strict_json(metrics, indent=2))
            print(strict_json(metrics, indent=2), flush=True)
            print(f"gputrain: wrote {self.out / 'eval.json'}", flush=True)
        return metrics

    def _call(self, event: str, *args: Any) -> None:
        for hook in self.hooks:
            self._settle_checkpoint()  # the save may come from the step or from the hook before this one
            getattr(hook, event)(self, *args)
        self._settle_checkpoint()  # the optimizer step follows before_optimizer_step

    def _settle_checkpoint(self) -> None:
        """Wait until the writer thread has copied the weights and optimizer state of the last save, before a hook
        or the optimizer step can change them (cheap when nothing is owed)."""
        if self.checkpoint_writer is not None:
            self.checkpoint_writer.settle()


def default_hooks(cfg: RunConfig) -> list[Hook]:
    """Progress, logging, and epoch checkpoints when enabled: the hooks every run gets, built outside the loop."""
    from gputrain.hooks.checkpoint import CheckpointHook
    from gputrain.hooks.logging import LoggingHook
    from gputrain.hooks.pictures import PicturesHook
    from gputrain.hooks.progress import ProgressHook

    t = cfg.trainer
    hooks: list[Hook] = [ProgressHook(bar=t.progress_bar), LoggingHook(list(t.loggers))]
    if t.enable_checkpointing:
        hooks.append(CheckpointHook(t.checkpoint_every_n_epochs))
    return [*hooks, PicturesHook()]  # last: after the loggers closed metrics.jsonl
