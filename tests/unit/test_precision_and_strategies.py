"""Pure logic, no processes: precision plugins, the strategy registry and the launcher's process count, and
DataParallel's checks (pure checks over device lists, so they run without GPUs)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from gputrain.config import RunConfig, TrainerConfig, load_config
from gputrain.dist import DistInfo
from gputrain.launcher.spec import LaunchSpec
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
