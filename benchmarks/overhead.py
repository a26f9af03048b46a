"""Trainer overhead and DDP scaling against hand-written PyTorch loops, measured in one run.

Figures (issue 3):
  1. gputrain (strategy single) epoch time / hand-written loop, 1 process, 1 thread; checkpointing
     off so both do the same work (a second row adds gputrain's per-epoch atomic checkpoints);
  2. gputrain DDP on a 1-rank process group / hand-written plain loop;
  3. 2-rank weak-scaling efficiency of gputrain DDP next to a hand-written DDP loop's.

Variants are interleaved (A B A B ...) and the median of per-pair ratios is reported, with
per-epoch CPU time beside wall time, epochs after the first only (see platform notes).

    python benchmarks/overhead.py --pairs 5 --json runs/bench/overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.dist import init_distributed, teardown
from gputrain.engine.hooks import Hook
from gputrain.launcher.ranks import launch_all
from gputrain.launcher.spec import free_port
from gputrain.models.vision import ConvAutoencoder
from gputrain.tasks.autoencoder import ReconstructionTask

IMAGES, SIZE, BATCH, EPOCHS, LR = 1024, 80, 32, 3, 1e-3


class Images(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.rand(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


class EpochTimer(Hook):
    """Wall and CPU time of each epoch, as the user sees it (hooks and checkpoint included)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def before_epoch(self, trainer) -> None:  # noqa: ANN001
        self._w, self._c = time.perf_counter(), time.process_time()

    def after_epoch(self, trainer, metrics) -> None:  # noqa: ANN001
        self.wall.append(time.perf_counter() - self._w)
        self.cpu.append(time.process_time() - self._c)


DEVICE = torch.device("cpu")


def hand_written(data: Dataset, ddp: bool) -> tuple[list[float], list[float]]:
    """The loop a user writes by hand: DataLoader, (DDP,) zero_grad, forward, MSE, backward, step."""
    torch.manual_seed(0)
    model: torch.nn.Module = ConvAutoencoder().to(DEVICE)
    sampler = torch.utils.data.DistributedSampler(data, seed=0) if ddp else None
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEVICE] if DEVICE.type == "cuda" else None)
    loader = DataLoader(data, batch_size=BATCH, shuffle=sampler is None, sampler=sampler,
                        pin_memory=DEVICE.type == "cuda")  # as gputrain does on CUDA
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    wall, cpu = [], []
    for epoch in range(EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        w, c = time.perf_counter(), time.process_time()
        for x in loader:
            x = x.to(DEVICE, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), x)
            loss.backward()
            opt.step()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return wall, cpu


def with_gputrain(data: Dataset, strategy: str, checkpoints: bool = False) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(RunConfig(optim=OptimConfig(name="adam", lr=LR)), hooks=[timer], strategy=strategy,
                          accelerator=DEVICE.type, batch_size=BATCH, epochs=EPOCHS, out=out, progress_bar=False,
                          loggers=[], devices=dist.get_world_size() if dist.is_initialized() else 1,
                          enable_checkpointing=checkpoints)
        trainer.fit(ConvAutoencoder(), data, task=ReconstructionTask())
    return timer.wall, timer.cpu


def steady(times: list[float]) -> float:
    return statistics.mean(times[1:])  # the first epoch is warm-up


def run_variant(name: str, data: Dataset) -> dict[str, float]:
    wall, cpu = {
        "hand": lambda: hand_written(data, ddp=False),
        "hand_ddp": lambda: hand_written(data, ddp=True),
        "gputrain": lambda: with_gputrain(data, "single"),
        "gputrain_ddp": lambda: with_gputrain(data, "ddp"),
        "gputrain_ckpt": lambda: with_gputrain(data, "single", checkpoints=True),
    }[name]()
    return {"wall": steady(wall), "cpu": steady(cpu)}


