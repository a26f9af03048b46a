"""Where model_parallel puts each stage, and how batches are cut: pure functions, plus `meta` as a second device.

A stage on the ``meta`` device computes shapes only, and refuses an input left on the CPU: so a
forward that forgot to move activations between stages fails here, without any GPU.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from gputrain.config import OptimConfig, ParallelConfig, RunConfig, TrainerConfig
from gputrain.dist import DistInfo
from gputrain.parallel.blocks import sequential_blocks, split_stages
from gputrain.strategies import strategy_class
from gputrain.strategies.micro_batches import chunk_batch, equal_runs, split_size
from gputrain.strategies.model_parallel import ModelParallel, SplitModel, pipelined_forward
from gputrain.strategies.stages import block_devices, resolve_stage_devices, stage_of_blocks

CPU, META = torch.device("cpu"), torch.device("meta")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 8 * 8, 5))


def _strategy(*, devices: list[str], split: list[str] = (), partition: str = "params", micro: int = 2,
              batch: int = 4) -> ModelParallel:
    cfg = RunConfig(parallel=ParallelConfig(stage_devices=devices, split_points=list(split), partition=partition,
                                            micro_batches=micro),
                    trainer=TrainerConfig(strategy="model_parallel", batch_size=batch), optim=OptimConfig(name="sgd"))
    strategy = strategy_class("model_parallel").from_config(DistInfo(), cfg)
    assert isinstance(strategy, ModelParallel)
    return strategy


def test_default_devices_one_gpu_per_stage_or_all_cpu():
    assert resolve_stage_devices([], 2, accelerator="cpu", cuda_count=0) == [CPU, CPU]
    assert resolve_stage_devices([], 3, accelerator="cuda", cuda_count=4) == [torch.device("cuda", i) for i in range(3)]
    # One GPU, two stages: both on cuda:0 (the GPU benchmark's fallback), not an error.
    assert resolve_stage_devices([], 2, accelerator="cuda", cuda_count=1) == [torch.device("cuda", 0)] * 2


def test_given_devices_set_the_stage_count_and_are_checked():
    assert resolve_stage_devices(["cpu", "meta", "cpu"], 2, accelerator="cpu", cuda_count=0) == [CPU, META, CPU]
    assert resolve_stage_devices(["cuda"], 2, accelerator="cuda", cuda_count=1) == [torch.device("cuda", 0)]
    with pytest.raises(ValueError, match=r"parallel.stage_devices\[1\]='cuda:1' but this machine has 1 visible GPU"):
        resolve_stage_devices(["cuda:0", "cuda:1"], 2, accelerator="cuda", cuda_count=1)
    with pytest.raises(ValueError, match=r"parallel.stage_devices\[0\]='gpu0' is not a device"):
        resolve_stage_devices(["gpu0"], 1, accelerator="cpu", cuda_count=0)


def test_blocks_map_to_their_stage_device():
    names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "flatten", "fc"]
    assert stage_of_blocks(len(names), [6]) == [0] * 6 + [1] * 5
    placed = block_devices(names, [6], [CPU, META])
    assert [n for n, d in placed.items() if d == META] == ["layer3", "layer4", "avgpool", "flatten", "fc"]
    assert stage_of_blocks(5, [1, 3]) == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="2 stages but 3 stage devices"):
        block_devices(names, [6], [CPU, CPU, CPU])


def test_micro_batches_have_a_fixed_size_and_short_batches_get_fewer():
    assert split_size(8, 4) == 2 and split_size(10, 4) == 3 and split_size(3, 4) == 1
    x, y = torch.arange(5.0).reshape(5, 1), torch.arange(5)
    chunks = chunk_batch((x, {"y": y}), split_size(8, 4))
    assert [len(c[0]) for c in chunks] == [2, 2, 1]
    assert torch.equal(chunks[2][1]["y"], torch.tensor([4]))
    assert equal_runs([2, 2, 1]) == [(0, 2), (2, 3)]
    assert equal_runs([3, 3, 3, 3]) == [(0, 4)]


def test_stage_on_meta_receives_moved_activations():
    strategy = _strategy(devices=["cpu", "meta"], split=["4"])
    module = strategy.setup_module(_net())
    model = strategy.unwrap(module)
    out = module(torch.randn(5, 3, 8, 8))  # the first batch checks the chain, then places the stages
    assert [p.device for p in model[0].parameters()] == [CPU, CPU]
    assert {p.device for p in model[5].parameters()} == {META}
    assert strategy.root_device == CPU and strategy.output_device == META
    assert out.device == META and out.shape == (5, 5)


def test_a_missing_move_between_stages_is_caught_by_meta():
    stages = split_stages(sequential_blocks(_net()), [4])
    stages[1].to(META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        # Claims both stages are on the CPU, so the activation is never moved to stage 2's device.
        pipelined_forward(stages, [CPU, CPU], chunk_batch(torch.randn(4, 3, 8, 8), 2))


def test_split_resnet_matches_the_plain_model_and_keeps_its_keys():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=7)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    strategy = _strategy(devices=["cpu", "cpu"], split=["layer3"], micro=3, batch=6)
    module = strategy.setup_module(model).eval()
    x = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        reference = torchvision.models.resnet18(num_classes=7)
        reference.load_state_dict(plain)
        assert torch.allclose(module(x), reference.eval()(x), atol=1e-5)
    assert list(strategy.model_state_dict(module)) == list(plain)


def test_measured_split_waits_for_a_batch_then_rebinds_the_optimizer(capsys):
    strategy = _strategy(devices=["cpu", "meta"], partition="measured")
    module = strategy.setup_module(_net())
    assert isinstance(module, SplitModel) and module.stages is None
    optimizer = strategy.setup_optimizer(module, OptimConfig(name="sgd", lr=0.1))
    module(torch.randn(4, 3, 8, 8))  # profiles on the first device, then places the stages
    assert module.stages is not None and len(module.split) == 1
    params = list(strategy.unwrap(module).parameters())
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in params]
    assert META in {p.device for p in params}
    out = capsys.readouterr().out
    assert "2 stages by measured" in out
    # The plan's header comes once, with the plan (issue 15 item 8); setup said it waits for a batch in one line.
    assert out.count("model_parallel plan") == 1 and out.index("first batch") < out.index("model_parallel plan")


def test_bad_settings_fail_in_one_line():
    with pytest.raises(ValueError, match=r"parallel.split_points\[0\]='layer9' is not a block"):
        _strategy(devices=["cpu", "cpu"], split=["layer9"]).setup_module(torchvision.models.resnet18())
    with pytest.raises(ValueError, match="parallel.split_points has 1 names for 3 stages"):
        _strategy(devices=["cpu", "cpu", "cpu"], split=["layer3"])
    with pytest.raises(ValueError, match="trainer.batch_size=2 is smaller than parallel.micro_batches=4"):
        _strategy(devices=["cpu", "cpu"], micro=4).check_batch(2)
    assert ModelParallel.processes_per_node(8) == 1


@pytest.mark.parametrize(("override", "message"), [
    ({"parallel": ParallelConfig(schedule="1f1b", micro_batches=1)}, "parallel.schedule=1f1b needs parallel.micro_batches >= the 2 stages"),
    ({"trainer": TrainerConfig(precision="16-mixed")},
     "does not support trainer.precision=16-mixed, which `mixed` also means on a GPU without bfloat16"),
    ({"parallel": ParallelConfig(schedule="zb")}, "parallel.schedule='zb' is unknown"),
], ids=["1f1b-few-micro-batches", "16-mixed", "unknown-schedule"])
def test_pipeline_refuses_settings_it_cannot_honour(override, message):
    cfg = RunConfig(**override)
    with pytest.raises(ValueError, match=message):
        strategy_class("pipeline").from_config(DistInfo(rank=0, world_size=2), cfg)


def test_pipeline_reads_every_batch_on_every_stage_and_only_the_last_sees_outputs():
    first, last = (strategy_class("pipeline").from_config(DistInfo(rank=r, world_size=2), RunConfig()) for r in (0, 1))
    assert (first.dp_size, first.dp_rank, last.dp_size, last.dp_rank) == (1, 0, 1, 0)
    assert (first.computes_loss, last.computes_loss) == (False, True)
    assert strategy_class("pipeline").processes_per_node(4) == 4


def test_the_chain_check_leaves_batchnorm_mode_and_rng_as_they_were():
    from gputrain.strategies.stages import verify_chain

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(144, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(6, 3, 8, 8) * 5 + 3
    rng = torch.get_rng_state()
    verify_chain(model, sequential_blocks(model), x)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # running stats untouched
    assert model.training and torch.equal(torch.get_rng_state(), rng)


def test_a_correct_sequential_still_trains_after_the_check():
    strategy = _strategy(devices=["cpu", "cpu"], split=["4"])
    module = strategy.setup_module(_net())
    optimizer = strategy.setup_optimizer(module, OptimConfig(name="sgd", lr=0.1))
    module(torch.randn(4, 3, 8, 8)).sum().backward()
    optimizer.step()
    assert isinstance(module, SplitModel) and module.stages is not None and module.split == [4]


def test_the_launcher_refuses_a_pipeline_its_ranks_would_refuse_before_any_starts():
    """issue 28 item 5: the README's 1F1B command failed in rank 0 after ~8 s; config errors come before workers.
    Planted fault: the strategy options are not part of the launcher's config checks."""
    from gputrain.config import load_config

    with pytest.raises(ValueError, match=r"parallel.schedule=1f1b needs parallel.micro_batches >= the 2 stages; got 1"):
        load_config("autoencoder", ["trainer.strategy=pipeline", "trainer.devices=2", "parallel.schedule=1f1b"])
    with pytest.raises(ValueError, match=r"needs parallel.micro_batches >= the 4 stages"):  # 2 nodes of 2
        load_config("autoencoder", ["trainer.strategy=pipeline", "trainer.devices=2", "launch.nnodes=2",
                                    "parallel.schedule=1f1b", "parallel.micro_batches=2"])
    with pytest.raises(ValueError, match=r"trainer.batch_size=2 is smaller than parallel.micro_batches=4"):
        load_config("resnet50-model-parallel", ["trainer.batch_size=2", "parallel.micro_batches=4"])
    load_config("autoencoder", ["trainer.strategy=pipeline", "trainer.devices=2", "parallel.schedule=1f1b",
                                "parallel.micro_batches=2"])
    # One process evaluates a pipeline checkpoint as the plain model: its split points are not in the way.
    load_config("autoencoder", ["trainer.strategy=pipeline", "trainer.devices=1", "parallel.split_points=[decoder]"])


