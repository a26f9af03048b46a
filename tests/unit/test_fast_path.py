"""The speed options (issue 16 item 1): what each resolves to on a CPU and on a GPU, what the resolved config
records, the process-wide flags and host memory they set, the refusals of bad values, the start-up line that names
them, and how ``gputrain bench throughput`` times a run. Training with them: test_fast_path_training.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gputrain.config import RunConfig, load_config
from gputrain.config.resolve import Facts, FastPath, glibc, resolve_precision, resolve_run
from gputrain.engine.fast import apply_backend_flags
from gputrain.tasks.detection import DetectionTask


def resolve(cfg: RunConfig, device: torch.device, *, fixed_shapes: bool = True,
            normalize_on_device: bool = False) -> FastPath:
    """The speed options ``cfg`` resolves to on ``device`` (what one call of resolve_run decides)."""
    return resolve_run(cfg, Facts(device=device, fixed_shapes=fixed_shapes, normalizes_on_device=normalize_on_device))[1]


def test_auto_turns_the_options_on_for_cuda_and_leaves_a_cpu_run_as_it_was():
    cfg = RunConfig()
    # On a CPU, auto changes only where host memory comes from (never a computed value): see the fault test below.
    assert glibc()  # the machines this suite runs on (Linux); elsewhere auto leaves the allocator alone
    assert resolve(cfg, torch.device("cpu")) == FastPath(reuse_host_memory=True)
    assert resolve(cfg, torch.device("cuda", 0)) == FastPath(channels_last=True, fused_optimizer=True,
                                                             cudnn_benchmark=True, reuse_host_memory=True)
    # Detection batches images of different sizes inside the model: neither layout nor autotuner is chosen for it.
    assert resolve(cfg, torch.device("cuda", 0), fixed_shapes=DetectionTask.fixed_shapes) == FastPath(
        fused_optimizer=True, reuse_host_memory=True)
    assert resolve_precision("auto", torch.device("cpu")) == "32"
    assert resolve_precision("mixed", torch.device("cpu")) == "32"
    assert resolve_precision("16-mixed", torch.device("cpu")) == "16-mixed"
    explicit = load_config(None, ["trainer.channels_last=true", "trainer.compile=true", "optim.fused=false",
                                  "trainer.cudnn_benchmark=false", "trainer.compile_mode=max-autotune",
                                  "trainer.reuse_host_memory=false"])
    assert resolve(explicit, torch.device("cuda", 0)) == FastPath(channels_last=True, compile_mode="max-autotune")
    assert FastPath().describe() == "fast=off"
    assert FastPath(True, "default", True, True).describe() == "fast=channels_last+compile(default)+fused+cudnn_benchmark"


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["on-the-cpu", "on-a-gpu"])  # "cuda" in an id skips it
def test_the_resolved_config_replaces_every_auto_by_what_ran(device):
    """config.yaml and every checkpoint carry resolve_run's config: each option must say what this run did, on or
    off, never ``auto`` (a resume on another machine would resolve it anew). Planted faults: a field
    (``reuse_host_memory``, ``optim.fused``) not written back."""
    where = torch.device(device, 0) if device == "cuda" else torch.device(device)
    cfg, fast = resolve_run(RunConfig(), Facts(device=where, normalizes_on_device=device == "cuda"))
    on = device == "cuda"
    written = {"trainer.channels_last": cfg.trainer.channels_last, "trainer.cudnn_benchmark": cfg.trainer.cudnn_benchmark,
               "optim.fused": cfg.optim.fused, "data.normalize_on_device": cfg.data.normalize_on_device}
    assert written == dict.fromkeys(written, on)
    assert cfg.trainer.reuse_host_memory is True and cfg.trainer.precision == "32"
    assert isinstance(cfg.data.num_workers, int)
    # Resolving the written config again gives the same options on the same device: nothing is left to auto. cuDNN's
    # autotuner is for CUDA alone: a config written by a GPU run resolves it off on a CPU (issue 28 item 7).
    again = resolve_run(cfg, Facts(device=where, normalizes_on_device=on))
    assert again == (cfg, fast)
    assert resolve(cfg, torch.device("cpu"), normalize_on_device=on) == dataclasses.replace(fast, cudnn_benchmark=False)


def test_cudnn_benchmark_is_switched_on_by_the_run_and_never_off():
    """``torch.backends.cudnn.benchmark`` is a process-wide flag that can be set without a GPU. Planted fault:
    ``apply_backend_flags`` does not set it (every conv then runs torch's default algorithm, not the fastest)."""
    saved = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        apply_backend_flags(FastPath(cudnn_benchmark=True))
        assert torch.backends.cudnn.benchmark is True
        apply_backend_flags(FastPath())  # a later run with it off leaves a caller's own setting as it was
        assert torch.backends.cudnn.benchmark is True
        torch.backends.cudnn.benchmark = False
        apply_backend_flags(FastPath())
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = saved


def test_reusing_host_memory_is_refused_where_the_c_library_is_not_glibc(monkeypatch):
    """``mallopt`` is glibc's: on macOS, Windows or musl ``true`` must stop the run with one line naming the field
    before anything starts, and ``auto`` leaves the allocator alone. Planted fault: ``true`` accepted anyway."""
    import gputrain.config.resolve

    monkeypatch.setattr(gputrain.config.resolve, "glibc", lambda: False)  # the one fact this machine cannot give
    with pytest.raises(ValueError, match=r"trainer\.reuse_host_memory=true .* not glibc; set "
                                         r"trainer\.reuse_host_memory=auto or false"):
        resolve(load_config(None, ["trainer.reuse_host_memory=true"]), torch.device("cpu"))
    alone = FastPath()
    assert resolve(RunConfig(), torch.device("cpu")) == alone  # auto: off, so the run is the plain path
    assert resolve(RunConfig(), torch.device("cuda", 0)).reuse_host_memory is False
    assert resolve(load_config(None, ["trainer.reuse_host_memory=false"]), torch.device("cpu")) == alone


@pytest.mark.parametrize(("native", "auto", "mixed"), [(True, "bf16-mixed", "bf16-mixed"), (False, "32", "16-mixed")])
def test_mixed_takes_bf16_where_the_gpu_has_it_and_float16_with_loss_scaling_where_not(monkeypatch, native, auto, mixed):
    # The GPU's answer is the one input a CPU machine cannot give; the choice made from it is what is tested
    # (tests/distributed/test_cuda.py checks it on a real GPU). torch's answer as on an H100 (native bfloat16)
    # and on a V100 (emulated only: yes unless emulation is excluded), where autocast to bfloat16 is slow.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    gpu = torch.device("cuda", 0)
    assert (resolve_precision("auto", gpu), resolve_precision("mixed", gpu)) == (auto, mixed)
    assert resolve_precision("16-mixed", gpu) == "16-mixed" and resolve_precision("32", gpu) == "32"


def test_the_segmentation_recipe_trains_in_mixed_precision_wherever_a_gpu_runs_it():
    assert load_config("ade20k-deeplabv3plus", []).trainer.precision == "mixed"


def test_fused_sgd_is_kept_out_of_16_mixed_where_torch_leaves_its_momentum_unset(monkeypatch):
    """The DeepLabv3+ 16-mixed NaN (H200, 2026-11-29): fused SGD makes its momentum buffers with empty_like and
    fills them in a kernel that skips an overflowed step, and 16-mixed's first step usually overflows. ``auto``
    keeps SGD with momentum unfused under the loss scaler, and an explicit ``optim.fused=true`` is refused before
    the run starts (on a GPU whose ``mixed`` became 16-mixed, when the rank resolves it)."""
    # The reason, in the pinned torch: after a first step the scaler skipped, fused SGD holds a buffer it never wrote.
    for fused in (False, True):
        weight = torch.nn.Parameter(torch.ones(4))
        optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale((weight * float("inf")).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        assert ("momentum_buffer" in optimizer.state[weight]) is fused
    gpu = torch.device("cuda", 0)
    sixteen = load_config("ade20k-deeplabv3plus", ["trainer.precision=16-mixed"])
    assert sixteen.optim.name == "sgd" and sixteen.optim.momentum > 0
    assert resolve(sixteen, gpu).fused_optimizer is False
    assert resolve_run(sixteen, Facts(device=gpu))[0].optim.fused is False  # what config.yaml records
    for still_fused in (["trainer.precision=bf16-mixed"], ["trainer.precision=16-mixed", "optim.name=adamw"],
                        ["trainer.precision=16-mixed", "optim.momentum=0"]):
        assert resolve(load_config("ade20k-deeplabv3plus", still_fused), gpu).fused_optimizer is True, still_fused
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)  # a V100, a T4
    mixed = load_config("ade20k-deeplabv3plus", [])
    assert resolve(mixed, gpu).fused_optimizer is False
    asked = load_config("ade20k-deeplabv3plus", ["optim.fused=true"])
    with pytest.raises(ValueError, match=r"^optim.fused=true with optim.name=sgd \(momentum\) and trainer.precision="
                                         r"16-mixed: .*; set optim.fused=auto or false, or train at bf16-mixed$"):
        resolve(asked, gpu)
    with pytest.raises(ValueError, match=r"^optim.fused=true with optim.name=sgd"):
        load_config("ade20k-deeplabv3plus", ["trainer.precision=16-mixed", "optim.fused=true"])


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.channels_last=maybe", "trainer.channels_last='maybe' must be auto, true or false"),
    ("optim.fused=sometimes", "optim.fused='sometimes' must be auto, true or false"),
    ("trainer.reuse_host_memory=maybe", "trainer.reuse_host_memory='maybe' must be auto, true or false"),
    ("trainer.checkpoint_process=true", "the override sets trainer.checkpoint_process, which gputrain no longer has: "
                                        "checkpoints are written by the training process"),
    ("trainer.compile_mode=fastest", "trainer.compile_mode='fastest' is unknown; choose default, reduce-overhead"),
])
def test_a_bad_option_value_is_one_line_naming_the_field(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_compile_with_dataparallel_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="trainer.compile=true does not work with strategy dp"):
        load_config(None, ["trainer.compile=true", "trainer.strategy=dp"])


