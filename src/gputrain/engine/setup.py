"""Building what a run trains with, once: every ``auto`` resolved, then strategy, precision, model, data, checkpoints.

:func:`build` is the only place a run's config changes: it calls :func:`~gputrain.config.resolve.resolve_run` once
with the facts of this rank (device, node, task, the checkpoint it resumes from) and everything after reads the
resolved config. The result, a :class:`Loop`, holds the built objects; nothing replaces them afterwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from gputrain.checkpoint.checkpointer import Checkpointer, non_finite_error, resume_from
from gputrain.checkpoint.state import Parts, TrainState, all_finite, check_same_run, restore, resumed_line
from gputrain.checkpoint.store import CheckpointStore
from gputrain.config.resolve import Facts, FastPath, local_processes, resolve_run, usable_cores
from gputrain.config.schema import RunConfig
from gputrain.data.mix import PairMixer
from gputrain.data.reader_clock import ReaderClock, TimedCollate, TimedReads
from gputrain.data.samplers import SeededSamples, StepBatchSampler
from gputrain.dist import DistInfo, comm
from gputrain.engine.ema import WeightAverage
from gputrain.engine.fast import apply_backend_flags, prepare_model
from gputrain.engine.state import SkippedSteps, seed_everything
from gputrain.errors import NonFiniteError
from gputrain.nn.float32 import keep_float32
from gputrain.optim import build_scheduler, scaled_lr
from gputrain.precision import Precision, build_precision
from gputrain.strategies import build_strategy, strategy_class
from gputrain.strategies.base import Strategy
from gputrain.tasks.base import Task


@dataclass
class Loop:
    """What one run trains with: its resolved config and built objects (the engine's, read by the epoch)."""

    cfg: RunConfig
    dist: DistInfo
    fast: FastPath
    strategy: Strategy
    precision: Precision
    task: Task
    module: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    train_loader: DataLoader | None = None
    batch_sampler: StepBatchSampler | None = None
    val_loader: DataLoader | None = None
    steps_per_epoch: int = 0
    checkpointer: Checkpointer | None = None
    lr_note: str = ""
    """How the learning rate was chosen, for the start-up line."""
    first_step_s: float | None = None
    """Seconds of this process's first optimizer step (compilation included when ``trainer.compile``)."""
    ema: WeightAverage | None = None
    """The moving average of the weights (``trainer.ema_decay``), or None."""
    mixer: PairMixer | None = None
    """MixUp/CutMix of the training batches (``data.mixup_alpha``, ``data.cutmix_alpha``), or None."""
    reader_clock: ReaderClock | None = None
    """How fast the training loader's readers read (the pace record's images/s per reader)."""
    skips: SkippedSteps = dataclasses.field(init=False)
    """Steps the loss scaler skipped (16-mixed), and the limit that ends a run."""

    def __post_init__(self) -> None:
        self.skips = SkippedSteps(self.dist.is_main, self.precision)

    @property
    def parts(self) -> Parts:
        assert self.optimizer is not None
        return Parts(dist=self.dist, strategy=self.strategy, module=self.module, optimizer=self.optimizer,
                     scheduler=self.scheduler, precision=self.precision,
                     ema=self.ema.tensors if self.ema is not None else None)

    @property
    def target_device(self) -> torch.device:
        """Where targets go: the input device when the model consumes them, else where outputs land."""
        return self.strategy.root_device if self.task.targets_to_model else self.strategy.output_device

    @property
    def global_batch(self) -> int:
        t = self.cfg.trainer
        return t.batch_size * self.strategy.dp_size * t.accumulate_grad_batches

    def all_finite(self) -> bool:
        """Whether weights, buffers and optimizer state are finite on every rank (a collective)."""
        return all_finite(self.parts)

    def non_finite(self, what: str, state: TrainState, fix: str = "") -> NonFiniteError:
        """The one-line error of a diverged run, naming the last good checkpoint (a collective)."""
        if self.checkpointer is not None:
            return self.checkpointer.non_finite(what, state, fix)
        return non_finite_error(what, state, "", fix)


def resolved(cfg: RunConfig, dist: DistInfo, task: Task, resume: dict[str, Any] | None) -> tuple[RunConfig, FastPath]:
    """The run's config with every ``auto`` decided for this rank (:func:`~gputrain.config.resolve.resolve_run`)."""
    facts = Facts(device=dist.device, local_processes=local_processes(dist.world_size),
                  cores=usable_cores(), fixed_shapes=task.fixed_shapes,
                  normalizes_on_device=bool(getattr(task, "normalizes_on_device", False)),
                  dp_size=strategy_class(cfg.trainer.strategy).data_parallel_size(dist.world_size),
                  saved_global_batch=int(resume.get("global_batch", 0) or 0) if resume else 0,
                  resumed_from=resume["_path"] if resume else "")
    return resolve_run(cfg, facts)


def build_runtime(cfg: RunConfig, dist: DistInfo, task: Task, model: nn.Module,
                  resume: dict[str, Any] | None = None) -> Loop:
    """Resolve the config, then strategy, precision and the model in its memory format (training and evaluation)."""
    cfg, fast = resolved(cfg, dist, task, resume)
    strategy = build_strategy(cfg, dist)
    t = cfg.trainer
    expected = strategy.processes_per_node(t.devices) * cfg.launch.nnodes
    if expected > 1 and dist.world_size == 1:
        raise ValueError(
            f"trainer.devices={t.devices} needs {expected} processes but this one was started alone; start it "
            f"with `gputrain train ... --devices {t.devices}`, `torchrun --nproc-per-node {t.devices} script.py` "
            f"or gputrain.launch(fn, devices={t.devices})"
        )
    precision = build_precision(t.precision, dist.device)
    apply_backend_flags(fast)
    _in_float32(model, cfg, dist)
    return Loop(cfg=cfg, dist=dist, fast=fast, strategy=strategy, precision=precision, task=task,
                module=prepare_model(model, fast))


def _in_float32(model: nn.Module, cfg: RunConfig, dist: DistInfo) -> None:
    """trainer.fp32_modules, said once: what runs in float32, or that precision 32 makes it moot."""
    chosen = keep_float32(model, cfg.trainer.fp32_modules)
    if chosen and dist.is_main:
        where = ", ".join(chosen[:4]) + (f" and {len(chosen) - 4} more" if len(chosen) > 4 else "")
        print(f"gputrain: trainer.fp32_modules: {where} run in float32, outside autocast"
              + ("" if "mixed" in str(cfg.trainer.precision) else " (no effect at precision 32)"), flush=True)


def build_training(loop: Loop, train_data: Dataset, val_data: Dataset | None, out: Path) -> Loop:
    """The rest of a training run: the wrapped module, optimizer, loaders, schedule and checkpoints."""
    cfg, dist, strategy = loop.cfg, loop.dist, loop.strategy
    t = cfg.trainer
    model = loop.module
    if t.sync_batchnorm and dist.world_size > 1 and strategy.dp_size == 1:
        # One recipe at every scale: a pipeline's ranks hold different layers, each stage's BatchNorm already sees
        # every sample of its micro-batches on its own rank: there are no replicas to synchronise.
        if dist.is_main:
            print(f"gputrain: trainer.sync_batchnorm=true has nothing to synchronise under strategy {strategy.name} "
                  "(no data-parallel replicas; each BatchNorm runs on one rank): BatchNorm is left as it is", flush=True)
    elif t.sync_batchnorm and dist.world_size > 1:
        from gputrain.nn.sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, dist.device.type)
        keep_float32(model, t.fp32_modules)  # the new SyncBatchNorm modules, where fp32_modules names them
    if t.activation_checkpointing:
        from gputrain.parallel.activation_checkpoint import checkpoint_blocks

        checkpoint_blocks(model, children_in_order=bool(cfg.parallel.split_points))
    strategy.check_batch(t.batch_size, model)
    loop.module = strategy.setup_module(model)
    if loop.fast.compile_mode:
        strategy.compile_module(loop.module, loop.fast.compile_mode)
    o = cfg.optim
    lr = scaled_lr(o.lr, loop.global_batch, o.reference_batch, o.scale_lr)
    loop.lr_note = f" lr={lr:g}" + (f" ({o.scale_lr} from {o.lr:g} at batch {o.reference_batch})"
                                    if o.scale_lr != "none" else "")
    loop.optimizer = strategy.setup_optimizer(loop.module, dataclasses.replace(o, lr=lr))
    loop.ema = WeightAverage.for_run(cfg, strategy, loop.module, loop.global_batch)
    # Weights were initialised from the shared seed; from here on (dropout) each rank draws its own
    # stream. Augmentation does not use it: SeededSamples seeds each sample from (seed, epoch, index).
    seed_everything(t.seed + 100_003 * dist.rank)
    loop.mixer = PairMixer.for_run(cfg, num_classes=int(getattr(loop.task, "num_classes", 0) or 0),
                                   global_batch=loop.global_batch)
    loop.train_loader, loop.batch_sampler = train_loader(loop, train_data)
    loop.val_loader = None if val_data is None else eval_loader(loop, val_data)
    loop.steps_per_epoch = loop.batch_sampler.plan.num_steps
    if t.max_steps_per_epoch:
        loop.steps_per_epoch = min(loop.steps_per_epoch, t.max_steps_per_epoch)
    loop.scheduler = build_scheduler(loop.optimizer, cfg.scheduler, total_steps=loop.steps_per_epoch * t.epochs,
                                     steps_per_epoch=loop.steps_per_epoch)
    if t.enable_checkpointing:
        loop.checkpointer = Checkpointer(out / "checkpoints", t, dist, sharded=cfg.parallel.sharded_checkpoint)
    return loop


