"""The training loop: small, with hooks, and blind to strategy and precision.

``Trainer.fit`` sets up (process group, strategy, precision, model, data, optimizer), then
runs epochs of :meth:`Trainer.train_epoch` and :meth:`Trainer.evaluate`. Everything that
differs between ways of running sits behind ``self.strategy`` and ``self.precision``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from gputrain.checkpoint import load_checkpoint, rng_state, set_rng_state
from gputrain.config import RunConfig, TrainerConfig, to_dict, to_yaml
from gputrain.dist import init_distributed
from gputrain.hooks.base import Hook
from gputrain.hooks.checkpoint import CheckpointHook
from gputrain.hooks.logging import LoggingHook
from gputrain.hooks.progress import ProgressHook
from gputrain.loop_state import LossWindow, TrainState, seed_everything
from gputrain.optim import build_optimizer, build_scheduler
from gputrain.precision import build_precision
from gputrain.strategies import build_strategy
from gputrain.strategies.base import move_to_device
from gputrain.tasks.base import Task


class Trainer:
    """Train any ``nn.Module`` on any ``Dataset`` with any loss, on 1 process or many.

    >>> Trainer(strategy="ddp", devices=2, precision="bf16-mixed", epochs=3).fit(
    ...     model, train_data, val_data, loss=torch.nn.functional.mse_loss)  # doctest: +SKIP

    Keyword arguments are fields of :class:`~gputrain.config.TrainerConfig`; pass ``cfg`` for a whole
    :class:`~gputrain.config.RunConfig` (optimizer, schedule). With ``devices > 1`` the process must
    have been started by a launcher (``gputrain train``, ``torchrun``, :func:`gputrain.launch`).
    """

    def __init__(self, cfg: RunConfig | None = None, *, hooks: list[Hook] | None = None, **trainer: Any) -> None:
        cfg = cfg or RunConfig()
        known = {f.name for f in dataclasses.fields(TrainerConfig)}
        unknown = set(trainer) - known
        if unknown:
            raise TypeError(f"unknown Trainer option(s) {sorted(unknown)}; valid: {sorted(known)}")
        self.cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **trainer))
        self.extra_hooks = hooks or []
        self.state = TrainState()
        self.resumed = False

    # -- setup ---------------------------------------------------------------------------
    def _setup_runtime(self, task: Task) -> None:
        """Process group, strategy, precision and output folder: what training and evaluation share."""
        t = self.cfg.trainer
        self.dist = init_distributed(t.accelerator)
        if t.devices > 1 and self.dist.world_size == 1 and t.strategy != "dp":
            raise ValueError(
                f"trainer.devices={t.devices} but this process was started alone; start it with "
                f"`gputrain train ... --devices {t.devices}`, `torchrun --nproc-per-node {t.devices} script.py` "
                f"or gputrain.launch(fn, devices={t.devices})"
            )
        options: dict[str, Any] = {}
        if t.strategy == "ddp":
            options = {"find_unused_parameters": t.find_unused_parameters}
        elif t.strategy == "dp":
            options = {"device_ids": t.dp_device_ids, "output_device": t.dp_output_device}
        self.strategy = build_strategy(t.strategy, self.dist, **options)
        self.precision = build_precision(t.precision, self.dist.device)
        self.task = task
        self.out = Path(t.out)
        self.config_dict = to_dict(self.cfg)

    def _loader(self, data: Dataset, *, train: bool) -> DataLoader:
        t, workers = self.cfg.trainer, self.cfg.data.num_workers
        sampler = (self.strategy.train_sampler(len(data), seed=t.seed, drop_last=t.drop_last) if train
                   else self.strategy.eval_sampler(len(data)))
        return DataLoader(
            data, batch_size=t.batch_size if train else (t.eval_batch_size or t.batch_size), sampler=sampler,
            collate_fn=self.task.collate_fn(), num_workers=workers, pin_memory=self.dist.device.type == "cuda",
            persistent_workers=workers > 0, drop_last=train and t.drop_last,
        )

    def _setup(self, model: nn.Module, task: Task, train_data: Dataset, val_data: Dataset | None) -> None:
        t = self.cfg.trainer
        self._setup_runtime(task)
        seed_everything(t.seed)
        if t.sync_batchnorm and self.dist.world_size > 1:
            from gputrain.nn.sync_batchnorm import convert_sync_batchnorm

            model = convert_sync_batchnorm(model, self.dist.device.type)
        self.strategy.check_batch(t.batch_size)
        self.module = self.strategy.setup_module(model)
        self.optimizer = build_optimizer(self.strategy.unwrap(self.module), self.cfg.optim)
        # Weights were initialised from the shared seed; from here on (dropout, augmentation in the main
        # process) each rank draws its own stream, else all ranks would augment their samples alike.
        seed_everything(t.seed + 100_003 * self.dist.rank)
        self.train_loader = self._loader(train_data, train=True)
        self.val_loader = None if val_data is None else self._loader(val_data, train=False)
        micro = len(self.train_loader)
        self.steps_per_epoch = math.ceil(micro / t.accumulate_grad_batches)
        if t.max_steps_per_epoch:
            self.steps_per_epoch = min(self.steps_per_epoch, t.max_steps_per_epoch)
        self.scheduler = build_scheduler(
            self.optimizer, self.cfg.scheduler, total_steps=self.steps_per_epoch * t.epochs,
            steps_per_epoch=self.steps_per_epoch,
        )
        self.hooks: list[Hook] = [ProgressHook(bar=t.progress_bar), LoggingHook(list(t.loggers))]
        if t.enable_checkpointing:
            self.hooks.append(CheckpointHook(self.out / "checkpoints", t.checkpoint_every_n_epochs))
        self.hooks += self.extra_hooks
        if t.resume:
            self._resume(t.resume)
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(to_yaml(self.cfg))
            global_batch = t.batch_size * self.dist.world_size * t.accumulate_grad_batches
            print(
                f"gputrain: strategy={self.strategy.name} world_size={self.dist.world_size} device={self.dist.device} "
                f"precision={self.precision.name} batch_size={t.batch_size}/process global_batch={global_batch}",
                flush=True,
            )

    def _resume(self, where: str) -> None:
        path = self.out / "checkpoints" / "last.pt" if where == "auto" else Path(where)
        if where == "auto" and not path.is_file():
            return  # nothing to resume yet: start fresh
        state = load_checkpoint(path, map_location=self.dist.device)
        saved_optim = state.get("config", {}).get("optim", {}).get("name", self.cfg.optim.name)
        if saved_optim != self.cfg.optim.name:
            raise ValueError(
                f"checkpoint {path} was trained with optim.name={saved_optim} but this run sets "
                f"optim.name={self.cfg.optim.name}; resume with the same optimizer, or load only the weights "
                f"(model.kwargs.weights_path) to start a new run"
            )
        self.strategy.load_model_state_dict(self.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("precision", {}))
        self.state = TrainState(**state["state"])
        rng = state.get("rng", {})
        if str(self.dist.rank) in rng:
            set_rng_state(rng[str(self.dist.rank)])
        self.resumed = True

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly; plain containers and tensors only."""
        return {
            "model": self.strategy.model_state_dict(self.module),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "state": dataclasses.asdict(self.state),
            "rng": self._rng_states(),
            "world_size": self.dist.world_size,
            "config": self.config_dict,
        }

    def _rng_states(self) -> dict[str, Any]:
        """Every rank's generator states (a collective), keyed by rank, so each rank resumes its own."""
        gathered = self.strategy.gather_objects(rng_state())
        return {str(rank): state for rank, state in enumerate(gathered)} if gathered else {}

    # -- the loop ------------------------------------------------------------------------
    def fit(
        self, model: nn.Module, train_data: Dataset, val_data: Dataset | None = None, *,
        loss: Any = None, task: Task | None = None,
    ) -> dict[str, Any]:
        """Train; returns the summary (also written to ``out/summary.json``)."""
        self._setup(model, task or Task(loss), train_data, val_data)
        t = self.cfg.trainer
        try:
            self._call("before_fit")
            start = time.perf_counter()
            train_time, train_samples = 0.0, 0.0
            metrics: dict[str, float] = {}
            while self.state.epoch < t.epochs:
                self._call("before_epoch")
                metrics = self.train_epoch()
                train_time += metrics["time/train_s"]
                train_samples += metrics["train/samples"]
                self.state.epoch += 1
                if self.val_loader is not None and self.state.epoch % max(t.eval_every_n_epochs, 1) == 0:
                    eval_start = time.perf_counter()
                    metrics |= {f"val/{k}": v for k, v in self.evaluate().items()}
                    metrics["time/val_s"] = time.perf_counter() - eval_start
                metrics["time/epoch_s"] = metrics["time/train_s"] + metrics.get("time/val_s", 0.0)
                self._call("after_epoch", metrics)
            summary = self._summary(metrics, time.perf_counter() - start, train_time, train_samples)
            self._call("after_fit", summary)
            return summary
        except BaseException as err:
            self._call("on_exception", err)
            raise

    def train_epoch(self) -> dict[str, float]:
        t = self.cfg.trainer
        module, accum = self.module, t.accumulate_grad_batches
        module.train()
        self.train_loader.sampler.set_epoch(self.state.epoch)  # the framework does it, never the user
        # The loss sum stays on the device and costs one kernel per step (no host sync); it is
        # all-reduced and folded into host totals only on logging steps and at the end of the epoch.
        window = LossWindow(self.strategy)
        n_micro = len(self.train_loader)
        steps_done = 0
        start = time.perf_counter()
        for i, batch in enumerate(self.train_loader):
            group_start = i - i % accum
            group_len = min(accum, n_micro - group_start)  # the epoch's last group may be short
            sync = i - group_start == group_len - 1
            loss, n = self.run_micro_batch(batch, sync=sync, scale=1.0 / group_len)
            window.add(loss, n)
            if not sync:
                continue
            self.optimizer_step()
            steps_done += 1
            logs = None
            if t.log_every_n_steps and self.state.global_step % t.log_every_n_steps == 0:
                logs = {"train/loss": window.flush(), "lr": self.optimizer.param_groups[0]["lr"]}
            self._call("after_step", logs)
            if steps_done >= self.steps_per_epoch:
                break
        window.flush()
        train_s = time.perf_counter() - start
        return {
            "train/loss": window.epoch_loss_sum / max(window.epoch_samples, 1),
            "train/samples": window.epoch_samples,
            "train/steps": steps_done,
            "time/train_s": train_s,
            "train/images_per_s": window.epoch_samples / train_s if train_s > 0 else 0.0,
        }

    def run_micro_batch(self, batch: Any, *, sync: bool, scale: float) -> tuple[torch.Tensor, int]:
        """Forward and backward of one micro-batch; gradients are all-reduced only when ``sync``."""
        inputs, targets = self.task.split_batch(batch)
        n = self.task.batch_size(inputs)
        self.strategy.check_batch(n)
        inputs = move_to_device(inputs, self.strategy.root_device, non_blocking=True)
        targets = move_to_device(targets, self._target_device, non_blocking=True)
        with self.strategy.backward_sync(self.module, sync):
            with self.precision.forward_context():
                outputs = self.task.forward(self.module, inputs, targets)
                if not self.task.targets_to_model:
                    self.strategy.check_loss_inputs(outputs, targets)
                loss = self.task.loss(outputs, targets)
            self.precision.backward(loss if scale == 1.0 else loss * scale)
        self.state.samples_seen += n * self.dist.world_size
        return loss, n

    @property
    def _target_device(self) -> torch.device:
        return self.strategy.root_device if self.task.targets_to_model else self.strategy.output_device

    def optimizer_step(self) -> None:
        clip = self.cfg.trainer.grad_clip_norm
        if clip > 0:
            self.precision.unscale(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.strategy.unwrap(self.module).parameters(), clip)
        stepped = self.precision.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self.scheduler.step()
        else:
            with warnings.catch_warnings():  # GradScaler skipped a step on inf/NaN: the schedule still counts it
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()` before")
                self.scheduler.step()
        self.state.global_step += 1

    @torch.no_grad()
    def evaluate(self, out_dir: Path | None = None) -> dict[str, float]:
        """Exact evaluation over the validation set: every sample once, metrics from reduced statistics."""
        assert self.val_loader is not None, "no validation data was given"
        model = self.strategy.eval_module(self.module)
        model.eval()
        evaluator = self.task.evaluator()
        for batch in self.val_loader:
            inputs, targets = self.task.split_batch(batch)
            inputs = move_to_device(inputs, self.strategy.root_device, non_blocking=True)
            targets = move_to_device(targets, self._target_device, non_blocking=True)
            with self.precision.forward_context():
                outputs, loss = self.task.evaluate_batch(model, inputs, targets)
            evaluator.update(outputs, targets, loss, self.task.batch_size(inputs))
        self.module.train()
        return evaluator.compute(self.strategy, out_dir or self.out)

    def validate(self, model: nn.Module, val_data: Dataset, *, task: Task) -> dict[str, float]:
        """Evaluate ``model`` alone (no training) on any device count; writes ``out/eval.json`` on rank 0."""
        self._setup_runtime(task)
        self.module = self.strategy.setup_module(model)
        self.val_loader = self._loader(val_data, train=False)
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        metrics = {f"val/{k}": v for k, v in self.evaluate().items()}
        metrics["time/val_s"] = time.perf_counter() - start
        metrics["world_size"] = self.dist.world_size
        if self.dist.is_main:
            (self.out / "eval.json").write_text(json.dumps(metrics, indent=2))
            print(json.dumps(metrics, indent=2), flush=True)
        return metrics

    def _call(self, event: str, *args: Any) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self, *args)

    def _summary(self, metrics: dict[str, float], wall_s: float, train_s: float, samples: float) -> dict[str, Any]:
        t = self.cfg.trainer
        val_iters = len(self.val_loader) if self.val_loader is not None else 0
        summary = {
            "final": metrics,
            "world_size": self.dist.world_size,
            "strategy": self.strategy.name,
            "precision": self.precision.name,
            "device": str(self.dist.device),
            "batch_size_per_device": t.batch_size,
            "global_batch": t.batch_size * self.dist.world_size * t.accumulate_grad_batches,
            "iters_per_epoch": {"train": len(self.train_loader), "val": val_iters,
                                "total": len(self.train_loader) + val_iters},
            "epochs": self.state.epoch,
            "global_step": self.state.global_step,
            "samples_seen": self.state.samples_seen,
            "wall_s": wall_s,
            "train_s": train_s,
            "images_per_s": samples / train_s if train_s > 0 else 0.0,
        }
        if self.dist.is_main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
