"""Compare each parity mode with ``single`` and name the cause of a difference; the table and its JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gputrain.tools.diagnose.outcome import RankOutcome, describe_failure, mode_result_path


@dataclass
class ModeResult:
    """What one mode did, merged over its ranks."""

    name: str
    ok: bool
    error: str = ""
    details: list[str] = field(default_factory=list)
    """Per-rank error lines and last collectives of a failed mode."""
    losses: list[float] = field(default_factory=list)
    samples: list[list[int]] = field(default_factory=list)
    """Per step, every rank's sample indices together, sorted."""
    unused: dict[int, list[list[str]]] = field(default_factory=dict)
    """Per rank, per step: trainable parameters that got no gradient on that rank."""
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    bn: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per rank: BatchNorm running statistics at the end."""

    @classmethod
    def from_ranks(cls, name: str, values: list[dict[str, Any]], dp: int = 1) -> ModeResult:
        """Merge ranks. With data parallelism each sample belongs to one rank (a repeat is kept, to be seen);
        without it (one process, or pipeline stages) rank 0 reads every sample of the batch (a pipeline's other
        stages read it again, the last for targets), and its reads are the step's, repeats included
        (``data.repeated_augment``)."""
        steps = max(len(v["samples"]) for v in values)
        readers = values if dp > 1 else values[:1]
        per_step = [[i for v in readers if k < len(v["samples"]) for i in v["samples"][k]] for k in range(steps)]
        samples = [sorted(s) for s in per_step]
        return cls(name, ok=True, losses=list(values[0]["losses"]), samples=samples,
                   unused={r: v["unused"] for r, v in enumerate(values)}, state=values[0]["state"],
                   bn=[v["bn"] for v in values])

    @classmethod
    def failed(cls, name: str, outcomes: list[RankOutcome], per_rank: list[dict[str, Any] | None]) -> ModeResult:
        details, errors = [], []
        for o, v in zip(outcomes, per_rank, strict=True):
            if v is not None and not v["ok"]:
                errors.append(f"rank {o.rank}: {v['error']}")
                details.append(f"rank {o.rank}: {v['error']}" + (f"; last collective {v['last_collective']}"
                                                                  if v.get("last_collective") else ""))
        bad = [o for o in outcomes if not o.ok]
        details += describe_failure(bad)
        logs = next((o.logs for o in outcomes if o.logs), "")
        if logs:
            details.append(f"full worker logs: {logs}")
        errors += [f"rank {o.rank}: {o.error}" for o in bad]
        unused: dict[int, list[list[str]]] = {}
        for o in outcomes:
            started = False
            for rec in o.records:
                if rec.get("kind") == "start":
                    started = rec["mode"] == name
                elif started and rec.get("kind") == "grads" and rec.get("mode") == name:
                    unused.setdefault(o.rank, []).append(rec["unused"])
        return cls(name, ok=False, error=errors[0] if errors else "the mode did not finish", details=details,
                   unused=unused)


@dataclass
class Row:
    mode: str
    status: str
    """PASS, FAIL, WARN (a difference that is expected, see cause), SKIP or REF."""
    processes: int = 0
    batch: str = ""
    loss_diff: float | None = None
    loss_diffs: list[float] = field(default_factory=list)
    """|loss - single's loss| at each step."""
    losses: list[float] = field(default_factory=list)
    weight_diff: float | None = None
    worst_key: str = ""
    """The state_dict entry with the largest difference."""
    first_loss_step: int = 0
    """The first step whose loss differs beyond the tolerance (1-based; 0: none)."""
    key_mismatch: list[str] = field(default_factory=list)
    bn_ranks: str = "-"
    samples: str = "-"
    cause: str = ""
    details: list[str] = field(default_factory=list)


@dataclass
class ParityReport:
    name: str
    global_batch: int
    steps: int
    epochs: int
    tol: float
    wall_s: float
    rows: list[Row]

    @property
    def failed(self) -> bool:
        return any(r.status == "FAIL" for r in self.rows)

    def format(self) -> str:
        def num(x: float | None) -> str:
            return "-" if x is None else f"{x:.2e}"

        head = (f"gputrain parity: {self.name}, global batch {self.global_batch}, {self.steps * self.epochs} steps "
                f"({self.epochs} epochs x {self.steps}), tolerance {self.tol:g}, {self.wall_s:.1f} s")
        cols = ("mode", "procs", "batch/proc", "max|dloss|", "max|dweight|", "keys", "BN ranks", "samples", "result")
        table = [cols]
        for r in self.rows:
            keys = "-" if r.status in ("SKIP", "REF") or not r.status else (f"{len(r.key_mismatch)} differ"
                                                                            if r.key_mismatch else "same")
            table.append((r.mode, str(r.processes or "-"), r.batch or "-", num(r.loss_diff), num(r.weight_diff), keys,
                          r.bn_ranks, r.samples, r.status))
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
        for r in self.rows:
            if r.cause:
                lines.append(f"{r.mode}: {r.cause}")
                lines += [f"    {d}" for d in r.details]
        lines.append("FAIL" if self.failed else "PASS")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "failed": self.failed}


