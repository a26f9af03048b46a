"""Whom a restart's membership record names (issue 45): nodes by host on a cluster, by ``host/pid`` where nodes share
a host, and nobody when the checkpoint is older than its record of nodes."""

from __future__ import annotations

import json

from gputrain.runs import membership


def _record(tmp_path, before: list[str], now: list[str]) -> dict:
    checkpoint = tmp_path / "step_000004.pt"
    checkpoint.write_bytes(b"")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "train/loss": 1.0}) + "\n")
    return membership.change_record(metrics=tmp_path / "metrics.jsonl", checkpoint=checkpoint, step=4, epoch=0,
                                    before=len(before), after=len(now), global_batch=8, nodes_before=before,
                                    nodes=now)


def test_a_cluster_names_nodes_by_host_so_a_requeue_on_the_same_machines_names_none(tmp_path):
    # A SLURM requeue: every node's step daemon is new, the machines are the same.
    record = _record(tmp_path, ["gpu1/100", "gpu2/200"], ["gpu1/300", "gpu2/400"])
    assert (record["nodes_left"], record["nodes_joined"]) == ([], [])
    assert membership.who(record) == ""
    record = _record(tmp_path, ["gpu1/100", "gpu2/200"], ["gpu1/300", "gpu3/500"])
    assert (record["nodes_left"], record["nodes_joined"]) == (["gpu2"], ["gpu3"])
    assert membership.who(record) == " (node gpu2 left, node gpu3 joined)"


def test_nodes_sharing_a_host_are_told_apart_by_pid_and_an_old_checkpoint_names_none(tmp_path):
    record = _record(tmp_path, ["h/1", "h/2"], ["h/1"])  # two agents on one machine; the second was killed
    assert (record["nodes_left"], record["nodes_joined"]) == (["h/2"], [])
    record = _record(tmp_path, ["h/1"], ["h/1", "h/7"])  # one joined beside it
    assert (record["nodes_left"], record["nodes_joined"]) == ([], ["h/7"])
    assert _record(tmp_path, [], ["h/1"])["nodes_joined"] == []  # written before checkpoints named their nodes
