"""The doctor's conclusions from per-rank records: pure functions, fed records as the ranks write them."""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

from gputrain.config import load_config
from gputrain.data.samplers import eval_shard
from gputrain.tools.diagnose.doctor_checks import (
    check_epoch_order,
    check_eval_sampler,
    check_input,
    check_lr,
    check_unused,
)
from gputrain.tools.diagnose.outcome import RankOutcome


def _ranks(*records_per_rank):
    return [RankOutcome(rank=r, ok=True, records=list(recs)) for r, recs in enumerate(records_per_rank)]


def _setup(indices, length, **extra):
    return {"kind": "setup", "eval": {"indices": indices, "length": length}, "batch_size": 4, "accumulate": 1,
            "global_batch": 8, "lr": 0.1, "unsynced_bn": [], **extra}


def test_a_padding_eval_sampler_fails_and_the_framework_one_passes():
    n, world = 11, 2
    padded = [list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False)) for r in range(world)]
    f = check_eval_sampler(_ranks(*([_setup(p, n)] for p in padded)))
    assert f.status == "FAIL" and "1 evaluated twice (padding), 0 never" in f.what
    exact = [eval_shard(n, r, world) for r in range(world)]
    assert check_eval_sampler(_ranks(*([_setup(s, n)] for s in exact))).status == "OK"


def _step(epoch, order=None, unused=(), wait=0.0, wall=0.01, first=False):
    rec = {"kind": "step", "epoch": epoch, "step": 0, "unused": list(unused), "wait_s": wait, "wall_s": wall,
           "first_of_epoch": first}
    if order is not None:
        rec["order"] = order
    return rec


def test_an_epoch_that_repeats_the_previous_order_fails():
    same = [_step(0, [3, 1, 2], first=True), _step(1, [3, 1, 2], first=True)]
    moved = [_step(0, [3, 1, 2], first=True), _step(1, [2, 3, 1], first=True)]
    assert check_epoch_order(_ranks(moved, same)).status == "FAIL"
    assert "rank(s) 1" in check_epoch_order(_ranks(moved, same)).what
    assert check_epoch_order(_ranks(moved, moved)).status == "OK"
    assert check_epoch_order(_ranks([_step(0, [1], first=True)])).status == "SKIP"


def test_unused_parameters_everywhere_or_on_one_rank():
    cfg = load_config(None, [])
    rank0 = [{"kind": "grads", "step": 1, "unused": ["extra.weight"]}]
    rank1 = [{"kind": "grads", "step": 1, "unused": []}]
    f = check_unused(_ranks(rank0, rank1), cfg)
    assert f.status == "FAIL" and "extra.weight (rank 0)" in f.what and "depends on the rank" in f.what
    f = check_unused(_ranks(rank0, rank0), cfg)
    assert f.status == "FAIL" and "never receive a gradient on any rank: extra.weight" in f.what
    on = load_config(None, ["trainer.find_unused_parameters=true"])
    assert check_unused(_ranks(rank0, rank0), on).status == "WARN"


def test_input_bound_and_the_workers_it_takes():
    # Steps after the first of the epoch: 30 ms waiting for data, 10 ms of model step.
    slow = [_step(0, first=True, wait=1.0, wall=2.0)] + [_step(0, wait=0.03, wall=0.04) for _ in range(3)]
    f = check_input(_ranks(slow), workers=0)
    assert f.status == "WARN" and "data.num_workers=3" in f.fix
    fast = [_step(0, first=True)] + [_step(0, wait=0.001, wall=0.04) for _ in range(3)]
    assert check_input(_ranks(fast), workers=0).status == "OK"


def test_input_pipeline_verdicts_from_given_timings():
    """The input-bound check as a pure function: times per step are given, never measured here."""
    def steps(wait, wall, n=3):  # the epoch's first step (workers starting up) is left out of the averages
        return [_step(0, first=True, wait=5.0, wall=6.0)] + [_step(0, wait=wait, wall=wall) for _ in range(n)]

    equal = check_input(_ranks(steps(0.02, 0.04)), workers=0)  # waiting 20 ms = 20 ms of model step: not input-bound
    assert (equal.status, equal.what) == ("OK", "waiting for data 20.0 ms vs 20.0 ms of model step per step (rank 0)")
    assert equal.fix == "loading is 100% of the step; data.num_workers=1 would overlap it with the model"
    small = check_input(_ranks(steps(0.002, 0.042)), workers=2)  # 5% of the step: no note
    assert (small.status, small.fix) == ("OK", "")
    over = check_input(_ranks(steps(0.002, 0.042), steps(0.03, 0.04)), workers=2)  # rank 1: 30 ms vs 10 ms
    assert over.status == "WARN"
    assert over.what == ("input-bound: waiting for data 30.0 ms vs 10.0 ms of model step per step (rank 1), with "
                         "data.num_workers=2")
    # 2 workers already: a batch costs about 2 x (30 + 10) = 80 ms of one worker, so 8 keep up with a 10 ms step.
    assert over.fix == "set data.num_workers=8 (about loading time / step time), or make __getitem__ cheaper"
    assert check_input(_ranks([]), workers=0).status == "SKIP"


def test_learning_rate_line_gives_the_scaled_values_and_other_device_counts():
    cfg = load_config(None, ["optim.lr=0.1", "optim.scale_lr=linear", "optim.reference_batch=16"])
    f = check_lr(_ranks([_setup([], 0, lr=0.05)]), cfg)
    assert "global batch 8 (4/device x 2 rank(s) x 1 accumulation), lr 0.05" in f.what
    assert "linear 0.05, sqrt 0.07071" in f.what and "4 devices: batch 16, lr 0.1" in f.what


def test_float16_headroom_warns_under_16_mixed_and_names_the_fix():
    from gputrain.tools.diagnose.headroom import ActivationPeaks, check_headroom

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with torch.no_grad():
        for layer, weight in ((model[0], 1.0), (model[1][0], 1000.0)):  # ones -> 4 -> 16,000: 4x below 65,504
            layer.weight.fill_(weight)
            layer.bias.zero_()
    peaks = ActivationPeaks(model)
    model(torch.ones(2, 4))
    seen = peaks.take()
    peaks.remove()
    assert set(seen) == {"0", "1", "1.0"} and seen["1.0"] == seen["1"] > 6550
    records = [{"kind": "end", "peaks": {f"module.{k}": v for k, v in seen.items()}},
               {"kind": "step", "loss_scale": 65536.0}, {"kind": "step", "loss_scale": 32768.0}]
    outcomes = [RankOutcome(rank=0, ok=True, records=records)]
    warned = check_headroom(outcomes, load_config(None, ["trainer.precision=16-mixed"]))
    assert warned.status == "WARN" and warned.what.startswith("2 module(s) within 10x of float16's largest value")
    assert warned.fix == "trainer.fp32_modules=[1.0] runs them in float32, or --precision bf16-mixed"  # the inner one
    assert warned.details[-1] == "loss scale over the dry run: 65536 -> 32768"
    noted = check_headroom(outcomes, load_config(None, ["trainer.precision=bf16-mixed"]))
    assert noted.status == "OK" and "not in float16 at precision bf16-mixed" in noted.fix
