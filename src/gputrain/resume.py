"""One home for what a checkpoint of a run holds, when it may be written, and how a run resumes from one.

Saving: nothing NaN/inf is ever written, so a diverged run never replaces a good checkpoint. A synchronous
save checks on every rank and the ranks agree before anything is written; a background save has the writer
thread check the copy it writes (rank 0's full state). The state is gathered through the strategy (sharded
strategies gather collectively) and written by rank 0 through the
:class:`~gputrain.checkpoint.CheckpointStore` (atomic, checksummed, rotated).

Resuming: rank 0 alone decides which checkpoint (``--resume auto`` takes the newest valid one)
and tells the others; every rank must be able to read that file, and all must end up at the same
step. A run resumed on another number of processes keeps the global batch, so it continues the
same sequence of steps (see :mod:`gputrain.data.samplers`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gputrain.checkpoint import load_checkpoint, rng_state, set_rng_state
from gputrain.checkpoint_io import tensors_finite
from gputrain.checkpoint_writer import CheckpointWriteError
from gputrain.errors import NonFiniteError
from gputrain.loop_state import TrainState

if TYPE_CHECKING:
    from gputrain.loop import Trainer


def checkpoint_store(trainer: Trainer) -> Any:
    """The run's checkpoint folder as a store, also when this run writes none (to find one to resume)."""
    from gputrain.checkpoint import CheckpointStore

    if trainer.checkpoints is not None:
        return trainer.checkpoints
    t = trainer.cfg.trainer
    return CheckpointStore(trainer.out / "checkpoints", keep_last=t.keep_last, monitor=t.monitor,
                           monitor_mode=t.monitor_mode)


def all_finite(trainer: Trainer, loss: float | None = None) -> bool:
    """Whether loss, weights, buffers and optimizer state are finite on every rank (a collective)."""
    local_ok = tensors_finite([t for t in trainer.strategy.local_tensors(trainer.module, trainer.optimizer)
                               if t.is_floating_point() or t.is_complex()])
    if loss is not None and not torch.isfinite(torch.tensor(loss)):
        local_ok = False
    bad = torch.tensor([0.0 if local_ok else 1.0], device=trainer.strategy.root_device)
    return float(trainer.strategy.all_reduce(bad, op="max")) == 0.0


def raise_non_finite(trainer: Trainer, what: str) -> None:
    store = trainer.checkpoints
    if trainer.checkpoint_writer is not None:
        trainer.checkpoint_writer.wait()  # the save in flight (finite: it was checked) counts as the last good one
    last = store.latest_valid() if store is not None and trainer.dist.is_main else None
    last = trainer.strategy.broadcast_object(str(last) if last else "")
    kept = f"the last good checkpoint, {last}, is kept" if last else "no checkpoint had been written"
    raise NonFiniteError(
        f"{what} became NaN/inf at epoch {trainer.state.epoch + 1} step {trainer.state.global_step}; nothing "
        f"non-finite was written ({kept}); lower optim.lr or set trainer.grad_clip_norm"
    )


def checkpoint_state(trainer: Trainer, sharded: str = "") -> dict[str, Any]:
    """Everything needed to continue the run exactly; plain containers and tensors only (a collective).

    With ``sharded`` (a DCP folder name beside the file), model and optimizer are in that folder instead.
    """
    gathered = trainer.strategy.gather_objects(rng_state())
    weights: dict[str, Any] = {"model": {}, "optimizer": {}, "sharded": sharded} if sharded else {
        "model": trainer.strategy.model_state_dict(trainer.module),
        "optimizer": trainer.strategy.optimizer_state_dict(trainer.module, trainer.optimizer),
    }
    return {
        **weights,
        "scheduler": trainer.scheduler.state_dict(),
        "precision": trainer.precision.state_dict(),
        "state": dataclasses.asdict(trainer.state),
        "rng": {str(rank): state for rank, state in enumerate(gathered)} if gathered else {},
        # The epoch's loss sums so far (a collective): a resumed epoch logs the uninterrupted run's train/loss.
        "loss_window": trainer.loss_window.carry() if trainer.loss_window is not None else {},
        "world_size": trainer.dist.world_size,
        "global_batch": trainer.global_batch,
        "config": trainer.config_dict,
    }


