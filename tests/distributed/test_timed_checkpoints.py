"""``trainer.checkpoint_every_n_minutes`` on 2 real gloo ranks, and the record of an elastic restart (issue 45).

A time-based save must happen at the same step on every rank (a save is a collective): rank 0 is made slower than
rank 1 before each step's check, so their clocks disagree about when the minutes are up; the ranks agree on it with
the stop agreement's all-reduce and save together. Without the agreement they would each save when their own clock
said so, and the run would hang in a collective one rank never joins.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.dist import node_name
from gputrain.engine.hooks import Hook
from multiproc import run_ranks


class SlowRankZero(Hook):
    def after_step(self, ctx: Any, logs: Any) -> None:
        if ctx.dist.rank == 0:
            time.sleep(0.03)


def _data() -> TensorDataset:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


def _fit(out: str, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    return Trainer(out=out, accelerator="cpu", epochs=1, batch_size=2, progress_bar=False, pictures=0, loggers=[],
                   hooks=[SlowRankZero()], **options).fit(nn.Linear(4, 1), _data(), loss=nn.functional.mse_loss)


def _worker(info: Any, root: str) -> list[str]:
    _fit(str(Path(root) / "run"), strategy="ddp", devices=2, checkpoint_every_n_minutes=0.001, keep_last=100)
    return sorted(p.name for p in (Path(root) / "run" / "checkpoints").glob("step_*.pt"))


def test_time_based_checkpoints_are_saved_at_the_same_steps_on_every_rank(tmp_path):
    names = run_ranks(_worker, str(tmp_path), timeout_s=20)  # 2-4 s; the faults make the ranks hang
    assert names[0] == names[1] and len(names[0]) >= 3, names  # 0.06 s apart over a 16-step epoch


def _rename_host(monkeypatch, host: str) -> None:
    """This process's node named anew (it is taken once per process): the host changed, as on a requeue."""
    monkeypatch.setattr("socket.gethostname", lambda: host)
    node_name.cache_clear()


@pytest.fixture(autouse=True)
def _node_name_taken_anew():
    yield
    node_name.cache_clear()  # the next test in this process names its real host again


def test_a_restarted_job_records_its_membership_and_the_summary_counts_it(tmp_path, monkeypatch, capsys):
    """A resume after torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT) writes one record, naming the node
    that wrote the checkpoint and is gone and the one that took over (here a host renamed: as a requeued job
    on another machine); a resume by hand writes none."""
    out = str(tmp_path / "run")
    _rename_host(monkeypatch, "gone-host")
    Trainer(out=out, accelerator="cpu", epochs=1, batch_size=8, progress_bar=False, pictures=0,
            checkpoint_every_n_steps=2, max_steps_per_epoch=4).fit(nn.Linear(4, 1), _data(), loss=nn.functional.mse_loss)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _rename_host(monkeypatch, "new-host")
    capsys.readouterr()
    summary = Trainer(out=out, accelerator="cpu", epochs=2, batch_size=8, progress_bar=False, pictures=0,
                      resume="auto").fit(nn.Linear(4, 1), _data(), loss=nn.functional.mse_loss)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [change] = [r for r in records if r.get("event") in ("membership", "restart")]
    assert (change["event"], change["world_size_before"], change["world_size"], change["step"]) == ("restart", 1, 1, 4)
    assert change["seconds_lost"] >= 0 and change["samples_retrained"] == 0
    assert (change["nodes_left"], change["nodes_joined"]) == (["gone-host"], ["new-host"])  # a host per node: by host
    assert ("gputrain: the job restarted on its 1 process(es) (node gone-host left, node new-host joined) and resumed "
            "at step 4") in capsys.readouterr().out
    assert (summary["restarts"], summary["membership_changes"]) == (1, 0)
    # Started again once finished, it trains nothing and records nothing (a new user's finding: it did).
    Trainer(out=out, accelerator="cpu", epochs=2, batch_size=8, progress_bar=False, pictures=0,
            resume="auto").fit(nn.Linear(4, 1), _data(), loss=nn.functional.mse_loss)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert sum('"restart"' in line or '"membership"' in line for line in lines) == 1
