"""The one facade the engine calls: save a checkpoint (a collective), wait for it, and find what a run resumes from.

Saving: nothing NaN/inf is ever written, so a diverged run never replaces a good checkpoint. A synchronous save
checks on every rank and the ranks agree before anything is written; a background save has the writer thread
check the copy it writes (rank 0's full state). The state is gathered through the strategy (sharded strategies
gather collectively) and written by rank 0 through the :class:`~gputrain.checkpoint.store.CheckpointStore`
(atomic, checksummed, rotated); with ``parallel.sharded_checkpoint`` each rank writes its shards into a DCP folder
first, and the small file naming the folder is committed only once the folder is whole.

Resuming: rank 0 alone decides which checkpoint (``--resume auto`` takes the newest valid one) and tells the
others; every rank must be able to read that file.
"""

from __future__ import annotations

import math
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint.files import Write, remove_stale_temporaries
from gputrain.checkpoint.load import load_checkpoint
from gputrain.checkpoint.snapshot import CheckpointWriteError, CheckpointWriter
from gputrain.checkpoint.state import Parts, TrainState, all_finite, checkpoint_state
from gputrain.checkpoint.store import CheckpointStore
from gputrain.config.schema import TrainerConfig
from gputrain.dist import DistInfo, comm
from gputrain.errors import NonFiniteError


class Checkpointer:
    """One run's checkpoints in ``folder``: :meth:`save` on every rank, :meth:`wait` before the run ends."""

    def __init__(self, folder: Path, trainer: TrainerConfig, dist: DistInfo, *, sharded: bool = False,
                 write: Write | None = None) -> None:
        self.store = CheckpointStore(folder, keep_last=trainer.keep_last, monitor=trainer.monitor,
                                     monitor_mode=trainer.monitor_mode)
        self.writer = CheckpointWriter(self.store, asynchronous=bool(trainer.async_checkpoint), write=write)
        self.dist = dist
        self.sharded = sharded
        self._shards: Future[Any] | None = None  # the DCP folder of the save in flight, on every rank
        self._write_group: Any = None  # the gloo group of background sharded saves, made at the first one
        if dist.is_main:
            remove_stale_temporaries(folder)
            if sharded:
                from gputrain.checkpoint.sharded import remove_uncommitted_folders

                remove_uncommitted_folders(folder)

    @property
    def mode(self) -> str:
        """How checkpoints are written, as the start-up line says it."""
        return "background" if self.writer.asynchronous else "synchronous"

    def save(self, parts: Parts, extra: dict[str, Any], progress: TrainState, name: str,
             metrics: dict[str, float] | None = None, *, wait: bool = False) -> Path | None:
        """Write checkpoint ``name`` (rank 0) unless anything in it is NaN/inf; a collective. Returns its path.

        In the background (``trainer.async_checkpoint``) the writer thread checks what it writes, which costs the
        step nothing; otherwise, and with ``wait`` (a signal's stop, which returns only once the file is on disk),
        every rank checks first and :class:`~gputrain.errors.NonFiniteError` is raised if anything is not finite.
        """
        in_background = self.writer.asynchronous and not wait
        loss = (metrics or {}).get("train/loss")
        if not (all_finite(parts, loss) if not in_background else loss is None or math.isfinite(loss)):
            raise self.non_finite("the loss, weights or optimizer state", progress)
        parts.strategy.prepare_eval(parts.module)  # rank 0's buffers are the ones saved: all ranks adopt them
        self._wait_for_shards()
        folder_name, after = "", None
        if self.sharded:
            from gputrain.checkpoint.sharded import new_write_group, save_sharded, save_sharded_async

            # A new folder per save (never one rewritten in place): a crash mid-write leaves the previous
            # checkpoint and its folder whole. Folders no checkpoint file names any more are pruned.
            folder_name = f"{name or f'step_{progress.global_step:06d}'}.dcp"
            folder = self.store.folder / folder_name
            if in_background:
                if self._write_group is None:
                    self._write_group = new_write_group()
                self._shards = after = save_sharded_async(parts.strategy, parts.module, parts.optimizer, folder,
                                                          self._write_group, parts.ema)
            else:
                save_sharded(parts.strategy, parts.module, parts.optimizer, folder, parts.ema)
                comm.barrier()
        state = checkpoint_state(parts, extra, folder_name)
        path, failed = None, None
        if self.dist.is_main:
            try:
                self.writer.wait()  # the previous save's error surfaces here, before this one is handed over
                path = self.writer.save(state, name=name, metrics=metrics, check_finite=in_background, after=after)
                if self.sharded:
                    from gputrain.checkpoint.sharded import prune_sharded_folders

                    prune_sharded_folders(self.store.folder, keep=folder_name)
                if wait:
                    self.writer.wait()
            except Exception as err:  # noqa: BLE001  (every rank must hear of it: raised below, after the agreement)
                failed = err
        _agree_on_the_write(self.dist, failed)
        return path

    def wait(self) -> None:
        """Until every save handed over is on disk (every rank: a sharded one's folder too); its error raised."""
        self._wait_for_shards()
        if self.dist.is_main:
            self.writer.wait()

    def close(self) -> None:
        """The end of the run, whatever happened: the save in flight finishes, its error kept for :meth:`wait`."""
        self._wait_for_shards()
        self.writer.close()
        if self.sharded and self.dist.is_main:  # the last saves' rotation may have left folders no file names
            from gputrain.checkpoint.sharded import prune_sharded_folders

            prune_sharded_folders(self.store.folder)

    def non_finite(self, what: str, progress: TrainState, fix: str = "") -> NonFiniteError:
        """The error that ends a diverged run, naming the newest whole checkpoint, which is kept (a collective)."""
        self.writer.wait()  # the save in flight (finite: it was checked) counts as the last good one
        last = self.store.latest_valid() if self.dist.is_main else None
        return non_finite_error(what, progress, str(comm.broadcast_object(str(last) if last else "")), fix)

    def _wait_for_shards(self) -> None:
        shards, self._shards = self._shards, None
        if shards is None:
            return
        try:
            shards.result()
        except Exception as err:  # noqa: BLE001  (rank 0's writer raises it for all, through the agreement)
            if not self.dist.is_main:
                print(f"gputrain: warning: rank {self.dist.rank} could not write its shards: {err}", file=sys.stderr)


