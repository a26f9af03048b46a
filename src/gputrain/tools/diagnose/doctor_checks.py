"""What ``gputrain doctor`` concludes from the ranks' records: pure functions, one per check, and the report.

Every finding is one line: a status (OK, WARN, FAIL; SKIP when the dry run gave no data for it),
what was seen, and the fix. Any FAIL makes the command exit 1.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from gputrain.config import RunConfig
from gputrain.optim import scaled_lr
from gputrain.tools.diagnose.outcome import RankOutcome, describe_failure
from gputrain.tools.diagnose.probes import without_batch

SMALL_BN_BATCH = 16
"""Per-device batch under which per-rank BatchNorm statistics are too noisy to leave unsynchronised."""
INPUT_BOUND_RATIO = 1.0
"""Waiting for data longer than this fraction of the model step counts as input-bound (1: slower than the step)."""


@dataclass
class Finding:
    status: str
    """OK, WARN, FAIL or SKIP."""
    check: str
    what: str
    fix: str = ""
    details: list[str] = field(default_factory=list)

    def line(self) -> str:
        text = f"{self.status:<4} {self.check}: {self.what}"
        if self.fix:
            text += f" -> {'fix' if self.status in ('WARN', 'FAIL') else 'note'}: {self.fix}"
        return "\n".join([text] + [f"       {d}" for d in self.details])


@dataclass
class DoctorReport:
    recipe: str
    world_size: int
    accelerator: str
    wall_s: float
    findings: list[Finding]

    @property
    def failed(self) -> bool:
        return any(f.status == "FAIL" for f in self.findings)

    def format(self) -> str:
        head = (f"gputrain doctor: {self.recipe} dry run on {self.world_size} rank(s) ({self.accelerator}), "
                f"{self.wall_s:.1f} s")
        counts = {s: sum(f.status == s for f in self.findings) for s in ("FAIL", "WARN", "OK", "SKIP")}
        tail = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return "\n".join([head, *(f.line() for f in self.findings), tail])

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "failed": self.failed}


def _by_kind(outcomes: list[RankOutcome], kind: str) -> dict[int, list[dict[str, Any]]]:
    return {o.rank: [r for r in o.records if r.get("kind") == kind] for o in outcomes}


def check_run(outcomes: list[RankOutcome], steps_done: int, wall_s: float) -> Finding:
    if all(o.ok for o in outcomes):
        return Finding("OK", "dry run", f"{steps_done} optimizer steps over 2 epochs on {len(outcomes)} rank(s) "
                                        f"in {wall_s:.1f} s")
    hung = any("timed out" in o.error.lower() or "timeout" in o.error.lower() for o in outcomes)
    logs = next((o.logs for o in outcomes if o.logs), "")
    what = (f"the run hung and timed out after step {steps_done}" if hung
            else f"a rank failed after step {steps_done}") + "; per rank, the error and the last collective it entered:"
    fix = ("the rank that failed first is the cause; the others wait in a collective it never joined"
           + (f" (full worker logs: {logs})" if logs else ""))
    return Finding("FAIL", "dry run", what, fix, details=describe_failure(outcomes))


def _unused_per_rank_step(outcomes: list[RankOutcome]) -> dict[tuple[int, int], set[str]]:
    seen: dict[tuple[int, int], set[str]] = {}
    for o in outcomes:
        for r in o.records:
            if r.get("kind") in ("grads", "step") and r.get("unused") is not None:
                seen[(o.rank, r["step"])] = set(r["unused"])
    return seen


def check_unused(outcomes: list[RankOutcome], cfg: RunConfig) -> Finding:
    seen = _unused_per_rank_step(outcomes)
    if not seen:
        return Finding("SKIP", "unused parameters", "no backward pass completed, nothing to inspect")
    everywhere = set.intersection(*seen.values())
    somewhere = set.union(*seen.values()) - everywhere
    flag_on = cfg.trainer.find_unused_parameters
    if everywhere:
        names = ", ".join(sorted(everywhere))
        return Finding("WARN" if flag_on else "FAIL", "unused parameters",
                       f"{len(everywhere)} parameter(s) never receive a gradient on any rank: {names} (DDP without "
                       "find_unused_parameters stops with 'Expected to have finished reduction' and no names)",
                       "remove them from the model or freeze them (requires_grad=False); "
                       "trainer.find_unused_parameters=true also works, at the cost of a graph traversal every step")
    if somewhere:
        where = []
        for name in sorted(somewhere):
            ranks = sorted({r for (r, _), names in seen.items() if name in names})
            where.append(f"{name} (rank {', '.join(map(str, ranks))})")
        return Finding("WARN" if flag_on else "FAIL", "unused parameters",
                       f"parameters get no gradient on some ranks or steps only: {'; '.join(where[:8])}"
                       + (" ..." if len(where) > 8 else "") + ": the forward pass depends on the rank or the batch",
                       "make every rank use the same parameters each step; if the model must skip parts per batch, "
                       "set trainer.find_unused_parameters=true")
    return Finding("OK", "unused parameters", "every trainable parameter received a gradient on every rank and step")


def check_batchnorm(outcomes: list[RankOutcome], world_size: int) -> list[Finding]:
    setup = next((r[0] for r in _by_kind(outcomes, "setup").values() if r), None)
    if setup is None:
        return [Finding("SKIP", "BatchNorm", "the run ended before training started")]
    unsynced, batch = setup["unsynced_bn"], setup["batch_size"]
    ends = {rank: recs[0]["bn"] for rank, recs in _by_kind(outcomes, "end").items() if recs}
    any_bn = bool(unsynced) or any(ends.values())
    if not any_bn:
        return [Finding("OK", "BatchNorm", "the model has no BatchNorm layers")]
    found = []
    if unsynced and world_size > 1 and batch < SMALL_BN_BATCH:
        names = ", ".join(unsynced[:5]) + (f" and {len(unsynced) - 5} more" if len(unsynced) > 5 else "")
        found.append(Finding("WARN", "BatchNorm sync", f"{len(unsynced)} BatchNorm layer(s) normalise over {batch} "
                             f"samples per device, not the global batch of {setup['global_batch']}: {names}",
                             "set trainer.sync_batchnorm=true (statistics of the global batch on every rank)"))
    elif unsynced and world_size > 1:
        found.append(Finding("OK", "BatchNorm sync", f"{len(unsynced)} BatchNorm layer(s) per rank at {batch} samples "
                             "per device (enough for per-rank statistics)"))
    else:
        found.append(Finding("OK", "BatchNorm sync", "BatchNorm layers are synchronised across ranks"))
    if len(ends) > 1:
        worst, layer = 0.0, ""
        ref = ends[min(ends)]
        for values in ends.values():
            for key, v in values.items():
                if key in ref and len(ref[key]) == len(v):
                    d = max((abs(a - b) for a, b in zip(ref[key], v, strict=True)), default=0.0)
                    if d > worst:
                        worst, layer = d, key
        if worst > 1e-6:
            found.append(Finding("WARN", "BatchNorm buffers", f"running statistics differ across ranks after the "
                                 f"dry run (largest: {worst:.3g} in {layer}); a checkpoint keeps rank 0's only",
                                 "set trainer.sync_batchnorm=true, so every rank keeps the same statistics"))
        else:
            found.append(Finding("OK", "BatchNorm buffers", "running statistics are identical on every rank"))
    return found


def _rank_shapes(outcomes: list[RankOutcome], key: str) -> dict[int, list[Any]]:
    return {rank: [r[key] for r in recs if r.get(key) is not None]
            for rank, recs in _by_kind(outcomes, "step").items()}


def check_shapes(outcomes: list[RankOutcome]) -> list[Finding]:
    found = []
    for key, label in (("inputs", "input"), ("outputs", "output")):
        per_rank = {r: s for r, s in _rank_shapes(outcomes, key).items() if s}
        if len(per_rank) < 2:
            continue
        constant = all(all(without_batch(x) == without_batch(sigs[0]) for x in sigs) for sigs in per_rank.values())
        if not constant:
            found.append(Finding("OK", f"{label} shapes", f"{label} shapes vary from batch to batch on a rank "
                                 "(variable-size data); not compared across ranks"))
            continue
        firsts = {r: sigs[0] for r, sigs in per_rank.items()}
        if len({repr(without_batch(s)) for s in firsts.values()}) > 1:
            shown = "; ".join(f"rank {r} {s}" for r, s in sorted(firsts.items()))
            found.append(Finding("FAIL", f"{label} shapes", f"{label} shapes differ across ranks: {shown}",
                                 "make every rank produce the same shapes (resize or crop in the dataset, e.g. "
                                 "data.image_size; data must not depend on the rank); collectives on such tensors "
                                 "hang or fail"))
        else:
            found.append(Finding("OK", f"{label} shapes", f"the same on every rank: {firsts[min(firsts)]}"))
    return found


def check_eval_sampler(outcomes: list[RankOutcome]) -> Finding:
    parts = [recs[0]["eval"] for recs in _by_kind(outcomes, "setup").values() if recs]
    if not parts or parts[0] is None:
        return Finding("SKIP", "eval sampler", "no validation data")
    length = parts[0]["length"]
    flat = [i for p in parts for i in p["indices"]]
    unique = set(flat)
    dups, missing = len(flat) - len(unique), length - len(unique & set(range(length)))
    if dups or missing:
        return Finding("FAIL", "eval sampler", f"the evaluation shards hold {len(flat)} samples for a set of {length}: "
                       f"{dups} evaluated twice (padding), {missing} never", "shard evaluation without padding "
                       "(gputrain's EvalSampler; torch's DistributedSampler pads shards to equal length)")
    return Finding("OK", "eval sampler", f"the {len(parts)} rank shard(s) cover all {length} validation samples once")


def check_epoch_order(outcomes: list[RankOutcome]) -> Finding:
    repeats, compared = [], 0
    for rank, recs in _by_kind(outcomes, "step").items():
        orders = {r["epoch"]: r["order"] for r in recs if r.get("order") is not None}
        if 0 in orders and 1 in orders:
            compared += 1
            if orders[0] == orders[1]:
                repeats.append(rank)
    if not compared:
        return Finding("SKIP", "train sampler", "the dry run did not reach a second epoch")
    if repeats:
        return Finding("FAIL", "train sampler", f"epoch 1 starts with exactly epoch 0's samples on rank(s) "
                       f"{', '.join(map(str, repeats))}: the sampler's epoch is never set",
                       "call sampler.set_epoch(epoch) before every epoch (gputrain's loop does; a strategy or "
                       "sampler of your own must too)")
    return Finding("OK", "train sampler", "each epoch draws a new sample order")


def check_writes(outcomes: list[RankOutcome]) -> list[Finding]:
    files: dict[str, int] = {}
    printed: dict[int, list[str]] = {}
    for rank, recs in _by_kind(outcomes, "end").items():
        w = recs[0].get("writes") if recs else None
        if rank == 0 or not w:
            continue
        for path, n in w["files"].items():
            files[f"{path} (rank {rank})"] = n
        if w["printed"]:
            printed[rank] = w["printed"]
    found = []
    if files:
        shown = ", ".join(list(files)[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
        found.append(Finding("WARN", "rank-0 writes", f"ranks other than 0 opened files for writing: {shown}",
                             "write only where trainer.dist.is_main (rank 0 owns the run folder); per-rank "
                             "scratch files belong in a temporary folder"))
    else:
        found.append(Finding("OK", "rank-0 writes", "no rank other than 0 wrote a file"))
    if printed:
        rank, lines = next(iter(printed.items()))
        found.append(Finding("WARN", "rank-0 logging", f"rank {rank} printed {len(lines)} line(s), e.g. "
                             f"{lines[0]!r}: every rank's output interleaves in the log",
                             "print and log only where trainer.dist.is_main"))
    else:
        found.append(Finding("OK", "rank-0 logging", "no rank other than 0 printed"))
    return found


def check_input(outcomes: list[RankOutcome], workers: int) -> Finding:
    worst: tuple[float, float, int] | None = None
    for rank, recs in _by_kind(outcomes, "step").items():
        timed = [r for r in recs if not r["first_of_epoch"]] or recs[1:] or recs
        if not timed:
            continue
        wait = sum(r["wait_s"] for r in timed) / len(timed)
        step = max(sum(r["wall_s"] - r["wait_s"] for r in timed) / len(timed), 1e-9)
        if worst is None or wait / step > worst[0] / worst[1]:
            worst = (wait, step, rank)
    if worst is None:
        return Finding("SKIP", "input pipeline", "no training step completed")
    wait, step, rank = worst
    numbers = f"waiting for data {wait * 1e3:.1f} ms vs {step * 1e3:.1f} ms of model step per step (rank {rank})"
    if wait <= INPUT_BOUND_RATIO * step:
        note = "" if wait <= 0.25 * step else \
            f"loading is {wait / step:.0%} of the step; data.num_workers={workers + 1} would overlap it with the model"
        return Finding("OK", "input pipeline", numbers, note)
    # With w workers already, a batch costs about w x (wait + step) of one worker's time.
    load = wait if workers == 0 else workers * (wait + step)
    need = max(math.ceil(load / step), workers + 1)
    return Finding("WARN", "input pipeline", f"input-bound: {numbers}, with data.num_workers={workers}",
                   f"set data.num_workers={need} (about loading time / step time), or make __getitem__ cheaper")


def check_lr(outcomes: list[RankOutcome], cfg: RunConfig) -> Finding:
    setup = next((r[0] for r in _by_kind(outcomes, "setup").values() if r), None)
    if setup is None:
        return Finding("SKIP", "learning rate", "the run ended before training started")
    o, t = cfg.optim, cfg.trainer
    g, per = setup["global_batch"], setup["batch_size"] * setup["accumulate"]
    ranks = max(g // max(per, 1), 1)
    what = (f"global batch {g} ({setup['batch_size']}/device x {ranks} rank(s) x {setup['accumulate']} "
            f"accumulation), lr {setup['lr']:.4g} (optim.lr={o.lr:g}, optim.scale_lr={o.scale_lr}); "
            f"from optim.reference_batch={o.reference_batch}: linear {scaled_lr(o.lr, g, o.reference_batch, 'linear'):.4g},"
            f" sqrt {scaled_lr(o.lr, g, o.reference_batch, 'sqrt'):.4g}")
    other = sorted({1, 2, 4, 8, t.devices} - {ranks})
    changes = "; ".join(f"{d} devices: batch {per * d}, lr {scaled_lr(o.lr, per * d, o.reference_batch, o.scale_lr):.4g}"
                        for d in other[:4])
    fix = ("with scale_lr=none the lr stays the same whatever the device count: set optim.scale_lr=linear (SGD) or "
           "sqrt (Adam) and optim.reference_batch to the batch optim.lr was tuned for" if o.scale_lr == "none"
           else "")
    return Finding("OK", "learning rate", f"{what}. If the device count changes: {changes}", fix)
