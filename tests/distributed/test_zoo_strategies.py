"""torchvision models by name under every strategy: ddp on 2 ranks, model_parallel and pipeline equal `single`.

One model per classification family, and DeepLabv3-MobileNetV3 for segmentation. DDP: 2 gloo ranks x 4 with BatchNorm synced equal one process with the batch
of 8 (ConvNeXt and Swin normalise with LayerNorm). model_parallel (2 stages on the CPU, the family's chain split
where the measured partition puts it, one micro-batch) equals the same single run. pipeline (2 ranks, 4
micro-batches of 2) normalises each micro-batch on its own, so its reference is `single` accumulating the same
4 micro-batches. Dropout and stochastic depth are switched off: they draw from each rank's own stream
(docs/strategies.md), so models with them match within their noise, not to 1e-5.

In float64: at 32 px with random weights these ImageNet models are ill-conditioned (BatchNorm over a few values
per channel at 1x1), and RegNet's float32 gradient differs from its own float64 gradient by 19 %, so a float32
comparison would measure rounding, not the strategy. In float64 ddp and single agree to about 1e-9.

Left to the fast tier (tests/unit/test_zoo.py, chain = forward exactly): VGG, AlexNet and ViT (61M to 133M
parameters: gathering them over gloo costs more than it proves; DDP does nothing family-specific).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn
from torch.utils.data import TensorDataset
from torchvision.models.convnext import CNBlockConfig

from gputrain import Trainer
from gputrain.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig
from gputrain.models import build_configured_model
from gputrain.tasks.classification import ClassificationTask
from gputrain.tasks.segmentation import SegmentationTask
from multiproc import run_ranks

TOL = 1e-5
CLASSES = 5
SEGMENTER = "deeplabv3_mobilenet_v3_large"
"""Trained by ddp with its auxiliary head (its loss at weight 0.5); split without it (the head reads an earlier
feature: not a chain)."""
CHAIN_FAMILIES = ["regnet_x_400mf", "efficientnet_b0", "mobilenet_v3_small", "convnext_tiny", "densenet121",
                  "shufflenet_v2_x0_5", "squeezenet1_1", "mnasnet0_5", "swin_t"]
NOT_CHAINS = {"googlenet": 32, "inception_v3": 75}
PIPELINED = ["efficientnet_b0", "convnext_tiny", "densenet121", SEGMENTER]
"""A trunk split inside ``features``, LayerNorm, inline glue (relu, pool, flatten), and a segmentation model's
input size carried to its upsample, between the stages."""


SMALLER = {  # the family's own class at a few thousand parameters: 28 M each by name cost 12 s of this file's 60
    "convnext_tiny": lambda: torchvision.models.ConvNeXt(
        [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)], num_classes=CLASSES),
    "swin_t": lambda: torchvision.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=[4, 4], num_classes=CLASSES),
}
"""ConvNeXt and Swin built by their class, smaller: the chain and the strategies depend on the class, which
tests/unit/test_zoo.py builds by name at full size."""


def _model(name: str, aux_loss: bool = False) -> nn.Module:
    side = NOT_CHAINS.get(name, 32)
    torch.manual_seed(0)
    kind, kwargs = ("segmentation", {"aux_loss": aux_loss}) if name == SEGMENTER else ("classification", {})
    model = SMALLER[name]() if name in SMALLER else build_configured_model(
        ModelConfig(name=name, kwargs=kwargs), "", kind=kind, num_classes=CLASSES, input_size=(side, side))
    for module in model.modules():
        if hasattr(module, "p") and type(module).__name__ in ("Dropout", "StochasticDepth"):
            module.p = 0.0
    return model.double()


def _data(name: str) -> TensorDataset:
    side = NOT_CHAINS.get(name, 32)
    g = torch.Generator().manual_seed(1)
    if name == SEGMENTER:
        return TensorDataset(torch.randn(8, 3, side, side, generator=g, dtype=torch.float64),
                             torch.randint(0, CLASSES, (8, side, side), generator=g))
    return TensorDataset(torch.randn(8, 3, side, side, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (8,), generator=g))


def _fit(out: str, name: str, *, strategy: str, devices: int, batch: int, accumulate: int = 1,
         micro_batches: int = 1, aux_loss: bool = False) -> dict[str, torch.Tensor]:
    parallel = ParallelConfig(micro_batches=micro_batches)
    cfg = RunConfig(optim=OptimConfig(name="sgd", lr=0.001, momentum=0.9), parallel=parallel)
    trainer = Trainer(cfg, strategy=strategy, devices=devices, accelerator="cpu", batch_size=batch,
                      accumulate_grad_batches=accumulate, epochs=1, out=out, progress_bar=False, loggers=[],
                      enable_checkpointing=False, log_every_n_steps=1, sync_batchnorm=strategy == "ddp")
    task = SegmentationTask(CLASSES) if name == SEGMENTER else ClassificationTask(CLASSES)
    trainer.fit(_model(name, aux_loss), _data(name), task=task)
    return {k: v.detach().cpu().clone() for k, v in trainer.strategy.model_state_dict(trainer.module).items()}


def _rank_runs(info, out: str) -> dict[str, dict[str, torch.Tensor]]:
    # Every 2-rank run in one launch: process start-up is paid once.
    runs = {f"ddp/{name}": _fit(f"{out}/ddp_{name}", name, strategy="ddp", devices=2, batch=4)
            for name in [*CHAIN_FAMILIES, *NOT_CHAINS, SEGMENTER]}
    runs["ddp/aux"] = _fit(f"{out}/ddp_aux", SEGMENTER, strategy="ddp", devices=2, batch=4, aux_loss=True)
    runs |= {f"pipeline/{name}": _fit(f"{out}/pipe_{name}", name, strategy="pipeline", devices=2, batch=8,
                                      micro_batches=4) for name in PIPELINED}
    return runs


# About 21 s on the 2 cores, over the 20 s a test may take without a reason: the promise is one model per family,
# and the 13 ddp runs and 4 pipelines share one launch of 2 ranks (each at 8 samples of 32 px, one step).
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict[str, dict[str, torch.Tensor]]]]:
    out = tmp_path_factory.mktemp("zoo")
    return out, run_ranks(_rank_runs, str(out))


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) / max(1.0, float(b[k].double().abs().max()))
               for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("name", [*CHAIN_FAMILIES, *NOT_CHAINS, SEGMENTER])
def test_ddp_on_two_ranks_and_model_parallel_equal_single(ranks, name):
    out, by_rank = ranks
    single = _fit(str(out / f"single_{name}"), name, strategy="single", devices=1, batch=8)
    assert max_rel_diff(single, _model(name).state_dict()) > 1e-4, "training must move the weights"
    assert max_rel_diff(by_rank[0][f"ddp/{name}"], single) <= TOL
    if name in NOT_CHAINS:
        return
    split = _fit(str(out / f"mp_{name}"), name, strategy="model_parallel", devices=1, batch=8)
    assert max_rel_diff(split, single) <= TOL


def test_ddp_trains_a_segmenters_auxiliary_head_as_single_does(ranks):
    out, by_rank = ranks
    single = _fit(str(out / "single_aux"), SEGMENTER, strategy="single", devices=1, batch=8, aux_loss=True)
    assert max_rel_diff(by_rank[0]["ddp/aux"], single) <= TOL
    assert any(k.startswith("aux_classifier.") for k in single)


@pytest.mark.parametrize("name", PIPELINED)
def test_pipeline_equals_single_accumulating_its_micro_batches(ranks, name):
    out, by_rank = ranks
    single = _fit(str(out / f"acc_{name}"), name, strategy="single", devices=1, batch=2, accumulate=4)
    assert max_rel_diff(by_rank[0][f"pipeline/{name}"], single) <= TOL