def save_checkpoint(trainer: Trainer, name: str, metrics: dict[str, float] | None = None, *,
                    wait: bool = False) -> Path | None:
    """Write checkpoint ``name`` (rank 0) unless anything in it is NaN/inf (a collective).

    With ``trainer.async_checkpoint`` the file is written in the background (returns its future path) and the
    writer thread checks what it writes; otherwise, and with ``wait`` (a signal's stop, which returns only once
    the file is on disk), all ranks agree that everything is finite first and raise ``NonFiniteError`` if not.
    """
    store = trainer.checkpoints
    if store is None:
        return None
    # In the background the writer thread checks the copy it writes, which costs the step nothing (6 ms of 72
    # for ResNet-18 at 16x16 on a CPU, and a host sync on a GPU); a non-finite copy is skipped with a warning
    # and the run fails at its next loss or end-of-epoch check. Otherwise every rank checks before writing.
    in_background = trainer.checkpoint_writer.asynchronous and not wait
    loss = (metrics or {}).get("train/loss")
    if not (all_finite(trainer, loss) if not in_background else loss is None or math.isfinite(loss)):
        raise_non_finite(trainer, "the loss, weights or optimizer state")
    trainer.strategy.prepare_eval(trainer.module)  # rank 0's buffers are the ones saved: all ranks adopt them
    sharded = ""
    if trainer.cfg.parallel.sharded_checkpoint:
        from gputrain.strategies.fsdp_checkpoint import save_sharded

        # A new folder per save (never last.dcp rewritten in place): a crash mid-write leaves the
        # previous checkpoint and its folder whole. Folders no checkpoint file names any more are pruned.
        sharded = f"{name or f'step_{trainer.state.global_step:06d}'}.dcp"
        save_sharded(trainer.strategy, trainer.module, trainer.optimizer, store.folder / sharded)
        trainer.strategy.barrier()
    state = checkpoint_state(trainer, sharded)
    path, failed = None, None
    if trainer.dist.is_main:
        # What a forward pass may change in place (buffers such as BatchNorm statistics, frozen parameters) is
        # copied now; the writer thread copies the rest while the next step's forward and backward run, and
        # the loop settles the writer before the optimizer step changes them (Trainer._call).
        module = trainer.module
        volatile = [*module.buffers(), *(p for p in module.parameters() if not p.requires_grad)]
        try:
            path = trainer.checkpoint_writer.save(state, name=name, metrics=metrics, volatile=volatile,
                                                  check_finite=in_background)
            if wait:
                trainer.checkpoint_writer.wait()
        except Exception as err:  # noqa: BLE001  (every rank must hear of it: raised below, after the agreement)
            failed = err
    if sharded and trainer.dist.is_main and failed is None:
        _prune_sharded_folders(store.folder)
    _agree_on_the_write(trainer, failed)
    return path


def _agree_on_the_write(trainer: Trainer, failed: Exception | None) -> None:
    """The collective every rank meets after a save (a barrier before), carrying whether rank 0's write failed.

    A failed write shows on rank 0 only: the synchronous one at once, the background one at the next save. Rank 0
    alone raising would leave the other ranks waiting in their next collective: over gloo until they notice the lost
    connection, over NCCL until the launcher's SIGTERM and SIGKILL. Now every rank raises the same one line at once.
    """
    if trainer.dist.world_size == 1:
        if failed is not None:
            raise failed
        return
    flag = torch.tensor([0.0 if failed is None else 1.0], device=trainer.strategy.root_device)
    if not trainer.strategy.all_reduce(flag, op="max").item():
        return
    line = ""
    if failed is not None:
        first = (str(failed).splitlines() or [""])[0]
        line = first if isinstance(failed, CheckpointWriteError) else (
            f"a checkpoint was not written on rank 0 ({type(failed).__name__}: {first}); fix the cause (disk space, "
            "permissions of the folder) and resume")
    line = trainer.strategy.broadcast_object(line)
    if failed is not None:
        raise failed
    raise CheckpointWriteError(line)


def _prune_sharded_folders(folder: Path) -> None:
    """Delete DCP folders that no checkpoint file in ``folder`` refers to (rotated away)."""
    import shutil

    import torch

    used = set()
    for pt in folder.glob("*.pt"):
        try:
            used.add(torch.load(pt, map_location="cpu", weights_only=True).get("sharded", ""))
        except Exception:  # noqa: BLE001  (a damaged file refers to nothing we can trust)
            continue
    for dcp_folder in folder.glob("*.dcp"):
        if dcp_folder.name not in used:
            shutil.rmtree(dcp_folder, ignore_errors=True)


