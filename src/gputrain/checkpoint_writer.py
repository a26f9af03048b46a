"""Checkpoints off the critical path: the step hands the state over, a background thread writes it.

:meth:`CheckpointWriter.save` returns once nothing the loop does next can change what will be written.
CUDA tensors are copied into pinned host buffers with non-blocking copies ordered on the current stream
(the next step's kernels queue behind them, so the host does not wait). CPU tensors must be copied too (the
next optimizer step updates parameters and optimizer buffers in place, so a reference would be written half
old, half new), but not necessarily now: with ``volatile`` (what :func:`gputrain.resume.save_checkpoint`
passes) only the tensors a forward pass may change (buffers such as BatchNorm statistics, frozen parameters)
are copied in the step, and the thread copies the parameters and the optimizer state while the next step's
forward and backward run, which only read them. The loop calls :meth:`CheckpointWriter.settle` before the next
optimizer step (and before every hook): it waits for that copy and then checks each tensor's version counter,
which every in-place operation on it bumps (writes through ``.data`` or a NumPy view do not: such models need
``trainer.async_checkpoint=false``); a tensor changed in between (a model that writes a trainable parameter
in its forward) means the copy may mix two states, so that checkpoint is not committed, a one-line warning
names the tensor, and later saves copy everything in the step. Containers are always rebuilt in the step,
so nothing the loop holds is shared with the thread.

The host buffers of one save are reused by the next where shapes match: a fresh 135 MB copy faults its pages
in from the kernel, which made the copy take 2-4 times as long as copying into memory already mapped. The
thread serialises, checksums, fsyncs and commits the manifest through
:meth:`~gputrain.checkpoint.CheckpointStore.save`, whose crash order is unchanged: a SIGKILL while the
thread writes leaves the previous checkpoint valid and the new one as a hidden temporary only.

At most one save is in flight: the next :meth:`save` waits for it, and so do :meth:`wait` (the end of
training, a signal's stop, a diverged run). An error in the thread is kept and raised there as
:class:`CheckpointWriteError`, one line naming the file, so a failed save is never lost. With
``asynchronous=False`` the same object writes in the caller's thread (``trainer.async_checkpoint=false``).

With ``process=True`` (``trainer.checkpoint_process=true``, for a state that lives on the CPU) the host
buffers are cut from shared memory and the file itself is written by a writer process
(:mod:`gputrain.checkpoint_process`), so ``torch.save``'s pickling does not hold this process's GIL; the thread
still copies, waits for the process and commits. Until the process is ready (it imports torch first), for a state
the shared memory cannot hold (CUDA tensors, tensor subclasses), and after the process was lost (one warning
line), the thread writes the file itself: the same bytes either way.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gputrain.checkpoint import CheckpointStore
from gputrain.checkpoint_io import check_plain, tensors_finite, write_temporary
from gputrain.checkpoint_process import (
    NOT_FINITE,
    SharedHostMemory,
    WriterProcess,
    WriterProcessGone,
    WriterProcessRefused,
    shareable,
)


class CheckpointWriteError(ValueError):
    """A checkpoint written in the background failed; raised at the next save or at the end of training.

    A ``ValueError`` so the command line prints it as one line; it exits 1 (a failed run), not 2.
    """

    exit_code = 1


class _Skipped(Exception):  # noqa: N818  (not an error of the run: that save is skipped, with a warning)
    """The thread did not commit a save, on purpose; the message says why (printed once as a warning)."""


class _SnapshotChanged(_Skipped):
    """A tensor left to the writer thread was changed in place before :meth:`CheckpointWriter.settle`."""


class _NotFinite(_Skipped):
    """The snapshot holds NaN or inf: it must not replace a good checkpoint."""

    def __init__(self) -> None:
        super().__init__("its weights or optimizer state hold NaN/inf; the newest written checkpoint is kept, and "
                         "the run stops at its next check of the loss or the weights")


class _Deferred:
    """The CPU tensors of one save that the writer thread copies while the next step's forward and backward run."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (source, host buffer, source's version)
        self.copied = threading.Event()  # set by the thread once every source is in its buffer (or the copy failed)
        self.settled = threading.Event()  # set by settle(): the verdict below is final
        self.changed = ""  # the entry that changed before it was copied; the save must not be committed

    def copy(self) -> None:
        try:
            # One call, the GIL released for all of it: a Python loop of copy_ calls handed the GIL to and fro with
            # the training thread once per tensor.
            pairs = self.pairs
            if pairs:
                torch._foreach_copy_([buffer for _, buffer, _ in pairs], [source for source, _, _ in pairs])
        finally:
            self.copied.set()  # settle() never waits for a copy that failed: the error reaches wait()

    def before_commit(self) -> None:
        """Called by the store after the file is written and before it is committed: wait for the verdict."""
        self.settled.wait()
        if self.changed:
            raise _SnapshotChanged(self.changed)


