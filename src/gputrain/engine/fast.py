"""The resolved speed options put to work: process-wide switches, the model's memory format, its batches' layout.

What each option is and when ``auto`` turns it on is decided in :mod:`gputrain.config.resolve`; here they are
applied. With every option off the loop runs exactly the plain PyTorch path; on a CPU ``auto`` turns on only
``reuse_host_memory``, which changes where memory comes from, never a computed value. Parallelism stays out of
here: strategies compile their own modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from gputrain.config.resolve import FastPath


def apply_backend_flags(fast: FastPath) -> None:
    """Process-wide switches (cuDNN's autotuner, glibc's allocator); only ever turned on, so a caller's own
    setting stays."""
    if fast.cudnn_benchmark:
        import torch

        torch.backends.cudnn.benchmark = True
    if fast.reuse_host_memory:
        keep_freed_host_memory()


def prepare_model(model: nn.Module, fast: FastPath) -> nn.Module:
    """The user's model in the chosen memory format, before a strategy wraps, shards or splits it."""
    if not fast.channels_last:
        return model
    import torch

    return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]


# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
"""The largest mmap threshold glibc accepts on 64-bit systems (half its heap size); larger requests still use mmap."""


def keep_freed_host_memory() -> None:
    """Make glibc keep freed memory for reuse in this process (and the loader workers it forks later).

    Why: a training step frees and allocates the same activation and gradient buffers every step. By
    default glibc serves each request of 128 KiB or more (a threshold it raises as it goes) with its own
    ``mmap`` and gives free memory at the top of its heap back to the kernel, so the next step faults the
    same pages in again, zeroed: ResNet-18 and the conv autoencoder took 4-5 times as many page faults
    and 1.5-26 % longer epochs on a CPU (docs/benchmarks.md). Serving requests up to 32 MiB from the heap
    and never trimming it is what jemalloc and tcmalloc, which PyTorch's CPU tuning guides recommend,
    do by design; the cost is that the process keeps its peak host memory until it exits.
    """
    import ctypes

    libc = ctypes.CDLL(None)
    # -1 turns trimming off altogether (mallopt(3)); both calls return 1 on success.
    if not (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(_M_TRIM_THRESHOLD, -1)):
        raise OSError("glibc refused mallopt(M_MMAP_THRESHOLD / M_TRIM_THRESHOLD); set trainer.reuse_host_memory=false")


def to_memory_format(inputs: Any, channels_last: bool) -> Any:
    """4-D floating-point image batches in channels-last layout; anything else as it is."""
    if not channels_last:
        return inputs
    import torch

    if isinstance(inputs, torch.Tensor) and inputs.dim() == 4 and inputs.is_floating_point():
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs
