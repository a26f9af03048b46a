"""``gputrain parity RECIPE``: the same recipe and global batch in several modes must train alike.

Every mode starts from the same initial weights (the seed, before the task is built) and trains
the same samples at every step (the framework's sampler deals one global batch ``G`` per step,
whatever the process count), for a few optimizer steps across one epoch boundary. The modes:

==============  =========  =====================  ====================================
mode            processes  batch per process      what it checks
==============  =========  =====================  ====================================
single          1          G                      the reference
ddp             2          G/2                    gradient all-reduce, sharding
accumulation    1          G/2, accumulate 2      accumulation equals one large batch
dp              1          G                      nn.DataParallel's scatter/gather
pipeline        2          G (one stage a rank)   stage split, micro-batches, loss rank
fsdp            2          G/2                    sharded parameters and their gather
model_parallel  1          G                      stages on several devices
==============  =========  =====================  ====================================
Unavailable strategies' modes are skipped and listed; :mod:`~gputrain.tools.diagnose.parity_compare` compares
each mode with ``single`` and names the cause of a difference.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import json
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gputrain.checkpoint.files import atomic_save
from gputrain.config import RunConfig, TrainerConfig, load_config
from gputrain.dist import DistInfo
from gputrain.engine.hooks import Hook, RunContext
from gputrain.strategies import processes_per_node, strategy_class
from gputrain.tools.diagnose import MODE_NAMES, probes
from gputrain.tools.diagnose.outcome import append_record, mode_result_path
from gputrain.tools.diagnose.parity_compare import ModeResult, ParityReport, collect_outcomes, compare
from gputrain.tools.diagnose.ranks import (
    BETWEEN_MODES,
    STOP_PEERS,
    flight_recorder_last,
    named_timeout,
    one_line,
    run_on_ranks,
    wait_for_every_rank,
)
from gputrain.tools.progress import Progress, Silent


@dataclass(frozen=True)
class Mode:
    """One way of running the same global batch."""

    name: str
    strategy: str
    accumulate: int = 1

    @property
    def processes(self) -> int:
        """As the strategy is registered: 2 for one process per device, else 1."""
        return processes_per_node(self.strategy, 2)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the global batch is split over this many processes (the strategy class says)."""
        return strategy_class(self.strategy).data_parallel_size(self.processes)

    @property
    def micro_batched(self) -> bool:
        """Whether BatchNorm sees less than the whole per-process batch (micro-batches), so cannot match single."""
        return self.accumulate > 1 or strategy_class(self.strategy).splits_batch

    def batch_size(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.accumulate)


MODES: dict[str, Mode] = {name: Mode(name, "single", accumulate=2) if name == "accumulation" else Mode(name, name)
                          for name in MODE_NAMES}
"""Every registered strategy, and gradient accumulation in one process."""


class ParityHook(Hook):
    """Records, per step, the loss, the samples read, and the parameters that got no gradient on this rank."""

    def __init__(self, mode: str, recorder: probes.IndexRecorder) -> None:
        self.mode, self.recorder = mode, recorder
        self.losses: list[float] = []
        self.samples: list[list[int]] = []
        self.unused: list[list[str]] = []
        self.pending: list[str] | None = None
        self.bn: dict[str, torch.Tensor] = {}

    def before_fit(self, ctx: RunContext) -> None:
        self.usage = probes.ParamUsage(ctx.model)

    def before_optimizer_step(self, ctx: RunContext) -> None:
        self.pending = self.usage.take()
        # Streamed now: if this step's all-reduce kills the process, the parent still learns what was unused.
        append_record({"kind": "grads", "mode": self.mode, "step": len(self.losses) + 1, "unused": self.pending})

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        self.losses.append(float(logs.get("train/loss", math.nan)) if logs else math.nan)
        self.samples.append(sorted(self.recorder.take()))
        self.unused.append(self.pending if self.pending is not None else self.usage.take())
        self.pending = None

    def after_fit(self, ctx: RunContext, summary: dict[str, Any]) -> None:
        self.bn = probes.batchnorm_buffers(ctx.model)
        self.usage.remove()

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        """What the mode did, with ``state`` (the trained weights, gathered on rank 0)."""
        weights = {k: v.detach().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
        return {"losses": self.losses, "samples": self.samples, "unused": self.unused, "state": weights,
                "bn": self.bn}


def build_from_config(cfg: RunConfig) -> Any:
    """A recipe's task (model, data, task), as ``gputrain train`` builds it."""
    from gputrain.tasks import build_task

    # Parity casts each sample's floats to its dtype (float64) as it is read; uint8 pixels made float32 on the
    # device would miss that cast, so the workers make them float here, as data.normalize_on_device=false does.
    return build_task(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, normalize_on_device=False)))


