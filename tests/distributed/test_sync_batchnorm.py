"""CpuSyncBatchNorm on 2 real gloo ranks equals BatchNorm on the global batch in 1 process."""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gputrain.dist import DistInfo
from gputrain.launcher.spec import free_port
from gputrain.nn.sync_batchnorm import CpuSyncBatchNorm, convert_sync_batchnorm, sync_batch_norm
from multiproc import run_ranks

TOL = 1e-5
SPLIT = (5, 3)  # uneven local batches: the global statistics must weight ranks by count


def _bn_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 4, 5, generator=g) * 2 + 1
    probe = torch.randn(8, 3, 4, 5, generator=g)  # loss = sum(y * probe): a non-trivial grad_out
    weight, bias = torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g)
    return x, probe, weight, bias


def _bn_layer(cls: type[nn.Module], momentum: float | None) -> nn.Module:
    _, _, weight, bias = _bn_data()
    layer = cls(3, momentum=momentum)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))


def _ddp_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 3, 6, 6, generator=g), torch.randn(8, 2, 6, 6, generator=g)


def _bn_steps(layer: nn.Module, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two training forwards (running stats move twice), the second one backpropagated."""
    layer.train()
    layer(x * 0.5 - 1)
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * probe).sum().backward()
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "w_grad": layer.weight.grad.clone(),
        "b_grad": layer.bias.grad.clone(),
        "running_mean": layer.running_mean.clone(),
        "running_var": layer.running_var.clone(),
    }


def _ddp_steps(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two SGD steps on the mean-squared error; returns the first step's grads and the final state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    out: dict[str, torch.Tensor] = {}
    for step in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        if step == 0:
            out.update({f"grad.{n}": p.grad.clone() for n, p in inner.named_parameters()})
        opt.step()
    out.update({f"state.{k}": v.clone() for k, v in inner.state_dict().items()})
    return out


def syncbn_worker(info: DistInfo) -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    x, probe, _, _ = _bn_data()
    start = sum(SPLIT[: info.rank])
    rows = slice(start, start + SPLIT[info.rank])
    results = {}
    for momentum in (0.1, None):
        layer = _bn_layer(CpuSyncBatchNorm, momentum)
        results[f"bn_{momentum}"] = _bn_steps(layer, x[rows], probe[rows])
    model = DistributedDataParallel(convert_sync_batchnorm(_model(), "cpu"))
    dx, dt = _ddp_data()
    half = slice(4 * info.rank, 4 * info.rank + 4)  # equal shards: DDP's mean of means is the global mean
    results["ddp"] = _ddp_steps(model, dx[half], dt[half])
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(syncbn_worker)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_bn_equals_global_batch_norm(ranks, momentum):
    x, probe, _, _ = _bn_data()
    ref = _bn_steps(_bn_layer(nn.BatchNorm2d, momentum), x, probe)
    per_rank = [r[f"bn_{momentum}"] for r in ranks]
    # Outputs and input gradients: each rank holds its rows of the global result.
    for key in ("y", "x_grad"):
        torch.testing.assert_close(torch.cat([r[key] for r in per_rank]), ref[key], atol=TOL, rtol=0)
    # Running stats use the global (unbiased) variance, so they agree on every rank.
    for r in per_rank:
        torch.testing.assert_close(r["running_mean"], ref["running_mean"], atol=TOL, rtol=0)
        torch.testing.assert_close(r["running_var"], ref["running_var"], atol=TOL, rtol=0)
    # Weight/bias gradients stay local (DDP reduces them); their sum is the global gradient.
    for key in ("w_grad", "b_grad"):
        torch.testing.assert_close(sum(r[key] for r in per_rank), ref[key], atol=TOL, rtol=0)


def test_ddp_conv_syncbn_matches_one_process_on_global_batch(ranks):
    dx, dt = _ddp_data()
    ref = _ddp_steps(_model(), dx, dt)
    assert any(k.endswith("running_var") for k in ref)
    for r in ranks:
        assert set(r["ddp"]) == set(ref)
        for key, value in ref.items():
            torch.testing.assert_close(r["ddp"][key].to(value.dtype), value, atol=TOL, rtol=0, msg=key)


def test_convert_copies_everything_and_behaves_as_batchnorm_without_group():
    model = nn.Sequential(
        nn.Conv2d(3, 3, 1),
        nn.BatchNorm2d(3, eps=1e-3, momentum=0.3),
        nn.Sequential(nn.BatchNorm1d(3, affine=False, track_running_stats=False)),
    )
    model[1].running_mean.fill_(0.5)
    reference = copy.deepcopy(model)
    converted = convert_sync_batchnorm(model, "cpu")
    bn, bn1d = converted[1], converted[2][0]
    assert isinstance(bn, CpuSyncBatchNorm) and isinstance(bn1d, CpuSyncBatchNorm)
    assert (bn.eps, bn.momentum, bn.affine, bn.track_running_stats) == (1e-3, 0.3, True, True)
    assert (bn1d.affine, bn1d.track_running_stats, bn1d.running_mean) == (False, False, None)
    assert torch.equal(bn.running_mean, reference[1].running_mean)
    x = torch.randn(4, 3, 5, 5)
    for mode in (True, False):  # no process group: plain BatchNorm in train and eval
        reference.train(mode), converted.train(mode)
        torch.testing.assert_close(converted[:2](x), reference[:2](x))
    assert isinstance(convert_sync_batchnorm(_model(), "cuda")[1], nn.SyncBatchNorm)
    with pytest.raises(ValueError, match="use 'cpu' or 'cuda'"):
        convert_sync_batchnorm(_model(), "mps")


def _single_rank_group(backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))


def test_sync_function_on_one_rank_group_equals_batch_norm():
    """The synchronized path itself (forced on a 1-rank gloo group) against F.batch_norm."""
    _single_rank_group("gloo")
    x, probe, weight, bias = _bn_data()
    ref = _bn_steps(_bn_layer(nn.BatchNorm2d, 0.1), x, probe)
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    rm, rv = torch.zeros(3), torch.ones(3)
    sync_batch_norm(x * 0.5 - 1, w, b, rm, rv)
    xr = x.clone().requires_grad_(True)
    y = sync_batch_norm(xr, w, b, rm, rv)
    (y * probe).sum().backward()
    for got, key in (
        (y, "y"),
        (xr.grad, "x_grad"),
        (w.grad, "w_grad"),
        (b.grad, "b_grad"),
        (rm, "running_mean"),
        (rv, "running_var"),
    ):
        torch.testing.assert_close(got.detach(), ref[key], atol=TOL, rtol=0, msg=key)


@pytest.mark.cuda
def test_sync_function_matches_torch_syncbn_on_cuda():
    """Our math against torch's own SyncBatchNorm autograd function, on one CUDA rank (nccl)."""
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBN

    _single_rank_group("nccl")
    x, probe, weight, bias = (t.cuda() for t in _bn_data())
    outs = []
    for fn in ("ours", "torch"):
        w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
        rm, rv = torch.zeros(3, device="cuda"), torch.ones(3, device="cuda")
        xr = x.clone().requires_grad_(True)
        if fn == "ours":
            y = sync_batch_norm(xr, w, b, rm, rv, 1e-5, 0.1, dist.group.WORLD)
        else:
            y = TorchSyncBN.apply(xr, w, b, rm, rv, 1e-5, 0.1, dist.group.WORLD, 1)
        (y * probe).sum().backward()
        outs.append([y.detach(), xr.grad, w.grad, b.grad, rm, rv])
    for ours, theirs in zip(*outs, strict=True):
        torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