def _bn_spread(bn: list[dict[str, torch.Tensor]]) -> tuple[float, str]:
    """Largest difference of a BatchNorm buffer between ranks, and which one."""
    worst, where = 0.0, ""
    for other in bn[1:]:
        for k, v in other.items():
            if k in bn[0] and bn[0][k].shape == v.shape:
                d = float((bn[0][k].double() - v.double()).abs().max()) if v.numel() else 0.0
                if d > worst:
                    worst, where = d, k
    return worst, where


def _unused_cause(mode: ModeResult, ref: ModeResult) -> str:
    """Parameters that got no gradient on some rank of ``mode`` but do in ``single``."""
    ref_unused = set.union(set(), *(set(u) for u in ref.unused.get(0, [])))
    found: dict[str, set[int]] = {}
    for rank, per_step in mode.unused.items():
        for names in per_step:
            for n in set(names) - ref_unused:
                found.setdefault(n, set()).add(rank)
    if not found:
        return ""
    shown = ", ".join(f"{n} (rank {', '.join(map(str, sorted(r)))})" for n, r in sorted(found.items())[:6])
    return (f"parameter(s) got no gradient on some ranks but do in single: {shown}; the forward pass depends on "
            "the rank (DDP then fails or averages a gradient that one rank never computed)")