def _choose(trainer: Trainer, where: str) -> str:
    """Rank 0 picks the checkpoint; every rank gets its path ('' when there is nothing to resume)."""
    choice = ""
    if trainer.dist.is_main:
        if where == "auto":
            store = checkpoint_store(trainer)
            found = store.resume_path()
            choice = str(found) if found else ""
            if not found:  # a mistyped --out in a requeue script must not retrain from zero unnoticed
                print(f"gputrain: --resume auto found no checkpoint in {store.folder}; a new run starts", flush=True)
        else:
            choice = where
    return str(trainer.strategy.broadcast_object(choice))


def load_resume_state(trainer: Trainer, where: str) -> dict[str, Any] | None:
    """The checkpoint this run continues from, read on every rank, or None for a fresh start."""
    path = _choose(trainer, where)
    readable = trainer.strategy.all_gather_objects(Path(path).is_file() if path else True)
    missing = [rank for rank, ok in enumerate(readable) if not ok]
    if missing:
        raise ValueError(
            f"rank(s) {missing} cannot read {path}, the checkpoint rank 0 resumes from; put --out on storage every "
            "node can read, or copy the run folder to each node before resuming"
        )
    if not path:
        return None
    # On the CPU: a sharded strategy shards from it, and a replicated one copies it to its device anyway.
    return load_checkpoint(path, map_location="cpu") | {"_path": path}


def resumed_line(path: str, state: TrainState) -> str:
    """Where a resumed run continues: the epoch (1-based), the step within it and the global step, each named."""
    where = (f"epoch {state.epoch + 1}, after step {state.step_in_epoch} of that epoch" if state.step_in_epoch
             else f"the start of epoch {state.epoch + 1}")
    return f"gputrain: resumed from {path} at {where} (global step {state.global_step})"


def resumed_batch_size(saved_global_batch: int, dp_size: int, accumulate: int, batch_size: int,
                       path: str) -> int:
    """The per-device batch that keeps the checkpoint's global batch on this many data-parallel ranks."""
    if saved_global_batch == batch_size * dp_size * accumulate:
        return batch_size
    if saved_global_batch % (dp_size * accumulate):
        counts = [n for n in range(1, min(saved_global_batch, 64) + 1) if saved_global_batch % (n * accumulate) == 0]
        raise ValueError(
            f"checkpoint {path} was trained with global batch {saved_global_batch}, which {dp_size} process(es) x "
            f"accumulation {accumulate} cannot split evenly; resume on {', '.join(map(str, counts))} process(es), "
            "or set trainer.accumulate_grad_batches so that it divides"
        )
    return saved_global_batch // (dp_size * accumulate)


def apply_resume_state(trainer: Trainer, state: dict[str, Any]) -> None:
    """Load model, optimizer, schedule, precision, RNG and position; all ranks must reach the same step."""
    path = state["_path"]
    saved_optim = state.get("config", {}).get("optim", {}).get("name", trainer.cfg.optim.name)
    if saved_optim != trainer.cfg.optim.name:
        raise ValueError(
            f"checkpoint {path} was trained with optim.name={saved_optim} but this run sets "
            f"optim.name={trainer.cfg.optim.name}; resume with the same optimizer, or load only the weights "
            "(model.kwargs.weights_path) to start a new run"
        )
    if state.get("sharded"):
        from gputrain.strategies.fsdp_checkpoint import load_sharded

        load_sharded(trainer.strategy, trainer.module, trainer.optimizer, Path(path).parent / state["sharded"])
    else:
        trainer.strategy.load_model_state_dict(trainer.module, state["model"])
        trainer.strategy.load_optimizer_state_dict(trainer.module, trainer.optimizer, state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.precision.load_state_dict(state.get("precision", {}))
    known = {f.name for f in dataclasses.fields(TrainState)}
    trainer.state = TrainState(**{k: v for k, v in state["state"].items() if k in known})
    trainer.carried_loss = state.get("loss_window") or None
    rng = state.get("rng", {})
    if state.get("world_size") == trainer.dist.world_size and str(trainer.dist.rank) in rng:
        set_rng_state(rng[str(trainer.dist.rank)])  # dropout continues its stream only on the same layout
    steps = trainer.strategy.all_gather_objects(trainer.state.global_step)
    if len(set(steps)) != 1:
        raise ValueError(f"ranks resumed at different steps {steps} from {path}; resume all ranks from one folder")
