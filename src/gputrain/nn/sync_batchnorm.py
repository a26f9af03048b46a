"""Synchronized BatchNorm that also trains on CPU ranks (gloo).

``torch.nn.SyncBatchNorm`` refuses CPU tensors in training with more than one rank (see
docs/platform-notes). :class:`CpuSyncBatchNorm` normalizes with statistics of the global
batch: per-channel sum, sum of squares and count are all-reduced in forward, and the
backward pass all-reduces the sums of ``grad`` and ``grad * xhat``, as torch's SyncBN does,
so input gradients are those of the global batch. Weight and bias gradients stay local,
as in torch: DDP averages them like any other parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Forward and backward of batch norm over the batches of every rank in ``group``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        channels = x.shape[1]
        dims = _channel_dims(x)
        n_local = x.numel() // max(channels, 1)
        if n_local > 0:
            # Per-rank moments are computed stably (var_mean), then summed in float64: the
            # sum-of-squares form loses nothing to cancellation at that precision.
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            mean64, var64 = mean.double(), var.double()
            local = torch.cat([mean64 * n_local, (var64 + mean64 * mean64) * n_local])
        else:  # an empty shard must still join the collective
            local = torch.zeros(2 * channels, dtype=torch.float64, device=x.device)
        stats = torch.cat([local, torch.tensor([float(n_local)], dtype=torch.float64, device=x.device)])
        dist.all_reduce(stats, group=group)
        total = float(stats[-1])
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {int(total)} over all ranks; "
                "use a larger batch or put the model in eval mode"
            )
        g_mean = stats[:channels] / total
        g_var = (stats[channels : 2 * channels] / total - g_mean * g_mean).clamp(min=0)
        invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
                unbiased = g_var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = _channel_shape(x)
        mean_c, invstd_c = g_mean.to(x.dtype), invstd.to(x.dtype)
        xhat = (x - mean_c.view(shape)) * invstd_c.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.group, ctx.total, ctx.has_bias = group, total, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = _channel_dims(x), _channel_shape(x)
        channels = x.shape[1]
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        sum_dy = grad_out.sum(dim=dims)
        sum_dy_xhat = (grad_out * xhat).sum(dim=dims)
        grad_in = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # d(sum of all ranks' losses)/dx needs the global means of grad and grad*xhat.
            sums = torch.cat([sum_dy, sum_dy_xhat]).double()
            dist.all_reduce(sums, group=ctx.group)
            mean_dy = (sums[:channels] / ctx.total).to(x.dtype)
            mean_dy_xhat = (sums[channels:] / ctx.total).to(x.dtype)
            scale = invstd if weight is None else invstd * weight
            grad_in = (grad_out - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = sum_dy
        return grad_in, grad_w, grad_b, None, None, None, None, None


def sync_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    eps: float = 1e-5,
    momentum: float = 0.1,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Training-mode batch norm over the global batch of ``group`` (default: the world).

    Always runs the synchronized path (even for one rank), which lets tests check its math;
    modules call it only when there is more than one rank.
    """
    return _SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, eps, momentum, group)


class CpuSyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of every rank; works on CPU (gloo) and on CUDA.

    In training mode with a process group of more than one rank it synchronizes; in eval
    mode, or without a process group, it is plain BatchNorm. Any input with a channel
    dimension ``(N, C, ...)`` is accepted, like ``nn.SyncBatchNorm``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"CpuSyncBatchNorm expects (N, C, ...) input, got {input.dim()}D")
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"CpuSyncBatchNorm(num_features={self.num_features}) got {input.shape[1]} channels; "
                "the preceding layer's output channels must match"
            )

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self._world_size() == 1:
            return super().forward(input)  # no peers to sync with: plain BatchNorm
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        track = self.track_running_stats
        return sync_batch_norm(
            input,
            self.weight,
            self.bias,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.eps,
            factor,
            self.process_group,
        )


def _to_cpu_sync(module: nn.Module, process_group: dist.ProcessGroup | None) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CpuSyncBatchNorm):
        out = CpuSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():  # share the Parameters, as torch's convert_sync_batchnorm does
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _to_cpu_sync(child, process_group))
    return out


def convert_sync_batchnorm(
    module: nn.Module, device_type: str, process_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Every BatchNorm layer of ``module`` synchronized across ranks, for ``device_type``.

    ``cuda`` uses ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; ``cpu`` converts to
    :class:`CpuSyncBatchNorm` (weights, buffers, eps, momentum, affine and
    track_running_stats carried over). Returns the converted module (possibly a new one).
    """
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    if device_type == "cpu":
        return _to_cpu_sync(module, process_group)
    raise ValueError(f"convert_sync_batchnorm(device_type={device_type!r}): use 'cpu' or 'cuda'")