class CheckpointWriter:
    """Writes a :class:`CheckpointStore`'s checkpoints, in a background thread when ``asynchronous``."""

    def __init__(self, store: CheckpointStore, *, asynchronous: bool = True, process: bool = False) -> None:
        self.store = store
        self.asynchronous = asynchronous
        self.defer_copies = True
        """Whether CPU tensors not named ``volatile`` are copied by the thread; turned off for the rest of the run
        once a deferred tensor was found changed before :meth:`settle`."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._writing: Path | None = None
        self._deferred: _Deferred | None = None  # copies the thread owes until the next settle()
        self._buffers: list[torch.Tensor] = []  # host buffers of the previous save, reused when shapes match
        self._pending_state: Any = None  # the snapshot in flight, to name an entry in settle()'s warning
        self._warned_not_finite = False
        self._use_process = asynchronous and process
        self._process: WriterProcess | None = None
        self._memory: SharedHostMemory | None = None  # the shared memory self._buffers were cut from, if any
        self.process_writes = 0
        """Saves whose file the writer process wrote (the others: this process's writer thread, or the caller)."""

    def start(self) -> None:
        """Start the writer process now, from the thread that trains (it dies with that thread), so that it has
        imported torch by the first saves; nothing without ``process``. :meth:`save` starts it too."""
        if self._use_process and self._process is None:
            try:
                self._process = WriterProcess()
            except OSError as err:
                self._without_process(f"the checkpoint writer process could not start ({err})")

    def close(self) -> None:
        """Stop the writer process and free the host buffers, once the save in flight is written (its error, if
        any, stays for :meth:`wait`). A later :meth:`save` starts again from nothing."""
        thread = self._thread
        if thread is not None:
            self.settle()
            thread.join()
        process, self._process = self._process, None
        if process is not None:
            process.close()
        self._buffers, self._memory, self._pending_state = [], None, None

    def _without_process(self, why: str) -> None:
        """Write the rest of this run's checkpoints in the thread, saying why once."""
        print(f"gputrain: warning: {why}; checkpoints are written by a thread of the training process from now on "
              "(trainer.checkpoint_process=false says so from the start)", file=sys.stderr, flush=True)
        process, self._use_process, self._process = self._process, False, None
        if process is not None:
            process.close()  # gone already, or its shared memory could not be made: nothing is left to it

    @property
    def idle(self) -> bool:
        """No save was handed to the thread since the last :meth:`wait` (or :meth:`save`) collected it."""
        return self._thread is None

    def save(self, state: dict[str, Any], *, name: str, metrics: dict[str, float] | None = None,
             volatile: Iterable[torch.Tensor] | None = None, check_finite: bool = False) -> Path:
        """Write ``state`` as :meth:`CheckpointStore.save` does; returns the path it will have once written.

        Waits for the previous save first (raising its error, if it failed). Entries that
        ``torch.load(weights_only=True)`` would refuse are refused here, in the caller's thread.

        ``volatile``: the tensors the caller may change in place before it calls :meth:`settle` (a model's
        buffers, which a forward pass updates, and its frozen parameters). These, and every tensor sharing
        memory with them, are copied now; the writer thread copies the other CPU tensors, so the caller must
        call :meth:`settle` before it changes any of them (the next optimizer step). ``None``: everything is
        copied now and :meth:`settle` is not needed.

        ``check_finite``: the thread checks the copy it writes for NaN/inf and, if it finds any, skips the
        save with one warning line (the caller's own checks end the run); what is written is then checked,
        not what the caller held, and the check costs the step nothing.
        """
        self.wait()
        if not self.asynchronous:
            return self.store.save(state, name=name, metrics=metrics)
        check_plain(state)
        self.start()
        path = self.store.path_for(name)
        deferred = _Deferred() if volatile is not None and self.defer_copies else None
        busy = {-1} | {_storage(t) for t in volatile or ()}  # -1: no storage to compare; copied in the step
        snapshot, ready = self._snapshot(state, deferred, busy)
        if deferred is not None and not deferred.pairs:
            deferred = None
        self._writing = path
        thread = threading.Thread(target=self._write,
                                  args=(self.store, snapshot, ready, deferred, name, dict(metrics or {}),
                                        self._buffers if check_finite else None, self._memory),
                                  name="gputrain-checkpoint-writer", daemon=True)
        thread.start()
        self._thread, self._deferred = thread, deferred  # only once it runs: settle() must not wait for nothing
        return path

    def settle(self) -> None:
        """Return once the thread holds its own copy of every tensor :meth:`save` left to it.

        Call it before anything may change those tensors in place. Cheap when nothing is owed. A tensor
        whose version counter moved since :meth:`save` was changed before the thread copied it, so the
        checkpoint would mix two states: it is not committed, one warning line names the entry, and from
        then on every tensor is copied in :meth:`save`.
        """
        deferred = self._deferred
        if deferred is None:
            return
        # Whatever happens here (a second Ctrl-C lands in the wait), the thread gets a verdict and never commits
        # a copy nobody checked; a verdict left unset would hold it, and wait(), forever.
        verdict = "the run was interrupted before the copy was checked"
        try:
            deferred.copied.wait()
            changed = [i for i, (source, _, version) in enumerate(deferred.pairs) if source._version != version]
            verdict = _entry_holding(self._pending_state, deferred.pairs[changed[0]][1]) or "a tensor" if changed else ""
        finally:
            self._deferred = None
            deferred.changed = verdict
            deferred.pairs = []  # the sources may be a gathered full state (FSDP, pipeline): free it now
            deferred.settled.set()
        if verdict:
            self.defer_copies = False
            print(f"gputrain: warning: checkpoint {self._writing} was not written: {verdict} was changed in place "
                  "after its step and before the next optimizer step or hook, so a copy taken in the background "
                  "could mix two states; later checkpoints copy the whole state in the step",
                  file=sys.stderr, flush=True)

    def wait(self) -> None:
        """Block until the save in flight is on disk; raise :class:`CheckpointWriteError` if it failed."""
        self.settle()
        thread = self._thread
        if thread is not None:
            thread.join()  # idle stays False until the save is on disk, also when a Ctrl-C lands in this join
        self._thread = None
        error, self._error = self._error, None
        if isinstance(error, _NotFinite) and not self._warned_not_finite:
            self._warned_not_finite = True  # once: every later save of a diverged run would say the same
            print(f"gputrain: warning: checkpoint {self._writing} was not written: {error}", file=sys.stderr, flush=True)
        if error is not None and not isinstance(error, _Skipped):  # settle() reported a changed snapshot
            kept = self.store.latest_valid()
            raise CheckpointWriteError(
                f"checkpoint {self._writing} was not written ({type(error).__name__}: {str(error).splitlines()[0]}); "
                f"{f'{kept} is the newest whole one' if kept else 'no earlier checkpoint exists'}; fix the cause "
                "(disk space, permissions of the folder) and resume, or set trainer.async_checkpoint=false to fail "
                "at the step that saves"
            ) from error

    def _write(self, store: CheckpointStore, state: dict[str, Any], ready: Any, deferred: _Deferred | None,
               name: str, metrics: dict[str, float], check: list[torch.Tensor] | None,
               memory: SharedHostMemory | None) -> None:
        try:
            if deferred is not None:
                deferred.copy()
            if ready is not None:
                ready.synchronize()  # the device-to-host copies queued by _snapshot have landed
            process = self._process if memory is not None else None
            if process is not None and memory is not None and self._answers(process):
                write: Any = functools.partial(self._write_in_process, process, memory, check)
            else:
                if check is not None and not _finite(check):
                    raise _NotFinite
                write = write_temporary
            store.save(state, name=name, metrics=metrics or None,
                       before_commit=None if deferred is None else deferred.before_commit, write=write)
        except BaseException as err:  # noqa: BLE001  (kept for wait(), which raises it in the loop's thread)
            self._error = err

    def process_ready(self, timeout: float = 0.0) -> bool:
        """Whether the writer process is up and takes saves, waiting up to ``timeout`` seconds for it to start."""
        process = self._process
        return process is not None and self._answers(process, timeout)

    def _answers(self, process: WriterProcess, timeout: float = 0.0) -> bool:
        """Whether the writer process is ready for this save (False while it starts; False for good once lost)."""
        try:
            return process.ready(timeout)
        except WriterProcessGone as gone:
            self._without_process(str(gone))
            return False

    def _write_in_process(self, process: WriterProcess, memory: SharedHostMemory, check: list[torch.Tensor] | None,
                          state: dict[str, Any], folder: Path, name: str, *, reuse: Path | None) -> Any:
        """:func:`write_temporary` by the writer process; by this thread when the process is lost on the way."""
        try:
            written = process.write(state, memory, folder=folder, name=name, reuse=reuse, check_finite=check is not None)
        except (WriterProcessGone, WriterProcessRefused) as lost:
            if isinstance(lost, WriterProcessGone):
                self._without_process(str(lost))
            # Refused: this state only (an object of the caller's that does not unpickle there); the process stays.
            if check is not None and not _finite(check):
                raise _NotFinite from None
            # The process may have taken the retired file for its temporary before it died: write a new file then.
            return write_temporary(state, folder, name, reuse=reuse if reuse is not None and reuse.exists() else None)
        if written == NOT_FINITE:
            raise _NotFinite
        self.process_writes += 1
        return written

    def _snapshot(self, state: dict[str, Any], deferred: _Deferred | None,
                  busy: set[int]) -> tuple[dict[str, Any], Any]:
        """A private copy of ``state``, and a CUDA event the copies complete at (None when all were CPU).

        CPU tensors outside ``busy`` (storages the caller may change before settle()) go to ``deferred``
        when given: their buffers are placed in the copy now and filled by the thread.
        """
        index: dict[int, int] = {}  # a tensor listed twice (tied weights) stays one tensor
        sources: list[torch.Tensor] = []
        _walk_tensors(state, index, sources)
        self._buffers, self._memory = self._host_buffers(sources)
        on_cuda = False
        for source, buffer in zip(sources, self._buffers, strict=True):
            if source.device.type == "cuda":
                on_cuda = True
                buffer.copy_(source, non_blocking=True)
            elif deferred is not None and _storage(source) not in busy and not source.is_inference():
                deferred.pairs.append((source, buffer, source._version))  # inference tensors have none
            else:
                buffer.copy_(source)
        snapshot = _replace_tensors(state, index, self._buffers)
        self._pending_state = snapshot  # only to name an entry in settle()'s warning
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return snapshot, ready

    def _host_buffers(self, sources: list[torch.Tensor]) -> tuple[list[torch.Tensor], SharedHostMemory | None]:
        """Host buffers for ``sources`` and the shared memory they lie in (None: private memory).

        The previous save's where they fit (a fresh 135 MB allocation faults its pages in again); in shared memory
        when the writer process is on and every source can lie there; pinned for CUDA sources.
        """
        previous = self._buffers
        same = len(previous) == len(sources) and all(map(_fits, previous, sources))
        shared = self._use_process and all(map(shareable, sources))
        if same and (not shared or (self._memory is not None and self._memory.holds(previous))):
            return previous, self._memory if shared else None
        if shared:
            try:
                memory = SharedHostMemory(sources)
            except Exception as err:  # noqa: BLE001  (no memfd, no room in /dev/shm's limits: the thread writes)
                self._without_process(f"no shared memory for the checkpoint writer process ({err})")
            else:
                return memory.buffers, memory
        return [old if i < len(previous) and _fits(old := previous[i], source)
                else torch.empty_like(source, device="cpu", pin_memory=source.device.type == "cuda")
                for i, source in enumerate(sources)], None


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``buffer`` can hold a copy of ``source``: same shape and type, pinned for a CUDA source, and the
    strides a new buffer would get (the source's where it is dense, else contiguous: a view of a bigger tensor)."""
    if (buffer.shape, buffer.dtype) != (source.shape, source.dtype) or (
            source.device.type == "cuda" and not buffer.is_pinned()):
        return False
    return buffer.stride() == source.stride() or buffer.stride() == torch.empty_like(source, device="meta").stride()


def _finite(buffers: list[torch.Tensor]) -> bool:
    return tensors_finite([t for t in buffers if t.is_floating_point() or t.is_complex()])


def _walk_tensors(obj: Any, index: dict[int, int], sources: list[torch.Tensor]) -> None:
    """Each distinct tensor of ``obj`` once, detached, in walk order; ``index`` maps its id to its place."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in index:
            index[id(obj)] = len(sources)
            sources.append(obj.detach())
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk_tensors(value, index, sources)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
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


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's memory starts: views and detached aliases of one tensor share it."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage (DTensor): copied in the step
        return -1


def _entry_holding(state: Any, buffer: torch.Tensor, path: str = "state") -> str:
    """The key path of ``buffer`` in ``state`` (``state['model']['w']``), or "" when it is not there."""
    if state is buffer:
        return path
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    for key, value in items:
        found = _entry_holding(value, buffer, f"{path}[{key!r}]")
        if found:
            return found
    return ""