def find_resume(cfg: RunConfig, dist: DistInfo, out: Path) -> dict[str, Any] | None:
    """The checkpoint this run continues from (read on every rank), or None (a collective)."""
    t = cfg.trainer
    if not t.resume:
        return None
    store = CheckpointStore(out / "checkpoints", keep_last=t.keep_last, monitor=t.monitor, monitor_mode=t.monitor_mode)
    found = resume_from(t.resume, store, dist)
    if found is not None:
        check_same_run(found.get("config") or {}, str(cfg.task), cfg.model.name, str(found.get("_path", t.resume)))
    return found


def restore_training(loop: Loop, resume: dict[str, Any]) -> tuple[TrainState, dict[str, float] | None]:
    """Load checkpoint ``resume`` into the built run: its train state and the loss sums of a partly trained epoch."""
    path = resume["_path"]
    if resume.get("sharded"):
        from gputrain.checkpoint.sharded import load_sharded

        load_sharded(loop.strategy, loop.module, loop.optimizer, Path(path).parent / resume["sharded"],
                     ema=loop.ema.tensors if loop.ema is not None and "ema" in resume else None)
    state = restore(loop.parts, resume, path)
    if loop.ema is not None:
        restore_ema(loop.ema, resume, path, loop.dist.is_main)
    if loop.dist.is_main and state.epoch < loop.cfg.trainer.epochs:
        print(resumed_line(path, state), flush=True)
    return state, resume.get("loss_window") or None


