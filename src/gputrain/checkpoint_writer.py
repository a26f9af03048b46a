"""Checkpoints off the critical path: the step copies the state, a background thread writes it.

:meth:`CheckpointWriter.save` returns as soon as the state is a private copy: CPU tensors are copied
(the next optimizer step updates parameters and optimizer buffers in place, so a reference would be
written half old, half new), CUDA tensors are copied into pinned host buffers with non-blocking
copies ordered on the current stream (the next step's kernels queue behind them, so the host does not
wait), and containers are rebuilt, so nothing the loop holds is shared with the writer. The host
buffers of one save are reused by the next where shapes match: a fresh 135 MB copy faults its pages in
from the kernel, which made the copy take 2-4 times as long as copying into memory already mapped. A thread then
serialises, checksums, fsyncs and commits the manifest through
:meth:`~gputrain.checkpoint.CheckpointStore.save`, whose crash order is unchanged: a SIGKILL while the
thread writes leaves the previous checkpoint valid and the new one as a hidden temporary only.

At most one save is in flight: the next :meth:`save` waits for it, and so do :meth:`wait` (the end of
training, a signal's stop, a diverged run). An error in the thread is kept and raised there as
:class:`CheckpointWriteError`, one line naming the file, so a failed save is never lost. With
``asynchronous=False`` the same object writes in the caller's thread (``trainer.async_checkpoint=false``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint import CheckpointStore
from gputrain.checkpoint_io import check_plain


class CheckpointWriteError(ValueError):
    """A checkpoint written in the background failed; raised at the next save or at the end of training.

    A ``ValueError`` so the command line prints it as one line; it exits 1 (a failed run), not 2.
    """

    exit_code = 1


class CheckpointWriter:
    """Writes a :class:`CheckpointStore`'s checkpoints, in a background thread when ``asynchronous``."""

    def __init__(self, store: CheckpointStore, *, asynchronous: bool = True) -> None:
        self.store = store
        self.asynchronous = asynchronous
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._writing: Path | None = None
        self._buffers: list[torch.Tensor] = []  # host buffers of the previous save, reused when shapes match

    @property
    def idle(self) -> bool:
        """No save was handed to the thread since the last :meth:`wait` (or :meth:`save`) collected it."""
        return self._thread is None

    def save(self, state: dict[str, Any], *, name: str, metrics: dict[str, float] | None = None) -> Path:
        """Write ``state`` as :meth:`CheckpointStore.save` does; returns the path it will have once written.

        Waits for the previous save first (raising its error, if it failed). Entries that
        ``torch.load(weights_only=True)`` would refuse are refused here, in the caller's thread.
        """
        self.wait()
        if not self.asynchronous:
            return self.store.save(state, name=name, metrics=metrics)
        check_plain(state)
        path = self.store.path_for(name)
        snapshot, ready = self._snapshot(state)
        self._writing = path
        self._thread = threading.Thread(target=self._write, args=(self.store, snapshot, ready, name, dict(metrics or {})),
                                        name="gputrain-checkpoint-writer", daemon=True)
        self._thread.start()
        return path

    def wait(self) -> None:
        """Block until the save in flight is on disk; raise :class:`CheckpointWriteError` if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            kept = self.store.latest_valid()
            raise CheckpointWriteError(
                f"checkpoint {self._writing} was not written ({type(error).__name__}: {str(error).splitlines()[0]}); "
                f"{f'{kept} is the newest whole one' if kept else 'no earlier checkpoint exists'}; fix the cause "
                "(disk space, permissions of the folder) and resume, or set trainer.async_checkpoint=false to fail "
                "at the step that saves"
            ) from error

    def _write(self, store: CheckpointStore, state: dict[str, Any], ready: Any, name: str,
               metrics: dict[str, float]) -> None:
        try:
            if ready is not None:
                ready.synchronize()  # the device-to-host copies queued by _snapshot have landed
            store.save(state, name=name, metrics=metrics or None)
        except BaseException as err:  # noqa: BLE001  (kept for wait(), which raises it in the loop's thread)
            self._error = err

    def _snapshot(self, state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """A private copy of ``state``, and a CUDA event the copies complete at (None when all were CPU)."""
        memo: dict[int, torch.Tensor] = {}  # a tensor listed twice (tied weights) stays one tensor
        previous, self._buffers = self._buffers, []
        on_cuda = False

        def copy(obj: Any) -> Any:
            nonlocal on_cuda
            if isinstance(obj, torch.Tensor):
                if id(obj) not in memo:
                    on_cuda = on_cuda or obj.device.type == "cuda"
                    memo[id(obj)] = self._into_buffer(obj.detach(), previous)
                return memo[id(obj)]
            if isinstance(obj, dict):
                return {k: copy(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [copy(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(copy(v) for v in obj)
            return obj  # numbers, strings, None, dtypes: immutable

        snapshot = copy(state)
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return snapshot, ready

    def _into_buffer(self, tensor: torch.Tensor, previous: list[torch.Tensor]) -> torch.Tensor:
        """Copy ``tensor`` into a host buffer, the previous save's where it fits; pinned, without blocking, for CUDA."""
        index, cuda = len(self._buffers), tensor.device.type == "cuda"
        old = previous[index] if index < len(previous) else None
        fits = (old is not None and (old.shape, old.stride(), old.dtype) == (tensor.shape, tensor.stride(), tensor.dtype)
                and (not cuda or old.is_pinned()))
        buffer = old if fits and old is not None else torch.empty_like(tensor, device="cpu", pin_memory=cuda)
        buffer.copy_(tensor, non_blocking=cuda)
        self._buffers.append(buffer)
        return buffer