def test_bench_throughput_reports_compile_time_as_the_first_step_over_a_steady_one():
    from gputrain.tools.bench.throughput import _compile_s

    compiled = {"fast": "compile(default)", "first_step_s": 3.0, "batch_size_per_device": 8}
    assert _compile_s(compiled, images_per_s=16.0) == 2.5  # a steady step of 8 images takes 0.5 s
    assert _compile_s({**compiled, "fast": "off"}, images_per_s=16.0) is None


def test_bench_throughput_times_the_epochs_after_the_first_and_a_single_epoch_as_it_is():
    """The first epoch pays for start-up, caches and compilation: a steady rate is the median of the later epochs.
    Planted fault: the first epoch counted too (with three epochs the median then moves to the slower one)."""
    from gputrain.tools.bench.throughput import steady

    key = "train/images_per_s"
    epochs = [{"step": 1, key: 5.0, "time/train_s": 9.0}, {"step": 2, key: 90.0, "time/train_s": 1.0},
              {"step": 3, key: 100.0, "time/train_s": 0.9}]
    assert steady(epochs, key) == (95.0, 2)  # the median of 90 and 100; with the first epoch it would be 90
    assert steady(epochs[:2], key) == (90.0, 1)
    assert steady(epochs[:1], key) == (5.0, 1)  # one epoch alone is all there is
    # Evaluation runs every n epochs: only the later epochs that have it count.
    val = "time/val_images_per_s"
    logged = [{"step": s, "time/train_s": 1.0} | ({val: v} if v else {}) for s, v in ((1, 1.0), (2, 0), (3, 300.0))]
    assert steady(logged, val) == (300.0, 1)
    assert steady(epochs, val) == (None, 0)


