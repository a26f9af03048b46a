"""The same code paths on a real GPU. Skipped, with the reason, where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

from autoencoder_runs import _Images, _max_diff, _train
from gputrain.dist import DistInfo
from gputrain.precision import build_precision
from gputrain.strategies.dp import DataParallel, check_targets_on_output_device

pytestmark = pytest.mark.cuda
CUDA0 = torch.device("cuda", 0)


def test_single_gpu_training_matches_cpu(tmp_path, monkeypatch):
    cpu = _train(str(tmp_path / "cpu"), "single", 1, 16)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    from gputrain import Trainer
    from gputrain.config import OptimConfig, RunConfig
    from gputrain.models.vision import ConvAutoencoder
    from gputrain.tasks.autoencoder import ReconstructionTask

    torch.manual_seed(0)
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.5, momentum=0.9)), strategy="single",
                      accelerator="cuda", batch_size=16, epochs=2, out=str(tmp_path / "gpu"), progress_bar=False,
                      loggers=[], precision="32")  # the CPU run's arithmetic; the fast path's layout stays on
    trainer.fit(ConvAutoencoder(), _Images(), _Images(), task=ReconstructionTask())
    gpu = {k: v.cpu() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}
    assert _max_diff(cpu, gpu) < 1e-4


def test_dp_on_real_gpu_checks_and_runs():
    strategy = DataParallel(DistInfo(device=CUDA0), device_ids=[0], output_device=0)
    module = strategy.setup_module(torch.nn.Linear(4, 2))
    assert isinstance(module, torch.nn.DataParallel) and module.device_ids == [0]
    out = module(torch.randn(3, 4, device=CUDA0))
    assert out.device == CUDA0
    with pytest.raises(ValueError, match="targets are on cpu but DataParallel gathers outputs on output_device=cuda:0"):
        check_targets_on_output_device(out, torch.zeros(3), strategy.output_device)
    with pytest.raises(ValueError, match="dp_device_ids names cuda:7"):
        DataParallel(DistInfo(device=CUDA0), device_ids=[7])
    assert set(strategy.model_state_dict(module)) == {"weight", "bias"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs to scatter over; this machine has fewer")
def test_dp_scatters_over_two_gpus():
    strategy = DataParallel(DistInfo(device=CUDA0), device_ids=[0, 1], output_device=1)
    module = strategy.setup_module(torch.nn.Linear(4, 2))
    assert module(torch.randn(4, 4, device=CUDA0)).device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="batch size 1 is smaller than the 2 devices"):
        strategy.check_batch(1)


@pytest.mark.parametrize("name", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_on_gpu(name):
    precision = build_precision(name, CUDA0)
    model = torch.nn.Conv2d(3, 4, 3).to(CUDA0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with precision.forward_context():
        out = model(torch.randn(2, 3, 8, 8, device=CUDA0))
    assert out.dtype == (torch.float16 if name == "16-mixed" else torch.bfloat16)
    precision.backward(out.float().pow(2).mean())
    assert precision.optimizer_step(opt)
    assert not torch.equal(before, model.weight)
    if name == "16-mixed":
        assert precision.state_dict()["scaler"]["scale"] > 0


def test_mixed_resolves_to_this_gpus_fastest_mixed_precision():
    from gputrain.config.resolve import resolve_precision

    expected = "bf16-mixed" if torch.cuda.is_bf16_supported(including_emulation=False) else "16-mixed"
    assert resolve_precision("mixed", CUDA0) == expected
    assert build_precision(resolve_precision("mixed", CUDA0), CUDA0).name == expected


def test_async_checkpoint_copies_cuda_state_to_pinned_buffers_before_the_step(tmp_path):
    """The writer's CUDA path: non-blocking copies into pinned host buffers, ordered before later kernels."""
    from gputrain.checkpoint import CheckpointStore, load_checkpoint
    from gputrain.checkpoint.snapshot import CheckpointWriter

    writer = CheckpointWriter(CheckpointStore(tmp_path))
    weights = torch.arange(1 << 20, dtype=torch.float32, device=CUDA0)
    for step in (1, 2):  # the second save reuses the first one's pinned buffer
        writer.save({"model": {"w": weights}, "state": {"global_step": step}}, name=f"step_{step:06d}")
        weights.add_(1.0)  # the next step's kernel, queued behind the copy on the same stream
    writer.wait()
    assert writer._buffers and all(buffer.is_pinned() for buffer in writer._buffers)
    for step in (1, 2):
        saved = load_checkpoint(tmp_path / f"step_{step:06d}.pt")["model"]["w"]
        assert saved.device.type == "cpu"
        assert torch.equal(saved, torch.arange(1 << 20, dtype=torch.float32) + (step - 1))