def non_finite_error(what: str, progress: TrainState, last: str, fix: str = "") -> NonFiniteError:
    kept = f"the last good checkpoint, {last}, is kept" if last else "no checkpoint had been written"
    err = NonFiniteError(
        f"{what} became NaN/inf at epoch {progress.epoch + 1} step {progress.global_step}; nothing non-finite was "
        f"written ({kept}); {fix or 'lower optim.lr or set trainer.grad_clip_norm'}"
    )
    err.head = f"{what} became NaN/inf at epoch {progress.epoch + 1} step {progress.global_step}"
    err.kept = f"nothing non-finite was written ({kept})"
    return err


def _agree_on_the_write(dist: DistInfo, failed: Exception | None) -> None:
    """The collective every rank meets after a save, carrying whether rank 0's write failed.

    A failed write shows on rank 0 only: the synchronous one at once, the background one at the next save. Rank 0
    alone raising would leave the other ranks waiting in their next collective: over gloo until they notice the
    lost connection, over NCCL until the launcher's SIGTERM and SIGKILL. Now every rank raises the same one line.
    """
    if dist.world_size == 1:
        if failed is not None:
            raise failed
        return
    flag = torch.tensor([0.0 if failed is None else 1.0], device=dist.device)
    if not comm.all_reduce(flag, op="max").item():
        return
    line = ""
    if failed is not None:
        first = (str(failed).splitlines() or [""])[0]
        line = first if isinstance(failed, CheckpointWriteError) else (
            f"a checkpoint was not written on rank 0 ({type(failed).__name__}: {first}); fix the cause (disk space, "
            "permissions of the folder) and resume")
    line = comm.broadcast_object(line)
    if failed is not None:
        raise failed
    raise CheckpointWriteError(line)


def resume_from(where: str, store: CheckpointStore, dist: DistInfo) -> dict[str, Any] | None:
    """The checkpoint a run continues from, read on every rank, or None for a fresh start (a collective).

    Rank 0 picks it (``auto``: the newest whole one in ``store``, saying so when there is none) and every rank
    must be able to read it.
    """
    choice = ""
    if dist.is_main:
        if where == "auto":
            found = store.resume_path()
            choice = str(found) if found else ""
            if not found:  # a mistyped --out in a requeue script must not retrain from zero unnoticed
                print(f"gputrain: --resume auto found no checkpoint in {store.folder}; a new run starts", flush=True)
        else:
            choice = where
    path = str(comm.broadcast_object(choice))
    readable = comm.all_gather_objects(Path(path).is_file() if path else True)
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

