"""The memory budget a plan must fit: ``--memory-budget SIZE`` or what the device has free."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, *, field: str = "--memory-budget") -> int:
    """Bytes from ``12GiB``, ``800MB``, ``1.5 GB`` or a plain count of bytes; one line naming ``field`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"{field} {text!r}: give a size such as 12GiB, 800MB or a number of bytes "
                         f"(units: {', '.join(u for u in _UNITS if u)}, case-insensitive)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{field} {text!r}: must be more than 0 bytes")
    return size


def available_ram() -> int:
    """Memory the kernel says a new allocation can get without swapping (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_budget(device_type: str, index: int = 0) -> int:
    """The free memory of GPU ``index`` (``torch.cuda.mem_get_info``), or the available RAM on a CPU."""
    if device_type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    return available_ram()
