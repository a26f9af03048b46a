"""One 3x3 convolution, forward and backward, in float32 and under float16 / bfloat16 autocast, on the CPU.

The figures of docs/precision.md ("CPU caveat"): a 3x3 convolution of 64 to 64 channels on a
16x64x32x32 batch, forward and backward, one intra-op thread. The three variants are interleaved
(A B C A B C ...) so that drift in a shared machine's load hits all of them alike; each time is
the median over ``--repeats`` rounds, after one warm-up round.

Usage: ``python benchmarks/precision_cpu.py [--repeats 5] [--json out.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

VARIANTS: dict[str, torch.dtype | None] = {"float32": None, "float16 autocast": torch.float16,
                                           "bfloat16 autocast": torch.bfloat16}


@contextlib.contextmanager
def autocast(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device_type="cpu", dtype=dtype):
        yield


def half_precision_flags() -> str:
    """The CPU features that decide whether low-precision kernels are fast (Linux; '' elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return ""
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("flags")), []))
    wanted = ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "f16c")
    return " ".join(f for f in wanted if f in flags) or "none of " + ", ".join(wanted)


def step_seconds(conv: torch.nn.Conv2d, x: torch.Tensor, dtype: torch.dtype | None) -> float:
    """Wall time of one forward and backward of ``conv`` on ``x``."""
    conv.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with autocast(dtype):
        out = conv(x)
    out.float().sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1)
    x = torch.randn(16, 64, 32, 32)
    for dtype in VARIANTS.values():  # warm-up: first calls pick kernels and allocate
        step_seconds(conv, x, dtype)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, dtype in VARIANTS.items():
            times[name].append(step_seconds(conv, x, dtype))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"torch {torch.__version__}, {platform.machine()}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, flags: {half_precision_flags()}; 1 thread, "
          f"median of {args.repeats}")
    print("| precision | time | vs float32 |\n|---|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1000:.0f} ms | {seconds / medians['float32']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                       "flags": half_precision_flags(), "repeats": args.repeats, "seconds": times,
                       "median_s": medians}, f, indent=2)


if __name__ == "__main__":
    main()