def one_process(pairs: int) -> dict[str, list[dict[str, float]]]:
    """All single-process variants, interleaved, inside a 1-rank gloo group (DDP needs one)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed(DEVICE.type)
    data = Images(IMAGES)
    runs: dict[str, list[dict[str, float]]] = {
        k: [] for k in ("hand", "gputrain", "hand_ddp", "gputrain_ddp", "gputrain_ckpt")}
    for _ in range(pairs):
        for name in runs:
            runs[name].append(run_variant(name, data))
    teardown()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    return runs


def _two_rank_worker(pairs: int) -> dict[str, list[dict[str, float]]]:
    torch.set_num_threads(1)
    init_distributed("cpu")
    data = Images(IMAGES * 2)  # weak scaling: each rank gets as many images as the 1-process run
    runs: dict[str, list[dict[str, float]]] = {"hand_ddp": [], "gputrain_ddp": []}
    for _ in range(pairs):
        for name in runs:
            runs[name].append(run_variant(name, data))
    teardown()
    return runs


def ratio(a: list[dict[str, float]], b: list[dict[str, float]], key: str = "wall") -> float:
    return statistics.median(x[key] / y[key] for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--json", default="")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    global DEVICE
    DEVICE = torch.device("cuda", 0) if args.accelerator == "cuda" else torch.device("cpu")

    one = one_process(args.pairs)
    if DEVICE.type == "cuda" and torch.cuda.device_count() < 2:
        two = {k: [{"wall": float("nan"), "cpu": float("nan")}] for k in ("hand_ddp", "gputrain_ddp")}  # 1 GPU
    else:
        two = launch_all(_two_rank_worker, args.pairs, devices=2)[0]
    throughput_1 = {k: IMAGES / statistics.median(r["wall"] for r in v) for k, v in one.items()}
    throughput_2 = {k: 2 * IMAGES / statistics.median(r["wall"] for r in v) for k, v in two.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "CPU, 1 thread per process",
        "torch": torch.__version__,
        "setup": f"conv autoencoder, {IMAGES} images 3x{SIZE}x{SIZE} in memory, batch {BATCH}/process, Adam, "
                 f"{EPOCHS} epochs (first discarded), 1 thread/process, {args.pairs} interleaved pairs",
        "gputrain_over_hand_wall": ratio(one["gputrain"], one["hand"]),
        "gputrain_over_hand_cpu": ratio(one["gputrain"], one["hand"], "cpu"),
        "gputrain_with_checkpoints_over_hand_wall": ratio(one["gputrain_ckpt"], one["hand"]),
        "gputrain_ddp1_over_hand_wall": ratio(one["gputrain_ddp"], one["hand"]),
        "gputrain_ddp1_over_hand_ddp1_wall": ratio(one["gputrain_ddp"], one["hand_ddp"]),
        "gputrain_ddp1_over_hand_cpu": ratio(one["gputrain_ddp"], one["hand"], "cpu"),
        "hand_ddp1_over_hand_wall": ratio(one["hand_ddp"], one["hand"]),
        "epoch_s_median": {k: statistics.median(r["wall"] for r in v) for k, v in one.items()},
        "weak_scaling_efficiency_gputrain": throughput_2["gputrain_ddp"] / (2 * throughput_1["gputrain_ddp"]),
        "weak_scaling_efficiency_hand": throughput_2["hand_ddp"] / (2 * throughput_1["hand_ddp"]),
        "two_rank_epoch_s_median": {k: statistics.median(r["wall"] for r in v) for k, v in two.items()},
        "raw": {"one_process": one, "two_ranks": two},
    }
    print(f"| figure | value |\n|---|---|\n"
          f"| gputrain / hand-written loop, epoch wall time (CPU time) | {result['gputrain_over_hand_wall']:.3f} "
          f"({result['gputrain_over_hand_cpu']:.3f}) |\n"
          f"| gputrain with per-epoch atomic checkpoints (last.pt + epoch file, fsync) / hand-written, wall | "
          f"{result['gputrain_with_checkpoints_over_hand_wall']:.3f} |\n"
          f"| gputrain DDP, 1 rank / hand-written DDP, 1 rank, wall | {result['gputrain_ddp1_over_hand_ddp1_wall']:.3f} |\n"
          f"| gputrain DDP, 1 rank / hand-written plain loop, wall (CPU) | {result['gputrain_ddp1_over_hand_wall']:.3f} "
          f"({result['gputrain_ddp1_over_hand_cpu']:.3f}) |\n"
          f"| hand-written DDP, 1 rank / hand-written plain loop, wall | {result['hand_ddp1_over_hand_wall']:.3f} |\n"
          f"| 2-rank weak-scaling efficiency, gputrain DDP | {result['weak_scaling_efficiency_gputrain']:.2f} |\n"
          f"| 2-rank weak-scaling efficiency, hand-written DDP | {result['weak_scaling_efficiency_hand']:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