def _trainer_options(mode: Mode, global_batch: int, steps: int, epochs: int, out: str, accelerator: str,
                     timeout_s: float) -> dict[str, Any]:
    options = dict(strategy=mode.strategy, devices=mode.processes, batch_size=mode.batch_size(global_batch),
                   accumulate_grad_batches=mode.accumulate, epochs=epochs, max_steps_per_epoch=steps,
                   log_every_n_steps=1, enable_checkpointing=False, loggers=[], progress_bar=False, out=out,
                   eval_every_n_epochs=10**9, accelerator=accelerator, timeout_s=timeout_s, resume="")
    if mode.dp == 1:
        # Without data parallelism every process (pipeline stage) sees the whole batch: nothing to synchronise.
        options["sync_batchnorm"] = False
    known = {f.name for f in dataclasses.fields(TrainerConfig)}
    return {k: v for k, v in options.items() if k in known}


DTYPES = {"float64": torch.float64, "float32": torch.float32}


def run_mode(build: Callable[[], Any], cfg: RunConfig, mode: Mode, *, global_batch: int, steps: int, epochs: int,
             out: str, accelerator: str, timeout_s: float, dtype: str = "float64", hooks: Sequence[Hook] = ()
             ) -> dict[str, Any]:
    """Train ``mode`` in this process (one rank of it under a launcher); returns what :class:`ParityHook` saw.

    In float64 (the default) rounding differences between modes (another summation order in an
    all-reduce, float64 statistics in SyncBatchNorm) stay near 1e-15 instead of growing, step by
    step, through BatchNorm at small batches to 1e-4 and more; a real difference does not shrink.
    """
    from gputrain.engine.state import seed_everything
    from gputrain.engine.trainer import Trainer

    seed_everything(cfg.trainer.seed)  # the same initial weights in every mode
    spec = build()
    model = spec.model.to(DTYPES[dtype])
    recorder = probes.IndexRecorder(spec.train_data, DTYPES[dtype] if dtype != "float32" else None)
    hook = ParityHook(mode.name, recorder)
    options = _trainer_options(mode, global_batch, steps, epochs, out, accelerator, timeout_s)
    if cfg.trainer.precision == "auto":  # parity compares the modes' arithmetic: autocast only when asked for
        options["precision"] = "32"
    trainer = Trainer(cfg, hooks=[hook, *(copy.deepcopy(h) for h in hooks)], **options)
    trainer.fit(model, recorder, None, task=spec.task)
    state = trainer.model_state_dict()  # a collective for sharded strategies
    return hook.result(state if trainer.dist.is_main else {})


def _parity_ranks(info: DistInfo, build: Callable[[], Any], cfg: RunConfig, modes: list[Mode], kwargs: dict[str, Any],
                  mode_hooks: dict[str, list[Hook]]) -> dict[str, Any]:
    """The multi-process modes, one after another in the same ranks; stops at the first that fails."""
    done: dict[str, Any] = {}
    previous = ""
    for mode in modes:
        append_record({"kind": "start", "mode": mode.name})
        try:
            try:  # every rank has finished the mode before: none races into this one's collectives (a slow rank
                wait_for_every_rank(kwargs["timeout_s"])  # still ending ddp made its peer fail in pipeline's; ddp took
            except Exception as err:  # the blame). A slow tail is no mode's failure: the wait is generous.
                raise TimeoutError(f"every rank had not finished mode {previous} within "
                                   f"{BETWEEN_MODES * kwargs['timeout_s']:.0f} s of this one ({one_line(err)[:120]})") from err
            value = run_mode(build, cfg, mode, hooks=mode_hooks.get(mode.name, ()), out=f"{kwargs['out']}/{mode.name}",
                             **{k: v for k, v in kwargs.items() if k != "out"})
            atomic_save({"ok": True, **value}, mode_result_path(kwargs["out"], mode.name, info.rank))
            done[mode.name] = {"ok": True}  # kept on disk: reported even if this rank is stopped in a later mode
        except Exception as err:  # noqa: BLE001 (reported per mode; a broken process group ends the rest)
            done[mode.name] = {"ok": False, "error": named_timeout(err, kwargs["timeout_s"]),
                               "last_collective": flight_recorder_last()}
            done[STOP_PEERS] = True  # a peer may wait in a collective of this mode: stop it now
            break
        previous = mode.name
    return done


def _resolve_modes(names: Sequence[str]) -> tuple[list[Mode], dict[str, str]]:
    from gputrain.strategies import available

    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"parity mode(s) {', '.join(unknown)} unknown; choose from {', '.join(MODES)}")
    skipped = {n: f"strategy {MODES[n].strategy} is not available in this installation (gputrain.strategies)"
               for n in names if not available(MODES[n].strategy)}
    run = [MODES[n] for n in ["single", *names] if n not in skipped]
    return list(dict.fromkeys(run)), skipped


