"""Every ``auto`` of a run decided once, in one place, from the facts of where it runs.

:func:`resolve_run` takes the config a recipe and the command line gave and what each rank knows once it has
joined the job (its device, the processes of its node, its cores, the task's kind of input, the checkpoint it
resumes from) and returns the config with nothing left to decide, plus the speed options as a frozen
:class:`FastPath`. ``config.yaml`` and every checkpoint record that config, and every later stage only reads it:
a resume on another machine resolves nothing again. Every rank of a job gets the same answer from the same facts.

What ``auto`` means (docs/performance.md): channels-last memory format and cuDNN's autotuner on CUDA for tasks
whose images have one shape per batch (not detection); fused optimizer kernels where the parameters live on a
GPU; bf16 autocast on GPUs with native bfloat16 (``mixed`` takes float16 with loss scaling on older GPUs and
float32 on a CPU); host memory kept for reuse wherever the C library is glibc; background checkpoints where the
model trains on a GPU; ``uint8`` batches made float on the device for every built-in task on a GPU;
``cores // local processes`` loader workers. ``torch.compile`` is never chosen by ``auto``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gputrain.config.schema import RunConfig

if TYPE_CHECKING:
    import torch

MAX_AUTO_WORKERS = 32
"""``data.num_workers=auto`` gives at most this many (past a few dozen workers cost shared memory and start-up
time for little gain; docs/data.md says how many images/s one worker gives)."""


@dataclass(frozen=True)
class FastPath:
    """The speed options of one run after ``auto`` was resolved for its device and task."""

    channels_last: bool = False
    compile_mode: str | None = None
    """``torch.compile`` mode, or None when the model runs eagerly."""
    fused_optimizer: bool = False
    cudnn_benchmark: bool = False
    reuse_host_memory: bool = False
    """glibc keeps the host memory that freed tensors return, for the next step
    (:func:`gputrain.engine.fast.keep_freed_host_memory`)."""
    normalize_on_device: bool = False
    """Training images cross from the loader workers as ``uint8`` and are normalized on the device."""

    def describe(self) -> str:
        """``fast=channels_last+compile(default)+fused+cudnn_benchmark+reuse_host_memory+normalize_on_device``,
        or ``fast=off``."""
        on = [name for name, flag in (("channels_last", self.channels_last), ("fused", self.fused_optimizer),
                                      ("cudnn_benchmark", self.cudnn_benchmark),
                                      ("reuse_host_memory", self.reuse_host_memory),
                                      ("normalize_on_device", self.normalize_on_device)) if flag]
        if self.compile_mode:
            on.insert(1 if self.channels_last else 0, f"compile({self.compile_mode})")
        return "fast=" + ("+".join(on) if on else "off")


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What a rank knows about where the run is, once it has joined the job (the same on every rank)."""

    device: torch.device
    local_processes: int = 1
    """Processes on this node (``LOCAL_WORLD_SIZE``), among which its cores are shared."""
    cores: int = 1
    """Cores this process may run on (:func:`usable_cores`)."""
    fixed_shapes: bool = True
    """The task's images have one shape per batch (not detection, whose model batches images of many sizes)."""
    normalizes_on_device: bool = False
    """The task's training batches arrive as ``uint8`` (decided with its data: ``data.normalize_on_device``)."""
    dp_size: int = 1
    """Data-parallel ranks: how many shares of each global batch are read at once."""
    saved_global_batch: int = 0
    """The global batch of the checkpoint the run resumes from (0: a fresh run)."""
    resumed_from: str = ""
    """That checkpoint's path, for the refusal of a global batch this layout cannot split."""


def resolve_run(cfg: RunConfig, facts: Facts) -> tuple[RunConfig, FastPath]:
    """``cfg`` with every ``auto`` replaced by what it is for this run, and the resolved speed options."""
    t, o = cfg.trainer, cfg.optim
    cuda = facts.device.type == "cuda"
    if t.reuse_host_memory is True and not glibc():
        raise ValueError("trainer.reuse_host_memory=true tunes glibc's allocator, and this system's C library is not "
                         "glibc; set trainer.reuse_host_memory=auto or false")
    precision = resolve_precision(t.precision, facts.device)
    fast = FastPath(
        channels_last=_auto(t.channels_last, cuda and facts.fixed_shapes),
        compile_mode=t.compile_mode if t.compile else None,
        fused_optimizer=_auto(o.fused, cuda and not fused_sgd_breaks(cfg, precision)),
        cudnn_benchmark=cuda and _auto(t.cudnn_benchmark, facts.fixed_shapes),  # cuDNN's: nothing to do elsewhere
        reuse_host_memory=_auto(t.reuse_host_memory, glibc()),
        normalize_on_device=facts.normalizes_on_device,
    )
    if fast.fused_optimizer and fused_sgd_breaks(cfg, precision):  # `mixed` became 16-mixed on this GPU
        raise ValueError(FUSED_SGD_REFUSAL)
    batch = resumed_batch_size(facts.saved_global_batch or t.batch_size * facts.dp_size * t.accumulate_grad_batches,
                               facts.dp_size, t.accumulate_grad_batches, t.batch_size, facts.resumed_from)
    trainer = dataclasses.replace(
        t, precision=precision, batch_size=batch, channels_last=fast.channels_last,
        cudnn_benchmark=fast.cudnn_benchmark, reuse_host_memory=fast.reuse_host_memory)
    data = dataclasses.replace(cfg.data, normalize_on_device=fast.normalize_on_device, num_workers=resolve_num_workers(
        cfg.data.num_workers, cores=facts.cores, local_processes=facts.local_processes))
    resolved = dataclasses.replace(cfg, trainer=trainer, data=data,
                                   optim=dataclasses.replace(o, fused=fast.fused_optimizer))
    return resolved, fast


def fused_sgd_breaks(cfg: RunConfig, precision: str) -> bool:
    """Whether torch's fused SGD would corrupt this run: SGD with momentum under 16-mixed's loss scaler.

    Fused SGD makes its momentum buffers with ``torch.empty_like`` on its first step and fills them in the kernel,
    which returns early when the scaler found inf/NaN gradients. The first step of a float16 run usually overflows
    (the scale starts at 2**16), so the buffers keep whatever memory they were given, and the next step writes
    it into the weights: NaN, or activations beyond float32 (the DeepLabv3+ 16-mixed NaN on an H200, 2026-11-29;
    torch 2.11 and 2.14). The other optimizers, and SGD after its first step, leave a skipped step untouched.
    """
    o = cfg.optim
    return precision in ("16-mixed", "fp16-mixed") and o.name.lower() == "sgd" and o.momentum != 0


FUSED_SGD_REFUSAL = ("optim.fused=true with optim.name=sgd (momentum) and trainer.precision=16-mixed: torch's fused "
                     "SGD leaves its momentum unset when the loss scaler skips the first step, and the weights "
                     "become NaN; set optim.fused=auto or false, or train at bf16-mixed")


def _auto(value: bool | str, default: bool) -> bool:
    return default if value == "auto" else bool(value)


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


def glibc() -> bool:
    """Whether this process's C library is glibc (whose ``mallopt`` keeps freed host memory for reuse)."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):  # not a POSIX confstr name here (macOS, Windows, musl)
        return False


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which SLURM and taskset set), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity masks
        return os.cpu_count() or 1


def machine_busy(device: str = "cpu") -> str:
    """Why step times measured now mean little (a CPU whose load average exceeds its cores), or "" (the doctor's
    comparison with the plan, and a run's pace against it)."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"the machine was busy (load {load:.1f} on {cores} cores)" if device == "cpu" and load > cores else ""


def local_processes(world_size: int) -> int:
    """Processes of the job on this node: torchrun's ``LOCAL_WORLD_SIZE``, else the whole job (one node, or SLURM)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def cores_per_process(processes: int) -> int:
    """This process's share of the cores it may run on, among ``processes`` of its node (at least 1)."""
    return max(usable_cores() // max(processes, 1), 1)


def resolve_num_workers(value: int | str, *, cores: int, local_processes: int) -> int:
    """``value`` as a worker count: an int as given, ``auto`` as ``cores // local_processes``, capped.

    Each process of a node decodes and augments its own share of the batches, so the node's cores are split
    between its processes; fewer cores than processes gives 0 (loading in the process itself).
    """
    if value == "auto":
        return min(cores // max(local_processes, 1), MAX_AUTO_WORKERS)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"data.num_workers={value!r} must be a count of at least 0 or auto (the cores of the node "
                     "divided by its processes)")


def resumed_batch_size(saved_global_batch: int, dp_size: int, accumulate: int, batch_size: int, path: str) -> int:
    """The per-device batch that keeps a checkpoint's global batch on this many data-parallel ranks.

    A run resumed on another number of processes continues the same sequence of steps (the sampler deals one
    global batch per step), so the global batch is kept and the per-device batch follows.
    """
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
