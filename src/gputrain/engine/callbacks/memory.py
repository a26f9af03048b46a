"""``trainer.measure_memory``: the memory each rank's first optimizer steps hold at their peak, in ``memory.json``.

What ``gputrain plan`` predicts, measured in the run itself, per rank. On a GPU: ``torch.cuda.max_memory_allocated``
from before the first forward to the end of the second optimizer step. On a CPU no allocator keeps a peak, so
torch's ``MemTracker`` (``FSDPMemTracker`` for FSDP; for pipeline stages a count of live storages, see
:class:`LiveBytes`) counts the live tensors of those steps by kind, the count the plan's fake steps make. It sees
every op, which makes those two steps slower on a CPU: off by default. Whatever runs between the two steps (an
evaluation after an epoch of one step) is counted with them.

Two steps, because the first one creates the optimizer state that every later step holds.
"""

from __future__ import annotations

import json
import warnings
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from gputrain.dist import comm
from gputrain.engine.hooks import Hook, RunContext

MEASURED_STEPS = 2
PARTS = {  # MemTracker's kinds, as the plan names them
    "Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
    "Unsharded Param": "parameters", "All Gather": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Temp": "activations",
}


def memory_parts(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A ``MemTracker`` snapshot (per device, per kind) summed into the plan's parts (what is not named: other)."""
    totals = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "other"), 0)
    for by_kind in snapshot.values():
        for kind, size in by_kind.items():
            name = getattr(kind, "value", kind)
            if name != "Total":
                totals[PARTS.get(name, "other")] += size
    return totals


FIXED_PARTS = frozenset({"parameters", "gradients", "optimizer"})
"""The parts whose size does not depend on the batch; activations and the rest (the batch itself) grow with it."""


def peak_only(tracker: Any) -> Any:
    """``tracker`` (a ``MemTracker`` or ``FSDPMemTracker``) made to keep only the whole count's peak and its parts,
    and, for each moment of the step, what grows with the batch (``tracker.moments``, below).

    On every op it also updates the peak of each module the step is inside, looping over every module it has seen:
    figures gputrain does not read, at about 7 times the cost of a ResNet-50 step on fake tensors (1.16 s against
    0.16 s). Replacing that one method (torch 2.14's ``_update_peak_stats``, pinned) keeps the peak it does read.

    ``tracker.moments`` maps the bytes of the step's fixed parts (parameters, gradients, optimizer state: they do
    not depend on the batch, and every moment of a step holds a different amount of gradients) to the most the rest
    reached while they were that size. The same step at another batch passes the same moments, so two counts give
    every moment's line in the batch, and the largest batch that fits is the one whose every moment fits: the peak
    can move (a small batch peaks at the end of the backward, with all gradients; a large one at the end of the
    forward, with all activations), which a line through the two peaks misses.
    """
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    fixed = {name for name, part in PARTS.items() if part in FIXED_PARTS}
    moments: dict[int, int] = {}
    tracker.moments = moments

    def update_peak(peak_state: Any) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            total = snapshot[_TOTAL_KEY]
            if tracker._peak_mem.get(device, 0) < total:
                tracker._peak_mem[device] = total
                tracker._peak_mem_snap[device] = dict(snapshot)
            held = sum(size for kind, size in snapshot.items() if getattr(kind, "value", kind) in fixed)
            if moments.get(held, -1) < total - held:
                moments[held] = total - held

    tracker._update_peak_stats = update_peak
    return tracker