def test_the_fast_path_is_on_by_default_on_a_gpu_and_reaches_the_model(tmp_path, capsys):
    from gputrain import Trainer
    from gputrain.models.vision import ConvAutoencoder
    from gputrain.tasks.autoencoder import ReconstructionTask

    torch.manual_seed(0)
    model = ConvAutoencoder()
    layouts: list[bool] = []
    model.encoder[0].register_forward_pre_hook(
        lambda m, args: layouts.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    trainer = Trainer(strategy="single", accelerator="cuda", batch_size=16, epochs=1, out=str(tmp_path / "run"),
                      progress_bar=False, loggers=[], pictures=0)
    summary = trainer.fit(model, _Images(), _Images(), task=ReconstructionTask())
    line = capsys.readouterr().out
    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    assert f"precision={'bf16-mixed' if bf16 else '32'} fast=channels_last+fused+cudnn_benchmark" in line
    assert layouts and all(layouts)
    assert trainer.optimizer.param_groups[0]["fused"] is True and torch.backends.cudnn.benchmark
    assert trainer.config_dict["trainer"]["precision"] == ("bf16-mixed" if bf16 else "32")
    assert summary["final"]["train/loss"] < 1


def test_compiled_training_on_a_gpu_ends_where_eager_ends(tmp_path):
    eager = _train(str(tmp_path / "eager"), "single", 1, 16, accelerator="cuda", precision="32")
    compiled = _train(str(tmp_path / "compiled"), "single", 1, 16, accelerator="cuda", precision="32", compile=True)
    assert _max_diff(eager, compiled) < 1e-4


def test_images_decoded_on_the_gpu_match_the_cpu_decoder_under_the_same_seeds(tmp_path):
    from gputrain.config import load_config
    from gputrain.data.classfolder import make_classfolder
    from gputrain.data.samplers import SeededSamples
    from gputrain.tasks import build_task

    root = make_classfolder(tmp_path / "classes", classes=2, per_class=8, size=64, seed=0)
    spec = build_task(load_config("imagefolder-resnet50", [f"data.root={root}", "data.image_size=32",
                                                           "data.decode_on_device=true"]))
    samples = SeededSamples(spec.train_data, seed=0)
    batch, _ = spec.task.collate_fn()([samples[(0, i)] for i in range(len(spec.train_data))])
    gpu, cpu = batch.to_device(CUDA0), batch.to_device(torch.device("cpu"))
    assert gpu.device == CUDA0 and gpu.shape == cpu.shape
    # The same crops and flips (the samples' seeds); nvJPEG and libjpeg differ by about a grey level
    # (1/255 / 0.225 = 0.017 after normalisation) in some pixels.
    assert float((gpu.cpu() - cpu).abs().mean()) < 0.05


def test_uint8_batches_pinned_and_normalized_on_the_gpu_equal_the_cpu_normalization():
    from gputrain.data.device_normalize import PixelBatch
    from gputrain.data.images import IMAGENET_MEAN, IMAGENET_STD

    pixels = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    batch = PixelBatch(pixels, IMAGENET_MEAN, IMAGENET_STD).pin_memory()  # what the loader's pin thread calls
    assert batch.pixels.is_pinned()
    gpu = batch.to_device(CUDA0, non_blocking=True)
    assert gpu.device == CUDA0 and gpu.dtype == torch.float32
    assert torch.equal(gpu.cpu(), batch.to_device(torch.device("cpu")))  # IEEE mul, sub, div: the same bits


def test_uint8_images_divided_by_255_on_the_gpu_equal_the_cpus_division():
    # CUDA divides by a Python number as a multiplication by its reciprocal; to_unit_float divides by a tensor.
    from gputrain.data.device_normalize import PixelBatch
    from gputrain.data.images import to_unit_float

    every = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).expand(3, 16, 16).contiguous()
    assert torch.equal(to_unit_float(every.to(CUDA0)).cpu(), to_unit_float(every))
    sizes = [(3, 20, 30), (3, 17, 11)]  # detection: a list of images of different sizes
    images = [torch.randint(0, 256, s, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)) for s in sizes]
    batch = PixelBatch(images).pin_memory()
    assert all(p.is_pinned() for p in batch.pixels)
    gpu = batch.to_device(CUDA0, non_blocking=True)
    assert all(torch.equal(g.cpu(), to_unit_float(c)) for g, c in zip(gpu, images, strict=True))
