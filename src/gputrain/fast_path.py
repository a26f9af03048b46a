"""The speed options, resolved once per run: what ``auto`` means on this device, and the start-up line.

Each option is one field with an ``auto`` default (``trainer.channels_last``, ``trainer.cudnn_benchmark``,
``optim.fused``, ``trainer.precision``) or an explicit switch (``trainer.compile``), and each is turned on
by ``auto`` only where it helps and is safe:

* channels-last memory format and ``cudnn.benchmark``: on CUDA, for tasks whose images have one
  shape per batch (not detection, whose model batches images of different sizes itself);
* fused optimizer kernels: when the parameters live on a GPU (on a CPU torch's foreach default stays);
* bf16 autocast: on GPUs with bfloat16 (``trainer.precision=auto``); float32 elsewhere (``mixed``, which
  mixed-precision recipes set, takes float16 with loss scaling on GPUs without bfloat16);
* host memory kept for reuse (``trainer.reuse_host_memory``): wherever the C library is glibc, on a CPU
  too -- it changes where memory comes from, never a computed value;
* checkpoints written by a writer process (``trainer.checkpoint_process``): off by default (on the 2-core test
  machine it saved 1-4 % of the step and cost its start); ``auto`` turns it on for CPU runs of at least
  :data:`WRITER_PROCESS_MIN_SAVES` planned saves, ``true`` for every CPU run (on a GPU the snapshot goes to pinned
  memory, which a thread writes); it changes who writes the file only;
* ``uint8`` training batches normalized on the device (``data.normalize_on_device``, chosen when the task's
  data is built): on a GPU, for built-in classification; the same values, a quarter of the bytes moved;
* ``torch.compile``: never by ``auto`` -- its compile time (a minute for ResNet-18) is repaid only by
  long runs, and on a CPU it gave no speed-up -- so it is asked for with ``trainer.compile=true``.

With every option off the loop runs exactly the path it ran before these options existed; on a CPU
``auto`` turns on only ``reuse_host_memory``, so the computed values stay those of that path, bit for
bit. Parallelism stays out of here: strategies compile their own modules.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gputrain.config import RunConfig

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class FastPath:
    """The options of one run after ``auto`` was resolved for its device and task."""

    channels_last: bool = False
    compile_mode: str | None = None
    """``torch.compile`` mode, or None when the model runs eagerly."""
    fused_optimizer: bool = False
    cudnn_benchmark: bool = False
    reuse_host_memory: bool = False
    """glibc keeps the host memory that freed tensors return, for the next step (:func:`keep_freed_host_memory`)."""
    normalize_on_device: bool = False
    """Training images cross from the loader workers as ``uint8`` and are normalized on the device (decided when
    the task's data was built: ``data.normalize_on_device``)."""
    checkpoint_process: bool = False
    """Background checkpoints are written by a writer process (:mod:`gputrain.checkpoint_process`)."""

    def describe(self) -> str:
        """``fast=channels_last+compile(default)+fused+cudnn_benchmark+reuse_host_memory+normalize_on_device+``
        ``checkpoint_process``, or ``fast=off``."""
        on = [name for name, flag in (("channels_last", self.channels_last), ("fused", self.fused_optimizer),
                                      ("cudnn_benchmark", self.cudnn_benchmark),
                                      ("reuse_host_memory", self.reuse_host_memory),
                                      ("normalize_on_device", self.normalize_on_device),
                                      ("checkpoint_process", self.checkpoint_process)) if flag]
        if self.compile_mode:
            on.insert(1 if self.channels_last else 0, f"compile({self.compile_mode})")
        return "fast=" + ("+".join(on) if on else "off")

    def apply_backend_flags(self) -> None:
        """Process-wide switches (cuDNN's autotuner, glibc's allocator); only ever turned on, so a caller's own
        setting stays."""
        if self.cudnn_benchmark:
            import torch

            torch.backends.cudnn.benchmark = True
        if self.reuse_host_memory:
            keep_freed_host_memory()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The user's model in the chosen memory format, before a strategy wraps, shards or splits it."""
        if not self.channels_last:
            return model
        import torch

        return model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]


WRITER_PROCESS_MIN_SAVES = 128
"""With ``trainer.checkpoint_process=auto``, a run planned to write fewer checkpoints keeps them in a thread. Measured
on the 2-core test machine (ResNet-18, 16x16, batch 8, Adam, a save every 4 steps; docs/benchmarks.md): the process
saved 1.2 % of the steady step in ``Trainer.fit`` and 3.6 % in a plain loop (some 1-10 ms per save), and its start
costs about 1.5-2 s of the other core (torch's import) and 300 MB of memory; whole fits of 24 and 96 saves were as fast
or slower with it. Short runs (most tests, smoke runs) start no extra process."""