class LiveBytes(TorchDispatchMode):
    """The peak bytes of live tensor storages: the model's, its gradients' and the optimizer's from the start, and
    every op's output after it, each freed when its storage is. No module hooks, so no breakdown by kind: for
    ``torch.distributed.pipelining``, whose stage backward (``autograd.grad`` on received leaves) MemTracker's
    module hooks cannot follow."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.now = self.peak = 0
        held = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
                *extra]
        if optimizer is not None:
            held += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        for t in held:
            self._hold(t)

    def _hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.device.type == "meta" or storage in self.live:
            return
        size = storage.nbytes()
        self.live[storage] = size
        weakref.finalize(storage, self._free, size)
        self.now += size
        self.peak = max(self.peak, self.now)

    def _free(self, size: int) -> None:
        self.now -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._hold, out)
        return out


class StepCounter:
    """Counts the live tensors of a rank from :meth:`start` to :meth:`stop`, over any number of steps.

    torch's ``FSDPMemTracker`` for a model FSDP sharded (it names shards and gathered units), :class:`LiveBytes`
    for a pipeline stage, else ``MemTracker``, told about the whole model (even blocks a stage never runs: they
    stay in this process) and the optimizer. MemTracker keeps per-module figures for one iteration and refuses a
    top-level module called again (the next step, the next micro-batch, the loss); those figures are not used
    here, so a top-level module's are forgotten before it is called again, which leaves its peak untouched.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, pipeline: bool,
                 extra: tuple[torch.Tensor, ...] = ()) -> None:
        from torch.distributed.fsdp import FSDPModule

        self._handle: Any = None
        if pipeline:
            self.tracker: Any = LiveBytes(model, optimizer, extra)
        elif isinstance(model, FSDPModule) and optimizer is not None:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

            self.tracker = peak_only(FSDPMemTracker(model, optimizer))
            kind: Any = _FSDPRefType.SHARDED_PARAM
        else:
            from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

            self.tracker = peak_only(MemTracker())
            self.tracker.track_external(model, *([optimizer] if optimizer is not None else []))
            kind = _MemRefType.PARAM
        for t in extra:  # the EMA's copy of the weights (its shards under fsdp), counted with the parameters; what
            # track_external does for a tensor, under the parameters' kind (FSDPMemTracker's track_external is a no-op)
            self.tracker._update_and_maybe_create_winfos(t, kind)

    def _forget_top_level_call(self, module: torch.nn.Module, args: Any) -> None:
        # Registered before the tracker's own global hook, so it runs first, before the module is entered.
        # "Top level" as MemTracker tells it (a backward may leave a module's own name among the parents).
        modules = self.tracker._mod_tracker
        name = modules.get_known_fqn(module)
        if name is not None and not modules.is_bw and set(modules.parents) - {name} == {"Global"}:
            self.tracker.memory_tracking.pop(module, None)

    def start(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook

        if not isinstance(self.tracker, LiveBytes):
            self._handle = register_module_forward_pre_hook(self._forget_top_level_call)
            # Its module hierarchy warns about modules called outside the model (data transforms, the loss).
            warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        self.tracker.__enter__()

    def stop(self) -> tuple[int, dict[str, int] | None]:
        """Ends the count: the peak bytes, and their parts where the tracker tells them."""
        self.tracker.__exit__(None, None, None)
        if isinstance(self.tracker, LiveBytes):
            return self.tracker.peak, None
        self._handle.remove()
        parts = memory_parts(self.tracker.get_tracker_snapshot("peak"))
        return sum(parts.values()), parts


OFF_LIMIT = 0.2
"""A plan's peak memory more than this far from a rank's measure (either way) is named in one line."""


def set_against_plan(ranks: list[dict[str, Any]], predicted: list[int]) -> str:
    """Each rank's measure given the plan's prediction for its device (``trainer.predicted_peak_bytes``, set by
    ``--strategy auto``) and the prediction's error (+25 %: a quarter more than measured); the one line of the rank
    furthest off when past :data:`OFF_LIMIT` (empty otherwise, or when nothing, or not one figure a rank, was
    predicted)."""
    if len(predicted) != len(ranks):
        return ""
    for rank in ranks:
        want = predicted[rank["rank"]]
        rank |= {"predicted_bytes": want, "prediction_off": round(want / max(rank["peak_bytes"], 1) - 1, 4)}
    worst = max(ranks, key=lambda r: abs(r["prediction_off"]))
    if abs(worst["prediction_off"]) <= OFF_LIMIT:
        return ""
    fix = ("it has less memory to spare than planned: lower trainer.batch_size if the device runs short"
           if worst["prediction_off"] < 0 else "a larger trainer.batch_size may fit (gputrain plan shows the largest)")
    return (f"gputrain: warning: rank {worst['rank']} held {worst['peak_bytes'] / 2**20:,.1f} MiB at its peak, the "
            f"plan predicted {worst['predicted_bytes'] / 2**20:,.1f} MiB (prediction {worst['prediction_off']:+.0%}); "
            f"{fix}")


class MemoryHook(Hook):
    """Measures the first :data:`MEASURED_STEPS` optimizer steps of every rank; rank 0 writes ``memory.json``."""

    def __init__(self) -> None:
        self.counter: StepCounter | None = None
        self.steps = 0
        self.measured: dict[str, Any] | None = None

    def before_fit(self, ctx: RunContext) -> None:
        device = ctx.dist.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return
        self.counter = StepCounter(ctx.model, ctx.optimizer, pipeline=ctx.strategy == "pipeline",
                                   extra=ctx.averaged_weights)
        self.counter.start()

    def after_step(self, ctx: RunContext, logs: dict[str, float] | None) -> None:
        self.steps += 1
        if self.steps == MEASURED_STEPS:
            self._stop(ctx)

    def _stop(self, ctx: RunContext) -> None:
        if self.measured is not None:
            return
        device = ctx.dist.device
        measured: dict[str, Any] = {"rank": ctx.dist.rank, "device": str(device), "steps": self.steps}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            measured |= {"peak_bytes": int(torch.cuda.max_memory_allocated(device)),
                         "how": "torch.cuda.max_memory_allocated"}
        else:
            counter, self.counter = self.counter, None
            assert counter is not None
            peak, parts = counter.stop()
            measured |= {"peak_bytes": peak, "parts": parts, "how": type(counter.tracker).__name__}
        self.measured = measured

    def after_fit(self, ctx: RunContext, summary: dict[str, Any]) -> None:
        self._stop(ctx)
        ranks = comm.all_gather_objects(self.measured)
        if ctx.dist.is_main:
            line = set_against_plan(ranks, list(ctx.cfg.trainer.predicted_peak_bytes))
            (ctx.out / "memory.json").write_text(json.dumps({"ranks": ranks}, indent=2))
            worst = max(ranks, key=lambda r: r["peak_bytes"])
            print(f"memory: peak {worst['peak_bytes'] / 2**20:,.1f} MiB on rank {worst['rank']} over the first "
                  f"{worst['steps']} steps ({worst['how']}; every rank in {ctx.out / 'memory.json'})", flush=True)
            if line:
                print(line, flush=True)

    def on_exception(self, ctx: RunContext, error: BaseException) -> None:
        if self.counter is not None:  # leave no dispatch mode behind
            self.counter.stop()
            self.counter = None