def restore_ema(ema: WeightAverage, resume: dict[str, Any], path: str, is_main: bool) -> None:
    """The EMA a checkpoint holds (its full weights, or the sharded folder's, already loaded), or a restart from
    the resumed weights when it holds none (a run that turned trainer.ema_decay on), said in one line."""
    saved = resume.get("ema")
    if not saved:
        ema.restart_from_weights()
        if is_main:
            print(f"gputrain: {path} holds no EMA of the weights (trained with trainer.ema_decay=0): the EMA starts "
                  "from the resumed weights", flush=True)
        return
    if "weights" in saved:
        ema.load_full(saved["weights"])
    ema.updates = int(saved.get("updates", 0))


def check_same_length(data: Dataset) -> None:
    """Every rank must plan the same steps: fail fast, with the counts, if datasets differ by rank."""
    lengths = comm.all_gather_objects(len(data))  # type: ignore[arg-type]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"the training set has a different length on each rank ({dict(enumerate(lengths))}); every rank "
            "must read the same dataset (the framework shards it), e.g. the same data.root on shared storage"
        )


def _loader_options(loop: Loop, *, synthetic: bool) -> dict[str, Any]:
    workers = 0 if synthetic else int(loop.cfg.data.num_workers)  # device-resident samples: no workers
    # A generator of the loader's own: starting an epoch's iterator draws a worker seed from it, which
    # from the global generator would shift dropout's stream and break a mid-epoch resume.
    # prefetch_factor counts per worker, so the batches in flight (2 x workers) already grow with the workers,
    # which data.num_workers=auto sizes from the cores: each worker keeps one batch ready while it makes the
    # next. More would only hold more shared memory (a float batch of 256 images at 224x224 is 154 MB).
    return dict(collate_fn=loop.task.collate_fn(), num_workers=workers,
                pin_memory=loop.dist.device.type == "cuda" and not synthetic, persistent_workers=workers > 0,
                prefetch_factor=2 if workers else None, generator=torch.Generator().manual_seed(loop.cfg.trainer.seed))


def train_loader(loop: Loop, data: Dataset) -> tuple[DataLoader, StepBatchSampler]:
    """The training loader: the framework's sampler deals each step's global batch, whatever the process count."""
    t, strategy = loop.cfg.trainer, loop.strategy
    synthetic = loop.cfg.data.synthetic
    sampler = StepBatchSampler(len(data), dp_rank=strategy.dp_rank, dp_size=strategy.dp_size,  # type: ignore[arg-type]
                               batch_size=t.batch_size, accumulate=t.accumulate_grad_batches, seed=t.seed,
                               drop_last=t.drop_last, unit=2 if loop.mixer is not None else 1,
                               repeats=loop.cfg.data.repeated_augment)
    if synthetic:
        from gputrain.data.synthetic import DeviceResidentSamples

        data = DeviceResidentSamples(data, loop.dist.device)
    options = _loader_options(loop, synthetic=synthetic)
    # Each reader (this process or a worker) times its reads and collates: the run's images/s per loader worker.
    loop.reader_clock = ReaderClock(options["num_workers"])
    options["collate_fn"] = TimedCollate(options["collate_fn"] or default_collate, loop.reader_clock)
    return DataLoader(TimedReads(SeededSamples(data, t.seed), loop.reader_clock), batch_sampler=sampler,
                      **options), sampler


def end_workers(*loaders: DataLoader | None) -> None:
    """End the loaders' persistent worker processes now; iterating a loader again starts new ones.

    Left to Python, a loader that the run's objects hold in a reference cycle is freed by the garbage collector,
    which runs its queues' finalizers before the iterator's own: the workers never receive their stop message, and
    torch waits 5 s for each before terminating it (a 15-20 s stall at some later moment of the caller's program).
    Lightning ends its loaders' workers at teardown the same way."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)  # where a DataLoader keeps its persistent-workers iterator
        if iterator is not None:
            loader._iterator = None  # type: ignore[union-attr]
            iterator._shutdown_workers()  # only a loader with persistent workers keeps an iterator


def eval_loader(loop: Loop, data: Dataset) -> DataLoader:
    """The validation loader: every sample once over the ranks (exact evaluation)."""
    t = loop.cfg.trainer
    return DataLoader(data, batch_size=t.eval_batch_size or t.batch_size,
                      sampler=loop.strategy.eval_sampler(len(data)),  # type: ignore[arg-type]
                      **_loader_options(loop, synthetic=False))
