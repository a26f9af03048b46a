"""Pure logic, no processes: samplers, schedules, config, checkpoints, precision, DataParallel checks."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
import torch

from gputrain.checkpoint import atomic_save, load_checkpoint
from gputrain.config import RunConfig, SchedulerConfig, TrainerConfig, load_config
from gputrain.data.samplers import EpochPlan, StepBatchSampler, epoch_permutation, eval_shard
from gputrain.dist import DistInfo
from gputrain.launcher.spec import LaunchSpec
from gputrain.optim import lr_factor
from gputrain.precision import build_precision
from gputrain.strategies import (
    STRATEGIES,
    Registered,
    available,
    build_strategy,
    strategy_class,
    strategy_names,
)
from gputrain.strategies.dp import (
    DataParallel,
    check_batch_covers_devices,
    check_module_on_first_device,
    check_targets_on_output_device,
)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [359, 360, 7])
def test_eval_shards_cover_every_sample_once(n, world):
    shards = [eval_shard(n, r, world) for r in range(world)]
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def _step_sets(n: int, world: int, batch: int, accumulate: int, drop_last: bool = False) -> list[list[int]]:
    plan = EpochPlan(n, seed=3, epoch=1, dp_size=world, batch_size=batch, accumulate=accumulate, drop_last=drop_last)
    return [sorted(i for micro in plan.micro_batches(k) for share in micro for i in share)
            for k in range(plan.num_steps)]


@pytest.mark.parametrize("n", [97, 101, 128, 5])
@pytest.mark.parametrize(("world", "batch", "accumulate"), [(1, 32, 1), (2, 16, 1), (3, 8, 1), (2, 8, 2), (4, 4, 2)])
def test_every_sample_once_and_steps_equal_one_process_with_the_global_batch(n, world, batch, accumulate):
    steps = _step_sets(n, world, batch, accumulate)
    assert sorted(i for step in steps for i in step) == list(range(n))  # no sample twice, none skipped
    reference = _step_sets(n, 1, world * batch * accumulate, 1)  # one process, the same global batch
    assert steps == reference


def test_rank_batches_of_a_short_last_step_may_be_empty_but_are_never_padded():
    plan = EpochPlan(97, seed=0, epoch=0, dp_size=2, batch_size=16, accumulate=1)
    last = plan.micro_batches(plan.num_steps - 1)
    assert [len(share) for share in last[-1]] == [1, 0]
    samplers = [StepBatchSampler(97, dp_rank=r, dp_size=2, batch_size=16) for r in range(2)]
    seen = [i for s in samplers for batch in s for _, i in batch]
    assert sorted(seen) == list(range(97))
    assert [len(s) for s in samplers] == [4, 3]


def test_mid_epoch_start_step_yields_exactly_the_unseen_samples():
    full = StepBatchSampler(101, dp_rank=0, dp_size=1, batch_size=10)
    full.set_epoch(2)
    resumed = [StepBatchSampler(101, dp_rank=r, dp_size=2, batch_size=5) for r in range(2)]
    for s in resumed:
        s.set_epoch(2, start_step=4)  # 4 steps of 10 done before the checkpoint
    before = [i for batch in list(full)[:4] for _, i in batch]
    after = [i for s in resumed for batch in s for _, i in batch]
    assert sorted(before + after) == list(range(101)) and not set(before) & set(after)


def test_train_order_depends_on_seed_and_epoch_only():
    assert epoch_permutation(50, 1, 2) == epoch_permutation(50, 1, 2)
    assert epoch_permutation(50, 1, 2) != epoch_permutation(50, 1, 3)
    assert epoch_permutation(50, 1, 2) != epoch_permutation(50, 2, 2)


def test_drop_last_drops_only_the_short_last_global_batch():
    steps = _step_sets(7, 2, 2, 1, drop_last=True)
    assert len(steps) == 1 and len(steps[0]) == 4


def test_lr_schedules():
    cosine = SchedulerConfig(name="cosine", warmup_steps=10)
    assert lr_factor(0, 110, 10, cosine) == pytest.approx(0.1)
    assert lr_factor(9, 110, 10, cosine) == pytest.approx(1.0)
    assert lr_factor(60, 110, 10, cosine) == pytest.approx(0.5)
    assert lr_factor(110, 110, 10, cosine) == pytest.approx(0.0)
    poly = SchedulerConfig(name="poly", power=1.0)
    assert lr_factor(50, 100, 10, poly) == pytest.approx(0.5)
    step = SchedulerConfig(name="step", step_epochs=2, gamma=0.1)
    assert lr_factor(19, 100, 10, step) == pytest.approx(1.0)
    assert lr_factor(20, 100, 10, step) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="scheduler.name='linearx'"):
        lr_factor(0, 10, 1, SchedulerConfig(name="linearx"))


def test_config_overrides_and_type_errors():
    cfg = load_config("autoencoder", ["trainer.epochs=3", "optim.lr=0.1", "trainer.loggers=[csv,wandb]"])
    assert (cfg.trainer.epochs, cfg.optim.lr, cfg.trainer.loggers) == (3, 0.1, ["csv", "wandb"])
    assert cfg.model.name == "conv_autoencoder"
    with pytest.raises(ValueError, match="trainer.epochs"):
        load_config("autoencoder", ["trainer.epochs=three"])
    with pytest.raises(ValueError, match="trainer.epohcs"):
        load_config("autoencoder", ["trainer.epohcs=3"])
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        load_config("nope")


def test_atomic_save_keeps_old_checkpoint_when_write_fails(tmp_path):
    path = tmp_path / "last.pt"
    atomic_save({"model": {"w": torch.ones(2)}}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_save({"model": {"w": torch.zeros(2)}, "bad": Unpicklable()}, path)
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left behind


def test_load_refuses_malicious_pickle_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"model": Exploit()}))
    with pytest.raises(ValueError, match="evil.pt cannot be loaded safely"):
        load_checkpoint(path)
    assert not marker.exists()


def test_truncated_checkpoint_error_names_file(tmp_path):
    path = tmp_path / "last.pt"
    atomic_save({"model": {"w": torch.ones(100)}}, path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="last.pt cannot be loaded safely"):
        load_checkpoint(path)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_mixed_by_name_is_refused_on_a_gpu_that_only_emulates_bfloat16(monkeypatch, native):
    # torch's answer as an H100 (native) and a V100 (emulated: yes unless emulation is excluded) give it; the
    # GPU itself is the one input a CPU machine cannot give (tests/distributed/test_cuda.py runs on a real one).
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    gpu = torch.device("cuda", 0)
    if native:
        assert build_precision("bf16-mixed", gpu).name == "bf16-mixed"
    else:
        with pytest.raises(ValueError, match="^trainer.precision=bf16-mixed but this GPU has no bfloat16; use 16-mixed$"):
            build_precision("bf16-mixed", gpu)


@pytest.mark.parametrize("name", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_trains_and_keeps_scaler_state(name):
    torch.manual_seed(0)
    precision = build_precision(name, torch.device("cpu"))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    x = torch.randn(8, 4) * 30  # gradients ~1e3: times the initial scale 65536 they overflow float16
    results = []
    for _ in range(12):
        with precision.forward_context():
            out = model(x)
            assert out.dtype == (torch.float16 if name == "16-mixed" else torch.bfloat16)
            loss = out.float().pow(2).mean()
        precision.backward(loss)
        results.append(precision.optimizer_step(opt))
        opt.zero_grad()
        if results[-1]:
            break
    assert results[-1] and not torch.equal(before, model.weight)
    state = precision.state_dict()
    if name == "16-mixed":
        assert results[0] is False  # the overflowing step was skipped, not applied
        assert state["scaler"]["scale"] == 65536.0 * 0.5 ** (len(results) - 1)
        other = build_precision(name, torch.device("cpu"))
        other.load_state_dict({"scaler": {**state["scaler"], "scale": 128.0}})
        assert other.scaler.get_scale() == 128.0
    else:
        assert results == [True] and state == {}


def test_unknown_precision_and_strategy_say_what_is_valid():
    with pytest.raises(ValueError, match="choose auto, mixed, 32, 16-mixed or bf16-mixed"):
        build_precision("8-bit", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"trainer.strategy='fsdp3' is unknown; choose one of .*ddp, dp,"):
        strategy_class("fsdp3")
    with pytest.raises(ValueError, match="use --strategy ddp"):
        build_strategy(load_config(None, ["trainer.strategy=single"]), DistInfo(world_size=2))


def test_a_run_imports_no_optional_strategy_until_it_names_one():
    # The pipeline's module pulls in torch.distributed.pipelining, torch._dynamo and DTensor: 1.5 s of CPU in
    # every launcher and rank (benchmarks/cli_startup.py). A fresh interpreter, since this one has them already.
    code = ("import sys, gputrain.engine.trainer, gputrain.cli\n"
            "from gputrain.strategies import strategy_class, strategy_names\n"
            "assert not [m for m in sys.modules if m.startswith(('torch.distributed.pipelining', 'torch._dynamo', "
            "'gputrain.strategies.pipeline', 'gputrain.strategies.fsdp', 'gputrain.strategies.model_parallel'))]\n"
            "assert strategy_names() == ['ddp', 'dp', 'fsdp', 'model_parallel', 'pipeline', 'single']\n"
            "assert strategy_class('pipeline').name == 'pipeline' and 'torch.distributed.pipelining' in sys.modules\n"
            "assert strategy_class('fsdp').name == 'fsdp' and strategy_class('model_parallel').name == 'model_parallel'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", strategy_names())
def test_the_launchers_process_count_is_each_strategys_own(name):
    """The launcher reads the strategy's registration (no torch import) and the class answers the same; no table
    elsewhere says it. Planted fault: FSDP registered as one process."""
    per_device = name in ("ddp", "fsdp", "pipeline")  # by hand: one process per device, or one for all of them
    for devices in (1, 2, 3):
        cfg = load_config(None, [f"trainer.strategy={name}", f"trainer.devices={devices}"]
                          + (["parallel.split_points=[]"] if name == "pipeline" else []))
        assert LaunchSpec.from_config(cfg).nproc_per_node == (devices if per_device else 1), (name, devices)
        assert strategy_class(name).processes_per_node(devices) == (devices if per_device else 1), (name, devices)


def test_an_unknown_strategy_is_one_line_from_the_launchers_count_too():
    with pytest.raises(ValueError, match=r"^trainer.strategy='pipelined' is unknown; choose one of ddp, dp, fsdp"):
        LaunchSpec.from_config(dataclasses.replace(RunConfig(), trainer=TrainerConfig(strategy="pipelined")))


def test_a_strategy_whose_torch_feature_is_missing_is_one_line_naming_the_module(tmp_path, monkeypatch):
    # A real module that fails to import the way an older torch would (no such torch submodule).
    (tmp_path / "strategy_from_the_future.py").write_text("import torch.distributed.not_in_this_torch\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(STRATEGIES, "future", Registered("strategy_from_the_future:Future"))
    with pytest.raises(ValueError, match=r"^trainer.strategy=future needs torch.distributed.not_in_this_torch, "
                                         r"which torch \S+ does not have; install the torch version in requirements.txt$"):
        strategy_class("future")
    assert not available("future")


# -- DataParallel traps: pure checks over device lists, so they run without GPUs ------------
CUDA = [torch.device("cuda", i) for i in range(3)]


def test_dp_model_must_sit_on_first_device():
    check_module_on_first_device([CUDA[0], CUDA[0]], CUDA)
    with pytest.raises(ValueError, match=r"device_ids\[0\]=cuda:0.*is on cuda:1.*model.to\('cuda:0'\)"):
        check_module_on_first_device([CUDA[0], CUDA[1]], CUDA)
    with pytest.raises(ValueError, match="is on cpu"):
        check_module_on_first_device([torch.device("cpu")], CUDA)


def test_dp_refuses_batch_smaller_than_device_count():
    check_batch_covers_devices(3, CUDA)
    with pytest.raises(ValueError, match="batch size 2 is smaller than the 3 devices in device_ids; use a batch size of at least 3"):
        check_batch_covers_devices(2, CUDA)


def test_dp_targets_must_meet_outputs_on_output_device():
    out = torch.empty(2, device="meta")
    check_targets_on_output_device(out, torch.empty(2, device="meta"), torch.device("meta"))
    with pytest.raises(ValueError, match=r"targets are on cpu but DataParallel gathers outputs on output_device=meta"):
        check_targets_on_output_device(out, torch.empty(2), torch.device("meta"))


def test_dp_strategy_on_cpu_warns_and_unwraps_without_prefix():
    with pytest.warns(UserWarning, match="device_ids and output_device are ignored"):
        strategy = DataParallel(DistInfo(), device_ids=[0, 1], output_device=1)
    module = strategy.setup_module(torch.nn.Linear(2, 2))
    assert isinstance(module, torch.nn.DataParallel)
    assert set(strategy.model_state_dict(module)) == {"weight", "bias"}
    with pytest.raises(ValueError, match="cannot run under a 2-process launch"):
        DataParallel(DistInfo(world_size=2))


def test_task_records_derived_model_arguments_in_config():
    from gputrain.config import ModelConfig
    from gputrain.models import build_configured_model

    cfg = ModelConfig(kwargs={"cifar_stem": False})
    model = build_configured_model(cfg, "resnet18", num_classes=7)
    assert cfg.name == "resnet18" and cfg.kwargs == {"num_classes": 7, "cifar_stem": False}
    assert model.fc.out_features == 7
    explicit = ModelConfig(name="resnet18", kwargs={"num_classes": 3})
    assert build_configured_model(explicit, "resnet50", num_classes=7).fc.out_features == 3


# -- sampling, known answers written by hand (issue 28 item 11) ---------------------------------------------------
def test_an_accumulating_epoch_deals_these_samples_to_each_rank_and_a_short_last_step_leaves_rank_1_none():
    # 9 samples in order, batch 2 on 2 ranks, accumulation 2: global batch 8, so step 0 holds samples 0-7 in two
    # micro-batches of 4 dealt by stride, and step 1 holds sample 8 alone (rank 1 gets nothing to read).
    plan = EpochPlan(9, seed=0, epoch=0, dp_size=2, batch_size=2, accumulate=2, shuffle=False)
    assert (plan.global_batch, plan.num_steps, plan.step_size(0), plan.step_size(1)) == (8, 2, 8, 1)
    assert plan.micro_batches(0) == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]
    assert plan.micro_batches(1) == [[[8], []]]
    ranks = [StepBatchSampler(9, dp_rank=r, dp_size=2, batch_size=2, accumulate=2, shuffle=False) for r in range(2)]
    for s in ranks:
        s.set_epoch(3)
    assert list(ranks[0]) == [[(3, 0), (3, 2)], [(3, 4), (3, 6)], [(3, 8)]]
    assert list(ranks[1]) == [[(3, 1), (3, 3)], [(3, 5), (3, 7)]]
    assert [len(s) for s in ranks] == [3, 2]
    for s in ranks:
        s.set_epoch(4, start_step=1)  # resumed after step 0 of epoch 4
    assert [list(s) for s in ranks] == [[[(4, 8)]], []] and [len(s) for s in ranks] == [1, 0]


def test_drop_last_keeps_only_whole_global_batches():
    plan = EpochPlan(9, seed=0, epoch=0, dp_size=2, batch_size=2, accumulate=2, drop_last=True, shuffle=False)
    assert (plan.num_samples, plan.num_steps) == (8, 1)
    assert plan.micro_batches(0) == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]


def test_the_evaluation_sampler_gives_each_rank_every_world_size_th_sample():
    from gputrain.data.samplers import EvalSampler

    assert [list(EvalSampler(11, rank=r, world_size=3)) for r in range(3)] == [
        [0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert [len(EvalSampler(11, rank=r, world_size=3)) for r in range(3)] == [4, 4, 3]
    assert list(EvalSampler(4)) == [0, 1, 2, 3]


def test_no_two_seeds_share_an_epochs_order():
    orders = {(seed, epoch): tuple(epoch_permutation(40, seed, epoch)) for seed in range(4) for epoch in range(4)}
    assert len(set(orders.values())) == 16, "two (seed, epoch) pairs draw the same order"


def test_reading_a_seeded_sample_leaves_the_callers_generator_as_it_was():
    """Augmentation draws from its own (seed, epoch, index) stream; dropout's stream in the caller goes on untouched."""
    from gputrain.data.samplers import SeededSamples

    class Draws(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.rand(2)

    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    samples = SeededSamples(Draws(), seed=5)
    first = samples[(0, 1)]
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(samples[(0, 1)], first)


# -- resume: the per-device batch that keeps the checkpoint's global batch ---------------------------------------
def test_a_resume_keeps_the_global_batch_counting_accumulation():
    from gputrain.config.resolve import resumed_batch_size

    assert resumed_batch_size(16, 2, 2, 4, "run/last.pt") == 4  # as saved: 4 x 2 ranks x 2 accumulation
    assert resumed_batch_size(16, 4, 2, 4, "run/last.pt") == 2  # 4 ranks: 2 each
    assert resumed_batch_size(16, 1, 4, 1, "run/last.pt") == 4  # one rank, 4 micro-batches
    assert resumed_batch_size(24, 2, 3, 2, "run/last.pt") == 4
    with pytest.raises(ValueError) as err:  # 12 = 2 ranks x 4 micro-batches x 1.5
        resumed_batch_size(12, 2, 4, 1, "run/last.pt")
    assert str(err.value) == ("checkpoint run/last.pt was trained with global batch 12, which 2 process(es) x "
                              "accumulation 4 cannot split evenly; resume on 1, 3 process(es), or set "
                              "trainer.accumulate_grad_batches so that it divides")
    with pytest.raises(ValueError, match=r"global batch 10, which 4 process\(es\) x accumulation 1 cannot split "
                                         r"evenly; resume on 1, 2, 5, 10 process\(es\)"):
        resumed_batch_size(10, 4, 1, 2, "run/last.pt")