def check_parity(build: Callable[[], Any], cfg: RunConfig | None = None, *, modes: Sequence[str] = tuple(MODES),
                 global_batch: int | None = None, steps: int = 2, epochs: int = 2, tol: float = 1e-5,
                 timeout_s: float = 60.0, dtype: str = "float64", mode_hooks: dict[str, list[Hook]] | None = None,
                 name: str = "", progress: Progress | None = None) -> ParityReport:
    """Run ``build``'s task in each mode for ``steps`` optimizer steps a epoch over ``epochs`` epochs; compare with single.

    ``build()`` returns a :class:`~gputrain.tasks.spec.TaskSpec` (model, train data, task); it must be a
    module-level function (or a ``functools.partial`` of one), because the 2-process modes import it in
    spawned workers. ``cfg`` gives the optimizer, schedule, seed and trainer options such as
    ``sync_batchnorm``; its strategy, devices and batch size are set per mode. ``global_batch``
    defaults to ``cfg.trainer.batch_size`` and must be even. ``mode_hooks`` adds hooks to one mode
    only (to reproduce a bug in it). ``dtype`` float64 (default) compares the modes' arithmetic without
    float32 rounding noise; float32 compares them as they train.
    """
    cfg = cfg or RunConfig()
    g = global_batch or cfg.trainer.batch_size
    if g < 2 or g % 2:
        raise ValueError(f"parity needs an even global batch of at least 2 (it is split over 2 ranks and 2 "
                         f"micro-batches); got {g}: set --global-batch or trainer.batch_size")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    if steps < 1 or epochs < 1:
        raise ValueError(f"--steps {steps} and --epochs {epochs} must be at least 1")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_workers=0))  # reads seen in-process
    run, skipped = _resolve_modes(modes)
    accelerator = "cuda" if cfg.trainer.accelerator != "cpu" and torch.cuda.device_count() >= 2 else "cpu"
    results: dict[str, ModeResult] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gputrain-parity-") as tmp:
        kwargs = dict(global_batch=g, steps=steps, epochs=epochs, out=tmp, accelerator=accelerator,
                      timeout_s=timeout_s, dtype=dtype)
        progress = progress or Silent()
        # A stage per mode in this process and per launch of ranks (one runs every multi-rank mode, one after
        # another; a mode after a failed one is retried in another launch, which adds a stage).
        progress.total = sum(m.processes == 1 for m in run) + any(m.processes > 1 for m in run)
        for mode in [m for m in run if m.processes == 1]:
            progress.stage(f"mode {mode.name}: {steps} steps x {epochs} epochs in this process")
            results[mode.name] = _in_process(build, cfg, mode, kwargs, (mode_hooks or {}).get(mode.name, ()))
        pending = [m for m in run if m.processes > 1]
        launch = 0
        while pending:  # each launch in a folder of its own: a mode retried after another failed starts clean
            launch += 1
            kwargs["out"] = f"{tmp}/launch{launch}"
            progress.stage(f"mode{'s' if len(pending) > 1 else ''} {', '.join(m.name for m in pending)}: on "
                           f"{max(m.processes for m in pending)} ranks, one after another",
                           total=progress.done + 1)
            outcomes = run_on_ranks(_parity_ranks, build, cfg, pending, kwargs, mode_hooks or {},
                                    devices=max(m.processes for m in pending), accelerator=accelerator,
                                    timeout_s=timeout_s)
            finished = collect_outcomes(outcomes, pending, results, str(kwargs["out"]))
            pending = pending[finished:]
    wall = time.perf_counter() - start
    if not name:
        name = str(cfg.task) if isinstance(build, functools.partial) else \
            f"{getattr(build, '__module__', '?')}:{getattr(build, '__qualname__', build)}"
    return compare(results, skipped, [m.name for m in run] + list(skipped), modes=MODES, global_batch=g,
                   steps=steps, epochs=epochs, tol=tol, wall_s=wall, name=name)


def _in_process(build: Callable[[], Any], cfg: RunConfig, mode: Mode, kwargs: dict[str, Any],
                hooks: Sequence[Hook]) -> ModeResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: the same kernels and reduction order in every mode
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the per-run "gputrain: strategy=..." lines
            value = run_mode(build, cfg, mode, hooks=hooks, **{**kwargs, "out": f"{kwargs['out']}/{mode.name}"})
        return ModeResult.from_ranks(mode.name, [value])
    except Exception as err:  # noqa: BLE001 (a mode that fails is a finding, not a crash of parity)
        return ModeResult(mode.name, ok=False, error=one_line(err))
    finally:
        torch.set_num_threads(threads)


def cmd_parity(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    cfg = load_config(args.recipe, list(args.overrides))
    with Progress("gputrain parity") as progress:
        report = check_parity(functools.partial(build_from_config, cfg), cfg, modes=args.modes,
                              global_batch=args.global_batch, steps=args.steps, epochs=args.epochs, tol=args.tol,
                              timeout_s=args.timeout, dtype=args.dtype, name=args.recipe, progress=progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 1 if report.failed else 0
