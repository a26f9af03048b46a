"""Checkpoints off the critical path: the step copies the state, a background thread writes the copy.

:meth:`CheckpointWriter.save` returns once nothing the loop does next can change what will be written: every
tensor is copied into a host buffer of the writer's, CUDA tensors into pinned memory with non-blocking copies
ordered on the current stream (the next step's kernels queue behind them, so the host does not wait). The
buffers of one save are reused by the next where shapes match: a fresh copy faults its pages in from the kernel,
which made the copy take 2-4 times as long as copying into memory already mapped. The thread serialises,
checksums, fsyncs and commits through :meth:`~gputrain.checkpoint.store.CheckpointStore.save`, whose crash order
is unchanged: a SIGKILL while the thread writes leaves the previous checkpoint valid and the new one as a hidden
temporary only.

At most one save is in flight: the next :meth:`save` waits for it, and so do :meth:`wait` (the end of training, a
signal's stop, a diverged run). An error in the thread is kept and raised there as :class:`CheckpointWriteError`,
one line naming the file, so a failed save is never lost. With ``asynchronous=False`` the same object writes in
the caller's thread (``trainer.async_checkpoint=false``).
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint import files
from gputrain.checkpoint.files import Write, check_plain, tensors_finite
from gputrain.checkpoint.store import CheckpointStore


class CheckpointWriteError(ValueError):
    """A checkpoint written in the background failed; raised at the next save or at the end of training.

    A ``ValueError`` so the command line prints it as one line; it exits 1 (a failed run), not 2.
    """

    exit_code = 1


class _NotFinite(Exception):  # noqa: N818  (not an error of the run: that save is skipped, with a warning)
    """The snapshot holds NaN or inf: it must not replace a good checkpoint."""

    def __init__(self) -> None:
        super().__init__("its weights or optimizer state hold NaN/inf; the newest written checkpoint is kept, and "
                         "the run stops at its next check of the loss or the weights")


class CheckpointWriter:
    """Writes a :class:`CheckpointStore`'s checkpoints, in a background thread when ``asynchronous``."""

    def __init__(self, store: CheckpointStore, *, asynchronous: bool = True, write: Write | None = None) -> None:
        self.store = store
        self.asynchronous = asynchronous
        self.write = write or files.write_temporary
        """How a file is written (:func:`~gputrain.checkpoint.files.write_temporary`; a test gives its own)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._writing: Path | None = None
        self._buffers: list[torch.Tensor] = []  # host buffers of the previous save, reused when shapes match
        self._warned_not_finite = False

    @property
    def idle(self) -> bool:
        """No save was handed to the thread since the last :meth:`wait` (or :meth:`save`) collected it."""
        return self._thread is None

    def save(self, state: dict[str, Any], *, name: str, metrics: dict[str, float] | None = None,
             check_finite: bool = False, after: Future[Any] | None = None) -> Path:
        """Write ``state`` as :meth:`CheckpointStore.save` does; returns the path it will have once written.

        Waits for the previous save first (raising its error, if it failed). Entries that
        ``torch.load(weights_only=True)`` would refuse are refused here, in the caller's thread.

        ``check_finite``: the thread checks the copy it writes for NaN/inf and, if it finds any, skips the save with
        one warning line (the caller's own checks end the run); the check costs the step nothing.
        ``after``: a future the file must wait for before it is committed (a sharded checkpoint's DCP folder).
        """
        self.wait()
        check_plain(state)
        self._writing = self.store.path_for(name)
        if not self.asynchronous:
            if after is not None:
                after.result()
            return self.store.save(state, name=name, metrics=metrics, write=self.write)
        snapshot, ready = self._snapshot(state)
        thread = threading.Thread(target=self._write_in_background,
                                  args=(snapshot, ready, after, name, dict(metrics or {}), check_finite),
                                  name="gputrain-checkpoint-writer", daemon=True)
        thread.start()
        self._thread = thread
        return self._writing

    def wait(self) -> None:
        """Block until the save in flight is on disk; raise :class:`CheckpointWriteError` if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join()  # idle stays False until the save is on disk, also when a Ctrl-C lands in this join
        self._thread = None
        error, self._error = self._error, None
        if isinstance(error, _NotFinite):
            if not self._warned_not_finite:  # once: every later save of a diverged run would say the same
                self._warned_not_finite = True
                print(f"gputrain: warning: checkpoint {self._writing} was not written: {error}", file=sys.stderr,
                      flush=True)
            return
        if error is not None:
            kept = self.store.latest_valid()
            raise CheckpointWriteError(
                f"checkpoint {self._writing} was not written ({type(error).__name__}: {str(error).splitlines()[0]}); "
                f"{f'{kept} is the newest whole one' if kept else 'no earlier checkpoint exists'}; fix the cause "
                "(disk space, permissions of the folder) and resume, or set trainer.async_checkpoint=false to fail "
                "at the step that saves"
            ) from error

    def close(self) -> None:
        """Let the save in flight finish (its error, if any, stays for :meth:`wait`) and free the host buffers."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self._buffers = []

    def _write_in_background(self, state: dict[str, Any], ready: Any, after: Future[Any] | None, name: str,
                             metrics: dict[str, float], check_finite: bool) -> None:
        try:
            if ready is not None:
                ready.synchronize()  # the device-to-host copies queued by _snapshot have landed
            if check_finite and not tensors_finite([t for t in self._buffers if t.is_floating_point()]):
                raise _NotFinite
            if after is not None:
                after.result()  # the shards the file names are written (or their error is raised here)
            self.store.save(state, name=name, metrics=metrics or None, write=self.write)
        except BaseException as err:  # noqa: BLE001  (kept for wait(), which raises it in the loop's thread)
            self._error = err

    def _snapshot(self, state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """A private copy of ``state`` in host buffers, and a CUDA event the copies complete at (None: all CPU)."""
        index: dict[int, int] = {}  # a tensor listed twice (tied weights) stays one tensor
        sources: list[torch.Tensor] = []
        _walk_tensors(state, index, sources)
        previous = self._buffers
        self._buffers = [old if i < len(previous) and _fits(old := previous[i], source)
                         else torch.empty_like(source, device="cpu", pin_memory=source.device.type == "cuda")
                         for i, source in enumerate(sources)]
        on_cuda = False
        for source, buffer in zip(sources, self._buffers, strict=True):
            on_cuda = on_cuda or source.device.type == "cuda"
            buffer.copy_(source, non_blocking=source.device.type == "cuda")
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return _replace_tensors(state, index, self._buffers), ready


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``buffer`` can hold a copy of ``source``: same shape and type, pinned for a CUDA source, and the
    strides a new buffer would get (the source's where it is dense, else contiguous: a view of a bigger tensor)."""
    if (buffer.shape, buffer.dtype) != (source.shape, source.dtype) or (
            source.device.type == "cuda" and not buffer.is_pinned()):
        return False
    return buffer.stride() == source.stride() or buffer.stride() == torch.empty_like(source, device="meta").stride()


def _walk_tensors(obj: Any, index: dict[int, int], sources: list[torch.Tensor]) -> None:
    """Each distinct tensor of ``obj`` once, detached, in walk order; ``index`` maps its id to its place."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in index:
            index[id(obj)] = len(sources)
            sources.append(obj.detach())
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            _walk_tensors(value, index, sources)


def _replace_tensors(obj: Any, index: dict[int, int], buffers: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by its buffer; containers rebuilt, so nothing is shared with the caller."""
    if isinstance(obj, torch.Tensor):
        return buffers[index[id(obj)]]
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, index, buffers) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_tensors(v, index, buffers) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_replace_tensors(v, index, buffers) for v in obj)
    return obj  # numbers, strings, None, dtypes: immutable