def _sample_cause(mode: ModeResult, ref: ModeResult, epochs: int) -> tuple[str, str]:
    """(column text, cause) when a step trained other samples than single's same step."""
    steps = max(len(ref.samples) // max(epochs, 1), 1)  # steps an epoch really had (a small set has fewer)
    for k, (a, b) in enumerate(zip(mode.samples, ref.samples, strict=False)):
        if a != b:
            epoch, first = divmod(k, steps)
            if epoch >= 1 and first < len(mode.samples) and mode.samples[k] == mode.samples[k - steps]:
                return (f"differ at step {k + 1}", f"epoch {epoch} repeats epoch {epoch - 1}'s samples from step "
                        f"{k + 1}: the training sampler's set_epoch is never called in this mode")
            return f"differ at step {k + 1}", f"step {k + 1} trained other samples than single's step {k + 1}"
    if len(mode.samples) != len(ref.samples):
        return "differ", f"ran {len(mode.samples)} steps, single ran {len(ref.samples)}"
    return "same", ""


def scaled_difference(a: torch.Tensor, reference: torch.Tensor) -> float:
    """max |a - reference| / max(1, |reference|): absolute for weights (values near 1 or less), relative for large
    buffers, so a BatchNorm running variance in the hundreds is judged to its own size, not to the tolerance of a
    weight (float rounding leaves 1e-4 there, 1e-7 of its size)."""
    ref = reference.double()
    return float(((a.double() - ref).abs() / ref.abs().clamp(min=1.0)).max())


def compare_mode(mode: ModeResult, ref: ModeResult, *, processes: int, batch: str, micro_batched: bool, epochs: int,
                 tol: float) -> Row:
    row = Row(mode.name, "PASS", processes=processes, batch=batch)
    if not mode.ok:
        row.status, row.details = "FAIL", mode.details
        unused = _unused_cause(mode, ref)
        row.cause = f"did not finish: {mode.error}" + (f". Cause: {unused}" if unused else "")
        return row
    row.losses = mode.losses
    # A step that logs no loss in both modes (16-mixed: the loss scaler skipped it in both) is the same step.
    row.loss_diffs = [0.0 if math.isnan(a) and math.isnan(b) else abs(a - b)
                      for a, b in zip(mode.losses, ref.losses, strict=False)]
    row.loss_diff = max(row.loss_diffs, default=None) if mode.losses and ref.losses else None
    common = sorted(set(mode.state) & set(ref.state))
    row.key_mismatch = sorted(set(mode.state) ^ set(ref.state))
    # Floating-point entries only: BatchNorm's num_batches_tracked counts forwards, which micro-batching multiplies.
    diffs = {k: scaled_difference(mode.state[k], ref.state[k]) for k in common
             if mode.state[k].shape == ref.state[k].shape and mode.state[k].numel()
             and mode.state[k].is_floating_point()}
    row.weight_diff = max(diffs.values(), default=0.0)
    row.worst_key = max(diffs, key=diffs.__getitem__) if diffs else ""
    row.first_loss_step = next((k + 1 for k, diff in enumerate(row.loss_diffs) if not diff <= tol), 0)
    has_bn = any(mode.bn[0]) if mode.bn else False
    spread, where = _bn_spread(mode.bn) if len(mode.bn) > 1 else (0.0, "")
    if has_bn and len(mode.bn) > 1:
        row.bn_ranks = "agree" if spread <= tol else f"differ {spread:.1e}"
    row.samples, sample_cause = _sample_cause(mode, ref, epochs)
    bad_numbers = (any(math.isnan(x) for x in row.loss_diffs) or (row.loss_diff or 0.0) > tol
                   or not row.weight_diff <= tol)
    if not (bad_numbers or row.key_mismatch or sample_cause):
        return row
    unused = _unused_cause(mode, ref)
    if row.key_mismatch:
        row.cause = (f"state_dict keys differ from single's: {', '.join(row.key_mismatch[:6])}; the strategy must "
                     "save plain keys (no 'module.' prefix, full tensors)")
    elif sample_cause:
        row.cause = sample_cause
    elif unused:
        row.cause = unused
    elif has_bn and spread > tol:
        row.cause = (f"BatchNorm normalises each rank's {batch} samples, not the global batch: running statistics "
                     f"differ across ranks ({where}); set trainer.sync_batchnorm=true")
    elif has_bn and micro_batched:
        row.status = "WARN"
        row.cause = (f"BatchNorm sees micro-batches of {batch}, single the whole batch: the statistics differ by "
                     "design, so this mode cannot match (compare a model without BatchNorm, or GroupNorm)")
        return row
    else:
        row.cause = (f"losses or weights differ beyond {tol:g} with the same samples and gradients on every rank; "
                     "look for randomness drawn per rank (dropout, augmentation from the process RNG), non-deterministic kernels, or the strategy itself")
    row.status = "FAIL"
    return row


def compare(results: dict[str, ModeResult], skipped: dict[str, str], order: list[str], *, modes: dict[str, Any],
            global_batch: int, steps: int, epochs: int, tol: float, wall_s: float, name: str) -> ParityReport:
    ref = results.get("single")
    rows: list[Row] = []
    for mode_name in dict.fromkeys(order):
        mode = modes[mode_name]
        if mode_name in skipped:  # before the batch: a strategy that does not import cannot say its data parallelism
            rows.append(Row(mode_name, "SKIP", cause=f"skipped: {skipped[mode_name]}"))
            continue
        batch = str(mode.batch_size(global_batch)) + (f" x {mode.accumulate}" if mode.accumulate > 1 else "")
        if mode_name == "single":
            r = results["single"]
            rows.append(Row("single", "REF" if r.ok else "FAIL", processes=1, batch=batch, losses=r.losses,
                            cause="" if r.ok else f"the reference failed: {r.error}", details=r.details))
        elif ref is None or not ref.ok:
            rows.append(Row(mode_name, "SKIP", processes=mode.processes, batch=batch, cause="no reference (single failed)"))
        else:
            rows.append(compare_mode(results[mode_name], ref, processes=mode.processes, batch=batch,
                                     micro_batched=mode.micro_batched, epochs=epochs, tol=tol))
    return ParityReport(name=name, global_batch=global_batch, steps=steps, epochs=epochs, tol=tol, wall_s=wall_s,
                        rows=rows)


def _mode_value(outcome: RankOutcome, folder: str, mode: str) -> dict[str, Any] | None:
    """What one rank reported for ``mode``: its saved result when it finished the mode (even if the rank was stopped
    later, in another mode), else the failure it returned, else None (it never got there)."""
    saved = mode_result_path(folder, mode, outcome.rank)
    if saved.is_file():
        value: dict[str, Any] = torch.load(saved, weights_only=True)
        return value
    if outcome.ok and isinstance(outcome.value, dict):
        return outcome.value.get(mode)
    return None


def collect_outcomes(outcomes: list[RankOutcome], pending: list[Any], results: dict[str, ModeResult],
                     folder: str) -> int:
    """Fold one launch's outcomes (its ranks' saved modes in ``folder``) into ``results``; returns how many pending
    modes it settled."""
    settled = 0
    for mode in pending:
        per_rank = [_mode_value(o, folder, mode.name) for o in outcomes]
        if all(v is not None and v["ok"] for v in per_rank):
            results[mode.name] = ModeResult.from_ranks(mode.name, [v for v in per_rank if v is not None], dp=mode.dp)
            settled += 1
            continue
        results[mode.name] = ModeResult.failed(mode.name, outcomes, per_rank)
        return settled + 1
    return settled
