"""An elastic job's changes of membership, as ``metrics.jsonl`` records them (issue 45).

When torchrun's agents restart the workers (a node left, a node joined, a worker failed), the new workers resume
from the newest whole checkpoint, on whatever world size the rendezvous gave them. Rank 0 then appends one record:
the step it resumed at, the world size before (the checkpoint's) and now, the seconds since that checkpoint was
written (the work redone plus the time to notice and restart) and the samples trained after it that are trained
again (from the newest step ``metrics.jsonl`` logged before the restart), and the nodes that left and joined:
each named ``host/pid`` (:func:`gputrain.dist.node_name`), the checkpoint's nodes against this world's.
``summary.json`` counts them, and ``curves.png`` marks each with a line at its epoch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gputrain.runs.records import read_metrics

EVENT = "membership"
"""A record's ``event`` when the world size changed; ``restart`` when the workers restarted on the same one."""


def change_record(*, metrics: Path, checkpoint: Path, step: int, epoch: int, before: int, after: int,
                  global_batch: int, nodes_before: list[str], nodes: list[str]) -> dict[str, Any]:
    """The record of a resume after a restart: where, what changed, and what it cost. ``nodes_before``: the nodes the
    checkpoint was written by (``host/pid``; empty for a checkpoint older than the field); ``nodes``: this world's."""
    logged = [int(r["step"]) for r in read_metrics(metrics) if "event" not in r and isinstance(r.get("step"), int)]
    redone = max(0, max(logged, default=step) - step)
    now = time.time()
    return {"time": round(now, 3), "event": EVENT if before != after else "restart", "epoch": epoch, "step": step,
            "world_size_before": before, "world_size": after,
            "seconds_lost": round(max(0.0, now - checkpoint.stat().st_mtime), 3),
            "samples_retrained": redone * global_batch,
            **_left_and_joined(set(nodes_before), set(nodes))}


def _left_and_joined(before: set[str], now: set[str]) -> dict[str, list[str]]:
    """The nodes of ``before`` not in ``now`` and the reverse. Where every node of both worlds has a host of its own
    (a cluster) a node is its host, so a job requeued or restarted on the same machines names none; where nodes
    share a host (several on one machine) they are told apart by ``host/pid``."""
    if not before:  # a checkpoint older than the field: nobody to compare with
        return {"nodes_left": [], "nodes_joined": []}
    hosts = [{name.rsplit("/", 1)[0] for name in world} for world in (before, now)]
    if all(len(h) == len(world) for h, world in zip(hosts, (before, now), strict=True)):
        before, now = hosts[0], hosts[1]
    return {"nodes_left": sorted(before - now), "nodes_joined": sorted(now - before)}


def who(record: dict[str, Any]) -> str:
    """`` (node h/12 left)``, `` (node h/12 left, node h/15 joined)`` or nothing, for the restart's line."""
    said = [f"node {n} left" for n in record.get("nodes_left", [])]
    said += [f"node {n} joined" for n in record.get("nodes_joined", [])]
    return f" ({', '.join(said)})" if said else ""


def counts(metrics: Path) -> dict[str, int]:
    """``summary.json``'s counts: membership changes and restarts on the same world size."""
    events = [r.get("event") for r in read_metrics(metrics)]
    return {"membership_changes": events.count(EVENT), "restarts": events.count("restart")}


def changes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The membership and restart records among ``records``, in order."""
    return [r for r in records if r.get("event") in (EVENT, "restart")]
