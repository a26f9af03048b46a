"""``data.synthetic=true``: training batches that cost no decoding, augmentation or host-to-device copy.

The first few samples of the real training set are decoded once, moved to the training device and served
in turn for every index, so batches have exactly the recipe's shapes and dtypes (and valid targets: boxes,
masks, labels) while the input pipeline is out of the measurement. Comparing a run with and without it
separates model speed from input speed (``gputrain bench throughput``); it is for measuring, not learning.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

SYNTHETIC_SAMPLES = 8
"""Distinct real samples kept on the device (enough for varied shapes where a task has them)."""


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


class DeviceResidentSamples(Dataset[Any]):
    """``len(data)`` indices served from the first :data:`SYNTHETIC_SAMPLES` samples of ``data``, kept on ``device``."""

    def __init__(self, data: Dataset[Any], device: torch.device, *, count: int = SYNTHETIC_SAMPLES) -> None:
        self.length = len(data)  # type: ignore[arg-type]
        if self.length == 0:
            raise ValueError("data.synthetic=true needs at least one real training sample to copy shapes from")
        self.samples = [_to(data[i], device) for i in range(min(count, self.length))]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.samples[index % len(self.samples)]
