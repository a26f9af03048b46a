"""The checkpoint writer process: ``torch.save`` of a snapshot in shared memory, away from the training process.

Why a process: a background *thread* that runs ``torch.save`` holds the training process's GIL while it pickles
(``persistent_id`` and each tensor's ``__reduce_ex__`` are Python, about 1,200 calls for ResNet-18 with Adam) and
glues the zip records together, and the training thread waits for the GIL between its own operations. PyTorch's
distributed checkpoint offers a process for its asynchronous saves for the same reason. Measured on the 2-core test
machine (ResNet-18, 16x16, batch 8, Adam, a save every 4 steps, alternating blocks of 32 steps with and without
saves): the steady step cost of a background save went from 12.8 % with the thread to 11.6 % with this process in
``Trainer.fit``, and from 8.9 % to 5.3 % in a plain loop (docs/benchmarks.md); the rest is memory traffic a process
does not remove, so ``trainer.checkpoint_process`` is off by default.

How: :class:`SharedHostMemory` is one ``memfd`` mapping from which the snapshot's host buffers are cut (reused save
after save while the state's layout stays the same). :class:`WriterProcess` starts this interpreter on this
module's :func:`main` (with the training process's ``sys.path``), hands it the memfd over a Unix socket, and for
each save sends the state's structure with each tensor replaced by its :class:`Slot` (where it lies in the shared
memory) and ``torch.save``'s options of the moment (record CRCs, alignment). The process rebuilds the
tensors as views of the same pages, checks them for NaN/inf if asked, and writes the temporary file
(:func:`~gputrain.checkpoint_io.write_temporary`: the same bytes, fsync and checksum as in the thread); the
training process's writer thread then commits it (links, manifest, rotation) as before. Crash order and file
format are unchanged.

The process ends with its parent: it asks the kernel for SIGKILL when the thread that started it exits
(``PR_SET_PDEATHSIG``), and it leaves when its socket closes or it is told to. It ignores the signals that stop a
run (SIGINT, SIGTERM, SIGUSR1, SIGHUP, SIGQUIT): Ctrl-C reaches every process of the terminal's group, and the
save in flight must finish for the run's own stop to find it on disk. Linux only (memfd, PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Only the standard library at import; torch is imported where it is used (the process starts with _BOOTSTRAP).
_ALIGN = 64  # what torch's own CPU allocator gives: vectorised copies and sums run at full speed
_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP", "SIGQUIT")
NOT_FINITE = "not finite"
"""The process's answer when the snapshot holds NaN or inf (nothing was written)."""
SYS_PATH_ENV = "GPUTRAIN_WRITER_SYS_PATH"
# The process ignores the stop signals before anything else, before it spends two seconds importing torch (a Ctrl-C
# then would kill it), and imports gputrain from wherever the training process found it (an installed package, a
# source tree on sys.path, a test's copy of the code).
_BOOTSTRAP = f"""\
import signal
for name in {_STOP_SIGNALS!r}:
    signal.signal(getattr(signal, name), signal.SIG_IGN)
import json, os, sys
sys.path[:] = json.loads(os.environ.pop({SYS_PATH_ENV!r}))
from gputrain.checkpoint_process import main
main()
"""


def supported() -> bool:
    """Whether this system can run the writer process (Linux: memfd and PR_SET_PDEATHSIG)."""
    # A frozen application has no interpreter to start on a module.
    return (sys.platform.startswith("linux") and hasattr(os, "memfd_create") and bool(sys.executable)
            and not getattr(sys, "frozen", False))


def shareable(tensor: torch.Tensor) -> bool:
    """Whether a snapshot buffer for ``tensor`` can live in shared memory: a plain, dense CPU tensor."""
    import torch

    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested)