_HEAP_OR_MMAP = """
import ctypes, sys, torch
from gputrain.config import load_config
from gputrain.config.resolve import Facts, resolve_run
from gputrain.engine.fast import apply_backend_flags
cfg = load_config(None, ["trainer.reuse_host_memory=" + sys.argv[1]])
apply_backend_flags(resolve_run(cfg, Facts(device=torch.device("cpu")))[1])
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
block = libc.malloc(8 << 20)  # a fresh process has freed nothing large yet: glibc's threshold is its initial 128 KiB
print("heap" if block < libc.sbrk(0) else "mmap")
"""


def test_reusing_host_memory_serves_large_blocks_from_the_heap_instead_of_fresh_mappings():
    """Where glibc puts an 8 MiB block in a fresh process: a fresh mmap (faulted in anew after every free)
    by default, the reusable heap with the setting. An address, not a time or a fault count: deterministic.
    Planted fault: the switch ignored."""
    import subprocess
    import sys

    where = {}
    for flag in ("false", "true"):
        done = subprocess.run([sys.executable, "-c", _HEAP_OR_MMAP, flag], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        where[flag] = done.stdout.split()[-1]
    assert where == {"false": "mmap", "true": "heap"}


def _start_line(tmp_path, capsys, freeze: bool = False, **trainer) -> str:
    from torch.utils.data import TensorDataset

    from gputrain import Trainer
    from gputrain.config import DataConfig

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    if freeze:
        model[0].requires_grad_(False)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    cfg = RunConfig(data=DataConfig(synthetic=trainer.pop("synthetic", False), num_workers="auto"))
    Trainer(cfg, strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=8, epochs=1,
            out=str(tmp_path), pictures=0, **trainer).fit(model, TensorDataset(x, x[:, :1]),
                                                         loss=torch.nn.functional.mse_loss)
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gputrain: strategy="))


def test_the_start_up_line_names_what_changes_the_run_and_only_what_is_on(tmp_path, capsys):
    """issue 28 item 7: synthetic data, the resolved worker count, frozen parameters and how checkpoints are written
    were missing from the line, and cudnn_benchmark was claimed on a CPU. Planted faults: a word left out; cuDNN's
    autotuner claimed where there is no CUDA."""
    from gputrain.config.resolve import resolve_num_workers, usable_cores

    workers = resolve_num_workers("auto", cores=usable_cores(), local_processes=1)
    line = _start_line(tmp_path / "a", capsys, freeze=True, synthetic=True, cudnn_benchmark=True,
                       accumulate_grad_batches=2, async_checkpoint=False)
    for word in (f"workers={workers}", "data=synthetic(the first 8 samples repeated)",
                 "frozen=parameters(80% of the parameters)", "accumulate=2", "checkpoints=synchronous"):
        assert f" {word} " in line, (word, line)
    assert "cudnn_benchmark" not in line
    plain = _start_line(tmp_path / "b", capsys, enable_checkpointing=False)
    assert not any(word in plain for word in ("synthetic", "frozen", "accumulate", "checkpoints=", "decode_on_device",
                                              "sync_batchnorm", "drop_last", "max_steps_per_epoch", "weights="))
    assert " checkpoints=background " in _start_line(tmp_path / "c", capsys)  # the default, on a CPU too