def writer_process_pays(fast: FastPath, planned_saves: int) -> FastPath:
    """``fast`` with the writer process off when the run plans fewer than :data:`WRITER_PROCESS_MIN_SAVES` saves."""
    if fast.checkpoint_process and planned_saves < WRITER_PROCESS_MIN_SAVES:
        return dataclasses.replace(fast, checkpoint_process=False)
    return fast


def _auto(value: bool | str, default: bool) -> bool:
    return default if value == "auto" else bool(value)


def resolve(cfg: RunConfig, device: torch.device, *, fixed_shapes: bool = True,
            normalize_on_device: bool = False) -> FastPath:
    """The options of ``cfg`` for a run on ``device``; ``fixed_shapes`` is False for tasks whose inputs vary in size,
    ``normalize_on_device`` says whether the task's training batches arrive as ``uint8`` (resolved with its data)."""
    from gputrain import checkpoint_process

    t = cfg.trainer
    cuda = device.type == "cuda"
    if t.reuse_host_memory is True and not glibc():
        raise ValueError("trainer.reuse_host_memory=true tunes glibc's allocator, and this system's C library is not "
                         "glibc; set trainer.reuse_host_memory=auto or false")
    background = t.enable_checkpointing and t.async_checkpoint and not cfg.parallel.sharded_checkpoint
    return FastPath(
        channels_last=_auto(t.channels_last, cuda and fixed_shapes),
        compile_mode=t.compile_mode if t.compile else None,
        fused_optimizer=_auto(cfg.optim.fused, cuda),
        cudnn_benchmark=cuda and _auto(t.cudnn_benchmark, fixed_shapes),  # cuDNN's autotuner: nothing to do elsewhere
        reuse_host_memory=_auto(t.reuse_host_memory, glibc()),
        normalize_on_device=normalize_on_device,
        # true as auto: the process writes states held in host memory only (on a GPU the snapshot is pinned memory,
        # which a thread writes), so a config written on a CPU resolves again anywhere without a refusal.
        checkpoint_process=(background and t.checkpoint_process is not False and device.type == "cpu"
                            and checkpoint_process.supported()),
    )


def glibc() -> bool:
    """Whether this process's C library is glibc (whose ``mallopt`` :func:`keep_freed_host_memory` calls)."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):  # not a POSIX confstr name here (macOS, Windows, musl)
        return False


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


def resolve_precision(name: str, device: torch.device) -> str:
    """What ``auto`` and ``mixed`` mean on ``device``; any other name is returned as given.

    ``auto``: bf16-mixed on a GPU with bfloat16, else 32. ``mixed`` (recipes that are meant to train in
    mixed precision): bf16-mixed on a GPU with bfloat16, whose float32 exponent range needs no loss scaling
    and cannot overflow where float16 can; 16-mixed on an older GPU; 32 on a CPU, where 16-bit autocast has
    no fast kernels (about 20 times slower than float32 on the test machine).
    """
    if name not in ("auto", "mixed"):
        return name
    import torch

    if device.type != "cuda":
        return "32"
    # Native bfloat16 only (compute capability 8.0+): by default torch also says yes where it merely emulates
    # bfloat16 (a V100, a T4), which has no bfloat16 tensor cores: float16 is the fast type there.
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16-mixed"
    return "16-mixed" if name == "mixed" else "32"


def with_resolved(cfg: RunConfig, fast: FastPath) -> RunConfig:
    """``cfg`` with every ``auto`` replaced by what it resolved to, so config.yaml and checkpoints say what ran."""
    t, o = cfg.trainer, cfg.optim
    trainer = dataclasses.replace(t, channels_last=fast.channels_last, cudnn_benchmark=fast.cudnn_benchmark,
                                  reuse_host_memory=fast.reuse_host_memory, checkpoint_process=fast.checkpoint_process)
    data = dataclasses.replace(cfg.data, normalize_on_device=fast.normalize_on_device)
    return dataclasses.replace(cfg, trainer=trainer, optim=dataclasses.replace(o, fused=fast.fused_optimizer),
                               data=data)


def to_memory_format(inputs: Any, channels_last: bool) -> Any:
    """4-D floating-point image batches in channels-last layout; anything else as it is."""
    if not channels_last:
        return inputs
    import torch

    if isinstance(inputs, torch.Tensor) and inputs.dim() == 4 and inputs.is_floating_point():
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs
