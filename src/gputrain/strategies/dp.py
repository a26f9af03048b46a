"""nn.DataParallel: one process drives several GPUs, scattering each batch.

DataParallel has three traps that produce opaque errors deep in torch; this strategy checks
each one up front and says how to fix it. On a machine without CUDA, DataParallel calls the
module directly and ignores ``device_ids``, so the strategy runs (and warns) on CPU too.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gputrain.dist import DistInfo
from gputrain.strategies.base import Strategy

if TYPE_CHECKING:
    from gputrain.config import RunConfig


def _as_device(d: int | str | torch.device) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)
    d = torch.device(d)
    return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d


def check_module_on_first_device(parameter_devices: Sequence[torch.device], device_ids: Sequence[torch.device]) -> None:
    """DataParallel replicates from ``device_ids[0]``: every parameter and buffer must be there."""
    first = device_ids[0]
    for d in parameter_devices:
        if d != first:
            raise ValueError(
                f"DataParallel needs the whole model on device_ids[0]={first}, but a parameter or buffer "
                f"is on {d}; call model.to('{first}') before wrapping, or put {d} first in device_ids"
            )


def check_batch_covers_devices(batch_size: int, device_ids: Sequence[torch.device]) -> None:
    """A batch smaller than the device count leaves replicas without input (and BatchNorm with 1 sample)."""
    if batch_size < len(device_ids):
        raise ValueError(
            f"batch size {batch_size} is smaller than the {len(device_ids)} devices in device_ids; "
            f"use a batch size of at least {len(device_ids)} (ideally a multiple of it), or fewer devices; "
            "if only the last batch of the epoch is short, set trainer.drop_last=true"
        )


def check_targets_on_output_device(outputs: Any, targets: Any, output_device: torch.device) -> None:
    """DataParallel gathers outputs on ``output_device``; the targets of the loss must be there too."""
    def devices(x: Any) -> list[torch.device]:
        if isinstance(x, torch.Tensor):
            return [x.device]
        if isinstance(x, dict):
            return [d for v in x.values() for d in devices(v)]
        if isinstance(x, (list, tuple)):
            return [d for v in x for d in devices(v)]
        return []

    for d in devices(outputs):
        if d != output_device:
            raise ValueError(f"DataParallel outputs are on {d}, not on output_device={output_device}")
    for d in devices(targets):
        if d != output_device:
            raise ValueError(
                f"targets are on {d} but DataParallel gathers outputs on output_device={output_device}; "
                f"move targets with .to('{output_device}') before the loss"
            )


class DataParallel(Strategy):
    """``nn.DataParallel(model, device_ids, output_device)`` with its traps checked."""

    name = "dp"

    @classmethod
    def from_config(cls, dist_info: DistInfo, cfg: RunConfig) -> DataParallel:
        return cls(dist_info, device_ids=cfg.trainer.dp_device_ids, output_device=cfg.trainer.dp_output_device)

    def describe(self) -> str:
        if not self.cuda:
            return "strategy=dp on 1 device (DataParallel on a CPU is one device: it calls the model directly)"
        ids = ",".join(str(d) for d in self.device_ids)
        return f"strategy=dp on {len(self.device_ids)} device(s) ({ids}), outputs gathered on {self._output}"

    def __init__(
        self, dist_info: DistInfo, *, device_ids: Sequence[int | str] | None = None,
        output_device: int | str | None = None,
    ) -> None:
        super().__init__(dist_info)
        if dist_info.world_size > 1:
            raise ValueError(
                "strategy dp drives several GPUs from one process and cannot run under a "
                f"{dist_info.world_size}-process launch; use --devices 1 with dp, or --strategy ddp"
            )
        self.cuda = dist_info.device.type == "cuda"
        if self.cuda:
            ids = list(device_ids) if device_ids else list(range(torch.cuda.device_count()))
            self.device_ids = [_as_device(i) for i in ids]
            if len(set(self.device_ids)) != len(self.device_ids):
                raise ValueError(f"trainer.dp_device_ids={list(ids)} names a device twice; list each GPU once")
            n = torch.cuda.device_count()
            for d in self.device_ids:
                if d.type != "cuda" or d.index >= n:
                    raise ValueError(
                        f"trainer.dp_device_ids names {d}, but this machine has {n} GPU(s) (cuda:0..cuda:{n - 1})"
                    )
            self._output = _as_device(output_device) if output_device is not None else self.device_ids[0]
            if self._output.type == "cuda" and self._output not in self.device_ids:
                raise ValueError(
                    f"trainer.dp_output_device={self._output} is not in dp_device_ids "
                    f"{[str(d) for d in self.device_ids]}; pick one of them"
                )
        else:
            if device_ids or output_device is not None:
                warnings.warn(
                    "strategy dp on CPU: nn.DataParallel has no devices to scatter to and calls the model "
                    "directly; device_ids and output_device are ignored",
                    stacklevel=2,
                )
            self.device_ids = [dist_info.device]
            self._output = dist_info.device

    @property
    def root_device(self) -> torch.device:
        return self.device_ids[0]

    @property
    def output_device(self) -> torch.device:
        return self._output

    def setup_module(self, model: nn.Module) -> nn.Module:
        model = model.to(self.root_device)
        devices = [t.device for t in list(model.parameters()) + list(model.buffers())]
        check_module_on_first_device(devices, self.device_ids)
        if not self.cuda:
            return nn.DataParallel(model)
        return nn.DataParallel(
            model, device_ids=[d.index for d in self.device_ids], output_device=self._output.index
        )

    def check_batch(self, batch_size: int, model: nn.Module | None = None) -> None:
        check_batch_covers_devices(batch_size, self.device_ids)

    def check_loss_inputs(self, outputs: Any, targets: Any) -> None:
        check_targets_on_output_device(outputs, targets, self._output)
