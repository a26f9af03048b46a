"""Small recorders that ``doctor`` and ``parity`` attach to a real run: no change to what it computes.

Each one watches one thing through a public PyTorch mechanism (tensor hooks, forward hooks,
``sys.addaudithook``) and keeps plain data (names, shapes, indices, seconds) that can be sent
between ranks and saved with ``torch.save``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import Dataset


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, by rank (a collective: every rank must call it); ``[obj]`` in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class ParamUsage:
    """Which parameters received a gradient in this process's backward passes since the last :meth:`take`.

    A tensor hook on a parameter fires when autograd computes its gradient on *this* rank, before
    DDP averages anything, so a parameter unused on one rank only is seen as such (``.grad`` after
    DDP's all-reduce would be filled from the other ranks).
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self._used: set[str] = set()
        self._handles = [p.register_hook(self._marker(n)) for n, p in model.named_parameters() if p.requires_grad]

    def _marker(self, name: str) -> Any:
        def mark(grad: torch.Tensor) -> None:
            self._used.add(name)
        return mark

    def take(self) -> list[str]:
        """Names of trainable parameters that got no gradient since the last call."""
        unused = [n for n in self.names if n not in self._used]
        self._used = set()
        return unused

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def signature(obj: Any) -> Any:
    """Shapes of every tensor in a nested batch, as lists (JSON-able); other leaves by type name."""
    if isinstance(obj, torch.Tensor):
        return list(obj.shape)
    if isinstance(obj, dict):
        return {str(k): signature(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [signature(v) for v in obj]
    return type(obj).__name__


def without_batch(sig: Any) -> Any:
    """A signature with the leading (batch) dimension of each tensor dropped: it may differ on a short last step."""
    if isinstance(sig, list) and all(isinstance(x, int) for x in sig):
        return sig[1:]
    if isinstance(sig, dict):
        return {k: without_batch(v) for k, v in sig.items()}
    if isinstance(sig, list):
        return [without_batch(v) for v in sig]
    return sig


class ShapeProbe:
    """Input and output shapes of the model's first training forward of each step."""

    def __init__(self, model: nn.Module) -> None:
        self.current: tuple[Any, Any] | None = None
        self._handle = model.register_forward_hook(self._record, with_kwargs=False)

    def _record(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if module.training and self.current is None:
            self.current = (signature(args[0] if len(args) == 1 else list(args)), signature(output))

    def take(self) -> tuple[Any, Any] | None:
        shapes, self.current = self.current, None
        return shapes

    def remove(self) -> None:
        self._handle.remove()


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in a nested sample cast to ``dtype``; everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(cast_floats(v, dtype) for v in obj)
    return obj


class IndexRecorder(Dataset):
    """A dataset that remembers which indices were read, in order (read in this process: num_workers=0).

    With ``dtype``, floating-point tensors of each sample are cast to it (parity runs in float64).
    """

    def __init__(self, dataset: Dataset, dtype: torch.dtype | None = None) -> None:
        self.dataset = dataset
        self.dtype = dtype
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.read.append(int(index))
        sample = self.dataset[index]
        return sample if self.dtype is None else cast_floats(sample, self.dtype)

    def __getattr__(self, name: str) -> Any:  # collate functions or tasks may read dataset attributes
        if name in ("dataset", "read", "dtype"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def take(self) -> list[int]:
        read, self.read = self.read, []
        return read


def batchnorm_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Running statistics of every BatchNorm layer (synchronised or not), copied to CPU."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) or type(module).__name__.endswith("SyncBatchNorm"):
            for buf in ("running_mean", "running_var"):
                value = getattr(module, buf, None)
                if isinstance(value, torch.Tensor):
                    out[f"{name}.{buf}"] = value.detach().double().cpu().clone()
    return out


def unsynced_batchnorm(model: nn.Module) -> list[str]:
    """Names of BatchNorm layers that normalise with this rank's batch only."""
    return [name for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
            and "Sync" not in type(m).__name__]


class WriteWatch:
    """On a rank other than 0: files opened for writing and lines printed, while :attr:`active`.

    ``sys.addaudithook`` sees every ``open`` (Python's and ``os.open``); temporary folders are
    ignored, except ``watched`` (the run folder, which belongs to rank 0 alone). An audit hook cannot
    be removed, so this is installed once per worker process and switched off with :attr:`active`.
    """

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def __init__(self, watched: list[str], ignored: list[str]) -> None:
        self.watched = [os.path.realpath(w) for w in watched]
        self.ignored = [os.path.realpath(i) for i in ignored] + [os.path.realpath(tempfile.gettempdir())]
        self.files: dict[str, int] = {}
        self.printed: list[str] = []
        self.active = False
        sys.addaudithook(self._audit)
        self._stdout = sys.stdout
        sys.stdout = self  # type: ignore[assignment]

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not self.active or not isinstance(args[0], (str, bytes, os.PathLike)):
            return  # the common case first: this runs for every audit event of the process
        mode, flags = args[1], args[2] if len(args) > 2 else 0
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                 (mode is None and isinstance(flags, int) and flags & self.WRITE_FLAGS)
        if not writes:
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(("/dev/", "/proc/", "/sys/")) or "__pycache__" in path:
            return
        if any(path.startswith(w) for w in self.watched) or not any(path.startswith(i) for i in self.ignored):
            self.files[path] = self.files.get(path, 0) + 1

    # -- a stand-in for sys.stdout ----------------------------------------------------------
    def write(self, text: str) -> int:
        if self.active and text.strip():
            self.printed.append(text.strip()[:200])
        return self._stdout.write(text)

    def flush(self) -> None:
        self._stdout.flush()

    def __getattr__(self, name: str) -> Any:
        if name == "_stdout":  # not set yet: no recursion through this method
            raise AttributeError(name)
        return getattr(self._stdout, name)

    def take(self) -> dict[str, Any]:
        out = {"files": dict(self.files), "printed": list(self.printed)}
        self.files, self.printed = {}, []
        return out

