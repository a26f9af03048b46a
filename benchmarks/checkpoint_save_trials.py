"""The save trials of ``benchmarks/checkpoint_save.py``: the states saved, the three ways of saving them, their
interleaved timing, and checksum throughput.

The states: ResNet-50 with SGD momentum (about 205 MB) and a small conv autoencoder with Adam, as a gputrain
checkpoint holds them. The saves: a plain ``torch.save``; ``durable`` (temporary, fsync, rename, fsync the folder:
gputrain's atomic_save before the store); and ``CheckpointStore.save``. :func:`compare` times them in interleaved
trials (``os.sync()`` untimed after each) and gives medians and the medians of per-trial ratios.
"""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision

from gputrain.models.vision import ConvAutoencoder


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a gputrain checkpoint holds, after one step so the optimizer has its buffers."""
    from gputrain.checkpoint.state import rng_state

    model(torch.rand(2, 3, 80, 80)).float().mean().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": {"0": rng_state()},
            "state": {"epoch": 1, "global_step": 100, "samples_seen": 3200, "step_in_epoch": 0}, "world_size": 1}


def states() -> dict[str, dict[str, Any]]:
    resnet = torchvision.models.resnet50()
    small = ConvAutoencoder()
    return {
        "ResNet-50 + SGD momentum": training_state(resnet, torch.optim.SGD(resnet.parameters(), lr=0.1, momentum=0.9)),
        "conv autoencoder + Adam": training_state(small, torch.optim.Adam(small.parameters())),
    }


def durable_save(obj: Any, path: Path) -> None:
    """gputrain's atomic_save before the store: temporary, fsync, rename, fsync the folder; no checksum."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(state: dict[str, Any], folder: Path, pairs: int) -> dict[str, Any]:
    from gputrain.checkpoint import CheckpointStore

    store = CheckpointStore(folder / "store", keep_last=2)
    plain, durable = folder / "plain", folder / "durable"
    plain.mkdir()
    durable.mkdir()
    times: dict[str, list[tuple[float, float]]] = {"torch.save": [], "durable": [], "store.save": []}
    for i in range(pairs + 1):  # the first round warms caches and allocators and is dropped
        rounds: dict[str, Callable[[], Any]] = {
            "torch.save": functools.partial(torch.save, state, plain / f"{i}.pt"),
            "durable": functools.partial(durable_save, state, durable / f"{i}.pt"),
            "store.save": functools.partial(store.save, state, name=f"step_{i:06d}"),
        }
        order = list(rounds) if i % 2 else list(reversed(rounds))  # alternate who goes first
        for name in order:
            result = timed(rounds[name])
            os.sync()
            if i:
                times[name].append(result)
        for old in (plain / f"{i}.pt", durable / f"{i}.pt"):
            old.unlink()
    size = (folder / "store" / "last.pt").stat().st_size
    median = {name: statistics.median(w for w, _ in rows) for name, rows in times.items()}
    cpu = {name: statistics.median(c for _, c in rows) for name, rows in times.items()}

    def ratio(a: str, b: str, which: int = 0) -> float:
        return statistics.median(x[which] / y[which] for x, y in zip(times[a], times[b], strict=True))

    return {"bytes": size, "pairs": pairs, "wall_s": median, "cpu_s": cpu,
            "store/torch.save": ratio("store.save", "torch.save"),
            "store/durable": ratio("store.save", "durable"),
            "durable/torch.save": ratio("durable", "torch.save"),
            "cpu store/torch.save": ratio("store.save", "torch.save", 1),
            "cpu store/durable": ratio("store.save", "durable", 1)}


def checksum_speeds(megabytes: int = 256) -> dict[str, float]:
    data = os.urandom(megabytes << 20)
    algorithms: dict[str, Callable[[bytes], Any]] = {
        "zlib.crc32": zlib.crc32,
        "hashlib.sha256": lambda b: hashlib.sha256(b).digest(),
        "hashlib.blake2b": lambda b: hashlib.blake2b(b).digest(),
        "hashlib.md5": lambda b: hashlib.md5(b).digest(),
    }
    speeds = {}
    for name, fn in algorithms.items():
        best = min(timed(functools.partial(fn, data))[0] for _ in range(3))
        speeds[name] = (megabytes << 20) / 1e9 / best
    return speeds