@dataclass(frozen=True)
class Slot:
    """Where one snapshot tensor lies in the shared memory; ``index`` tells tied tensors (one buffer) apart."""

    index: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _span(shape: torch.Size | tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a tensor's first to its last one, inclusive (0 for an empty tensor)."""
    if 0 in shape:
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


class SharedHostMemory:
    """One ``memfd`` mapping holding the host buffers of a snapshot, which the writer process maps too."""

    def __init__(self, like: list[torch.Tensor]) -> None:
        import torch

        layout = []
        end = 0
        for tensor in like:
            # empty_like's strides: the source's where it is dense, else contiguous (what the thread's buffers get)
            stride = torch.empty_like(tensor, device="meta").stride()
            end = -(-end // _ALIGN) * _ALIGN
            layout.append((end, tuple(tensor.shape), stride))
            end += _span(tensor.shape, stride) * tensor.element_size()
        self.size = max(end, 1)
        self.fd = -1
        self.fd = os.memfd_create("gputrain-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except BaseException:
            self.close_fd()
            raise
        self.buffers = [self._view(offset, tensor.dtype, shape, stride)
                        for tensor, (offset, shape, stride) in zip(like, layout, strict=True)]
        self.slots = {id(buffer): Slot(i, offset, str(buffer.dtype).removeprefix("torch."), shape, stride)
                      for i, (buffer, (offset, shape, stride)) in enumerate(zip(self.buffers, layout, strict=True))}

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        import torch

        count = _span(shape, stride)
        if count == 0:
            return torch.empty_strided(shape, stride, dtype=dtype)
        # A storage of its own over exactly these bytes: torch.save writes one record per buffer, as for the thread's.
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset).as_strided(shape, stride)

    def holds(self, buffers: list[torch.Tensor]) -> bool:
        return len(buffers) == len(self.buffers) and all(a is b for a, b in zip(buffers, self.buffers, strict=True))

    def skeleton(self, state: Any) -> Any:
        """``state`` with every tensor (one of :attr:`buffers`) replaced by its :class:`Slot`."""
        import torch

        if isinstance(state, torch.Tensor):
            return self.slots[id(state)]
        if isinstance(state, dict):
            return {k: self.skeleton(v) for k, v in state.items()}
        if isinstance(state, list):
            return [self.skeleton(v) for v in state]
        if isinstance(state, tuple):
            return tuple(self.skeleton(v) for v in state)
        return state

    def close_fd(self) -> None:
        """The process has its own descriptor now; the mapping keeps the pages."""
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # a mapping never sent (the process was lost first) still holds its descriptor
        self.close_fd()


class WriterProcessGone(RuntimeError):
    """The writer process ended or stopped answering; the save is written in the thread instead."""


class WriterProcessRefused(RuntimeError):
    """The writer process could not take this save's request (it did not unpickle there); the thread writes it."""


def _save_options() -> dict[str, Any]:
    """``torch.save``'s options of the moment (record CRCs, alignment), which the process applies before writing."""
    import torch.utils.serialization.config as serialization

    return {name: getattr(serialization.save, name) for name in ("compute_crc32", "storage_alignment")
            if hasattr(serialization.save, name)}


def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    header = _read_exactly(sock, 8)
    return pickle.loads(_read_exactly(sock, struct.unpack("!Q", header)[0]))


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the other end closed the socket")
        data += chunk
    return bytes(data)


class WriterProcess:
    """The training process's handle on its writer process; one save at a time, from one thread.

    Started by the thread that trains (``PR_SET_PDEATHSIG`` follows that thread). Until the process has imported
    torch (about 2 s of the other core's time) it is not :meth:`ready` and saves are written in the thread.
    """

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env[SYS_PATH_ENV] = json.dumps([str(Path(p).absolute()) if p else p for p in sys.path])
        # Its last words (a failed import, a Python error) end the warning if it dies; never the user's terminal.
        self._stderr = tempfile.TemporaryFile()
        try:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._stderr, env=env)
        except BaseException:
            mine.close()
            self._stderr.close()
            raise
        finally:
            theirs.close()
        self._sock = mine
        self._ready = False
        self._memory: SharedHostMemory | None = None  # the mapping the process has
        self._lock = threading.Lock()  # the writer thread saves while the training thread may ask ready() or close()

    @property
    def pid(self) -> int:
        return self._popen.pid

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether the process has started and can take a save (waits up to ``timeout`` seconds for it)."""
        with self._lock:
            if self._sock.fileno() < 0:
                return False
            if not self._ready and select.select([self._sock], [], [], timeout)[0]:
                try:
                    self._ready = _receive(self._sock) == "ready"
                except (OSError, EOFError) as err:
                    raise self._gone(err) from None
            return self._ready

    def write(self, state: Any, memory: SharedHostMemory, *, folder: Path, name: str, reuse: Path | None,
              check_finite: bool) -> Any:
        """:func:`write_temporary` of ``state`` (tensors in ``memory``) in the process: (path, size, checksum), or
        :data:`NOT_FINITE`. Raises what the write raised there, :class:`WriterProcessRefused` when the process could
        not read the request, or :class:`WriterProcessGone`."""
        from gputrain.checkpoint_io import PAUSE_ENV

        request = {"state": memory.skeleton(state), "folder": Path(folder).absolute(), "name": name,
                   "reuse": None if reuse is None else Path(reuse).absolute(), "check_finite": check_finite,
                   "pause": os.environ.get(PAUSE_ENV), "options": _save_options()}
        with self._lock:
            try:
                if memory is not self._memory:
                    _send(self._sock, "memory")
                    socket.send_fds(self._sock, [b"m"], [memory.fd])
                    memory.close_fd()  # not left open for loader workers forked later to inherit
                    self._memory = memory
                _send(self._sock, request)
                outcome, value = _receive(self._sock)
            except (OSError, EOFError) as err:
                raise self._gone(err) from None
        if outcome == "error":
            raise value
        if outcome == "refused":
            raise WriterProcessRefused(value)
        return value

    def _gone(self, cause: BaseException) -> WriterProcessGone:
        try:
            code = self._popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            code = self._popen.wait()
        try:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        except ValueError:  # a signal number Python has no name for
            how = f"killed by signal {-code}"
        self._sock.close()
        return WriterProcessGone(f"the checkpoint writer process {self._popen.pid} ended ({how}; {cause}"
                                 f"{'; it said: ' + said if (said := self._last_words()) else ''})")

    def _last_words(self) -> str:
        """The last line the process wrote to its stderr ("" when none)."""
        try:
            self._stderr.seek(0)
            lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return ""
        return lines[-1][:300] if lines else ""

    def close(self) -> None:
        """Tell the process to leave and reap it. One still importing torch is killed: it holds nothing yet."""
        try:
            if self._sock.fileno() >= 0:
                try:
                    if self.ready():
                        with self._lock:
                            _send(self._sock, "exit")  # a loader worker forked from us may hold our socket open
                    else:
                        self._popen.kill()
                except (OSError, WriterProcessGone):
                    pass  # already gone
                self._sock.close()
            try:
                self._popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
        finally:
            self._stderr.close()


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the thread that started us exits (and at once if it already has)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def _rebuild(skeleton: Any, memory: mmap.mmap, made: dict[int, torch.Tensor]) -> Any:
    import torch

    if isinstance(skeleton, Slot):
        if skeleton.index not in made:
            dtype = getattr(torch, skeleton.dtype)
            count = _span(skeleton.shape, skeleton.stride)
            made[skeleton.index] = (torch.frombuffer(memory, dtype=dtype, count=count, offset=skeleton.offset)
                                    .as_strided(skeleton.shape, skeleton.stride) if count
                                    else torch.empty_strided(skeleton.shape, skeleton.stride, dtype=dtype))
        return made[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _rebuild(v, memory, made) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_rebuild(v, memory, made) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_rebuild(v, memory, made) for v in skeleton)
    return skeleton


def _handle(request: dict[str, Any], memory: mmap.mmap) -> Any:
    from gputrain.checkpoint_io import PAUSE_ENV, tensors_finite, write_temporary

    made: dict[int, torch.Tensor] = {}
    state = _rebuild(request["state"], memory, made)
    if request["check_finite"] and not tensors_finite([t for t in made.values() if t.is_floating_point()
                                                        or t.is_complex()]):
        return NOT_FINITE
    if request["pause"] is None:
        os.environ.pop(PAUSE_ENV, None)
    else:
        os.environ[PAUSE_ENV] = request["pause"]
    import torch.utils.serialization.config as serialization

    for name, value in request["options"].items():
        setattr(serialization.save, name, value)
    return write_temporary(state, request["folder"], request["name"], reuse=request["reuse"])


def serve(sock: socket.socket) -> None:
    """Answer save requests until told to exit or the socket closes."""
    memory: mmap.mmap | None = None
    _send(sock, "ready")
    while True:
        try:
            request = _receive(sock)
        except (OSError, EOFError):
            return
        except Exception as err:  # noqa: BLE001  (a request that does not unpickle here: the thread writes that save)
            _send(sock, ("refused", f"{type(err).__name__}: {err}"))
            continue
        if request == "exit":
            os._exit(0)  # nothing to flush or free: leave at once, without torch's teardown
        if request == "memory":
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            memory = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)
            os.close(fds[0])
            continue
        try:
            assert memory is not None, "a save came before its shared memory"
            answer: tuple[str, Any] = ("ok", _handle(request, memory))
        except BaseException as err:  # noqa: BLE001  (sent to the training process, which raises it)
            try:
                pickle.loads(pickle.dumps(err))  # some exceptions pickle but do not unpickle (required arguments)
            except Exception:  # noqa: BLE001  (an exception that does not travel: its type and text)
                err = RuntimeError(f"{type(err).__name__}: {err}")
            answer = ("error", err)
        _send(sock, answer)


def main() -> None:
    """The process's body, started by :data:`_BOOTSTRAP` (which has already ignored the stop signals)."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent)
    import torch

    import gputrain.checkpoint_io  # noqa: F401  (loaded before "ready", so the first save waits for nothing)

    torch.set_num_threads(1)
    serve(socket.socket(fileno=fd))
