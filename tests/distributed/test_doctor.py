"""``gputrain doctor`` on real ranks: it names what is wrong in models and data built to be wrong.

The tasks below are user code, referenced from the config as ``test_doctor:build_...`` exactly as a
recipe names ``package.module:function``; the doctor's workers import them by name.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from gputrain.config import load_config
from gputrain.tasks.base import Task
from gputrain.tasks.spec import TaskSpec
from gputrain.tools.diagnose.doctor import run_doctor

pytestmark = pytest.mark.slow
N = 48


class SmallNet(nn.Module):
    """Conv, global pooling and a linear head: any image size gives the same output shape."""

    def __init__(self, with_unused: bool = False, batchnorm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)  # enough work that reading in-memory tensors is the smaller part
        self.norm = nn.BatchNorm2d(32) if batchnorm else nn.Identity()
        self.head = nn.Linear(32, 2)
        if with_unused:
            self.spare = nn.Linear(4, 4)  # built, never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(F.relu(self.norm(self.conv(x))), 1).flatten(1))


class Images(Dataset):
    """Deterministic images; ``rank_sized`` makes rank 1's images larger, ``sleep_s`` makes each read slow."""

    def __init__(self, n: int, *, rank_sized: bool = False, sleep_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.rand(n, 3, 12, 12, generator=g), torch.randint(0, 2, (n,), generator=g)
        self.rank_sized, self.sleep_s = rank_sized, sleep_s
        self.printed = False

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.rank_sized and dist.is_initialized() and dist.get_rank() == 1:
            if not self.printed:
                print("rank 1 reads its first sample")  # planted: a rank other than 0 prints ...
                self.printed = True
            with open(os.environ["DOCTOR_TEST_FILE"], "a") as f:  # ... and writes a file
                f.write("x")
        x = self.x[i]
        if self.rank_sized and dist.is_initialized() and dist.get_rank() == 1:
            x = F.interpolate(x[None], size=(16, 16), mode="bilinear", align_corners=False)[0]
        return x, self.y[i]


def build_faulty(cfg) -> TaskSpec:
    """Faults at once: a spare parameter, BatchNorm at 4 per device, images sized by rank, a loader that sleeps,
    rank 1 printing and writing a file, and a convolution whose outputs come within 10x of float16's 65,504."""
    model = SmallNet(with_unused=True, batchnorm=True)
    with torch.no_grad():
        model.conv.weight.mul_(5e4)
    return TaskSpec(task=Task(F.cross_entropy), model=model,
                    train_data=Images(N, rank_sized=True, sleep_s=0.03), val_data=Images(11))


def build_clean(cfg) -> TaskSpec:
    return TaskSpec(task=Task(F.cross_entropy), model=SmallNet(), train_data=Images(N), val_data=Images(11))


def _doctor(task: str, env: dict[str, str] | None = None):
    cfg = load_config(None, [f"task={task}", "trainer.batch_size=4", "trainer.accelerator=cpu", "optim.name=sgd",
                             "optim.lr=0.1"])
    return run_doctor(cfg, devices=2, steps=3, timeout_s=60, env=env)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rank1") / "rank1.txt"


@pytest.fixture(scope="module")
def faulty(tmp_path_factory, written):
    # The workers' temporary folder is elsewhere, so that the planted file counts as a real write.
    env = {"TMPDIR": str(tmp_path_factory.mktemp("workers_tmp")), "DOCTOR_TEST_FILE": str(written)}
    return _doctor("test_doctor:build_faulty", env)


def _finding(report, check):
    found = [f for f in report.findings if f.check == check]
    assert found, f"no {check!r} finding in:\n{report.format()}"
    return found[0]


def test_doctor_names_the_unused_parameter(faulty):
    f = _finding(faulty, "unused parameters")
    assert f.status == "FAIL" and "spare.bias, spare.weight" in f.what, faulty.format()
    assert "find_unused_parameters" in f.fix
    assert faulty.failed


def test_doctor_names_shapes_that_differ_by_rank(faulty):
    f = _finding(faulty, "input shapes")
    assert f.status == "FAIL", faulty.format()
    assert "rank 0 [4, 3, 12, 12]; rank 1 [4, 3, 16, 16]" in f.what
    assert _finding(faulty, "output shapes").status == "OK"  # pooled: the head sees the same shape


def test_doctor_names_the_input_bound_loader(faulty):
    f = _finding(faulty, "input pipeline")  # 4 x 30 ms of sleep per step against a step of a few ms
    wait, step = (float(x) for x in re.search(r"waiting for data ([\d.]+) ms vs ([\d.]+) ms of model step", f.what).groups())
    assert wait >= 4 * 30, faulty.format()  # the planted sleep is a lower bound, however busy the machine
    # Input-bound is waiting longer than the model step; a machine so busy that the step of a 32-channel conv on 4
    # images of 12 x 12 outlasts 120 ms would make it not so, and the line must then say OK.
    if wait > step:
        assert f.status == "WARN" and f.what.startswith("input-bound"), faulty.format()
        assert "data.num_workers=" in f.fix
    else:
        assert f.status == "OK", faulty.format()


def test_doctor_names_writes_and_prints_from_rank_1(faulty, written):
    assert written.read_text() == "x" * 4 * 6  # the planted write happened: rank 1 read 4 samples in each of 6 steps
    files = _finding(faulty, "rank-0 writes")
    assert files.status == "WARN" and f"{written} (rank 1)" in files.what, faulty.format()
    printed = _finding(faulty, "rank-0 logging")
    assert printed.status == "WARN" and "rank 1 reads its first sample" in printed.what


def test_doctor_names_unsynced_batchnorm_at_a_small_batch(faulty):
    sync = _finding(faulty, "BatchNorm sync")
    assert sync.status == "WARN" and "over 4 samples per device" in sync.what and "norm" in sync.what
    assert "trainer.sync_batchnorm=true" in sync.fix
    assert _finding(faulty, "BatchNorm buffers").status == "WARN", faulty.format()


def test_doctor_names_the_module_closest_to_float16s_largest_value(faulty):
    room = _finding(faulty, "float16 headroom")
    # The dry run is at precision 32 here: the module is named, with the note, not warned about.
    assert room.status == "OK" and room.what.startswith("the tightest module, conv, is "), faulty.format()
    assert "not in float16 at precision" in room.fix and room.details[0].startswith("conv: largest |activation| ")


def test_doctor_passes_a_clean_run_and_reports_the_lr():
    report = _doctor("test_doctor:build_clean")
    # The input-pipeline check compares measured times: on a busy machine a rank descheduled while it reads a batch
    # looks input-bound, so its verdict is not asserted here (tests/unit/test_doctor_checks.py feeds it timings).
    bad = [f for f in report.findings if f.status in ("FAIL", "WARN") and f.check != "input pipeline"]
    assert not bad, report.format()
    timed = _finding(report, "input pipeline")
    assert timed.status in ("OK", "WARN") and "ms of model step per step (rank " in timed.what, report.format()
    assert not report.failed
    lr = _finding(report, "learning rate")
    assert "global batch 8 (4/device x 2 rank(s) x 1 accumulation), lr 0.1" in lr.what
    assert "linear 0.003125" in lr.what  # 0.1 x 8 / 256
    assert _finding(report, "eval sampler").status == "OK" and _finding(report, "train sampler").status == "OK"


class HangNet(SmallNet):
    """Rank 1 stops answering in its second training forward (a stand-in for a deadlocked data path)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            HangNet.calls += 1
            if HangNet.calls == 2 and dist.is_initialized() and dist.get_rank() == 1:
                time.sleep(600)
        return super().forward(x)


def build_hang(cfg) -> TaskSpec:
    return TaskSpec(task=Task(F.cross_entropy), model=HangNet(), train_data=Images(N), val_data=None)


def test_doctor_reports_each_ranks_last_collective_when_the_run_hangs():
    cfg = load_config(None, ["task=test_doctor:build_hang", "trainer.batch_size=4", "trainer.accelerator=cpu"])
    report = run_doctor(cfg, devices=2, steps=3, timeout_s=8)
    run = _finding(report, "dry run")
    assert report.failed and run.status == "FAIL" and "hung and timed out after step 1" in run.what, report.format()
    rank0 = next(d for d in run.details if d.startswith("rank 0:"))
    rank1 = next(d for d in run.details if d.startswith("rank 1:"))
    # Rank 0 timed out in the gradient all-reduce of step 2 (the flight recorder names it); rank 1 was
    # still inside the forward pass, which its stack shows.
    assert "last collective all_reduce" in rank0, report.format()
    # "stopped": rank 0 ended it after dumping its stack, instead of leaving it asleep for 600 s.
    assert "stopped" in rank1 and "test_doctor.py" in rank1 and "in forward" in rank1, report.format()