@pytest.mark.parametrize("batch, micro, sizes, fix", [(10, 4, "3+3+3+1", "parallel.micro_batches=3"),
                                                      (4, 4, "1+1+1+1", "parallel.micro_batches=2"),
                                                      (1, 1, "1", "a batch of at least 2")])
def test_micro_batches_of_one_sample_under_batchnorm_are_refused_before_training(batch, micro, sizes, fix):
    """issue 28 item 8: batch 10 in 4 micro-batches of 3+3+3+1 reached torch's "Expected more than 1 value per
    channel when training". Planted fault: only the micro-batch count is checked, not the smallest micro-batch."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    strategy = _strategy(devices=["cpu", "cpu"], split=["2"], micro=micro, batch=batch)
    with pytest.raises(ValueError) as err:
        strategy.check_batch(batch, model)
    assert str(err.value) == (
        f"parallel.micro_batches={micro} cuts trainer.batch_size={batch} into micro-batches of {sizes} samples, and "
        f"the model's BatchNorm (1 and 0 more) cannot train on a micro-batch of 1 sample; use {fix}")
    strategy.check_batch(batch, _net())  # no BatchNorm: a sample per micro-batch is enough
    model.eval()
    strategy.check_batch(batch, model)  # BatchNorm that does not train (frozen): fine too


def test_micro_batches_over_batchnorm_say_at_start_what_they_train(capsys):
    """issue 43 item 3: micro-batches normalise BatchNorm per micro-batch (as GPipe): one line says so, and what the
    run equals instead; a model without BatchNorm, or one micro-batch, hears nothing."""
    norm = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    _strategy(devices=["cpu", "cpu"], micro=4, batch=16).check_batch(16, norm)
    line = capsys.readouterr().out.strip()
    assert line == ("gputrain: model_parallel: BatchNorm (1 and 0 more) normalises each of the 4 micro-batches "
                    "(4+4+4+4 samples) with its own statistics, so this trains what single trains with "
                    "trainer.accumulate_grad_batches=4, not single at batch 16; parallel.micro_batches=1 or a model "
                    "without BatchNorm trains the same model as single (docs/strategies.md)")
    _strategy(devices=["cpu", "cpu"], micro=4, batch=16).check_batch(16, torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))
    _strategy(devices=["cpu", "cpu"], micro=1, batch=16).check_batch(16, norm)
    assert capsys.readouterr().out == ""


def test_pipeline_accepts_sync_batchnorm_so_one_recipe_runs_at_every_scale():
    cfg = RunConfig(trainer=TrainerConfig(sync_batchnorm=True))
    strategy_class("pipeline").from_config(DistInfo(rank=0, world_size=2), cfg)  # no refusal
