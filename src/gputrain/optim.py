"""Optimizers and learning-rate schedules from config; the schedule is a pure function of the step."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gputrain.config import OptimConfig, SchedulerConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters (every requires_grad is False)")
    params: list[Any] = _groups(model, named, cfg)
    name = cfg.name.lower()
    # One kernel for all parameters instead of one per tensor (optim.fused; auto resolves it per device). Off,
    # the call is torch's default (foreach where supported), unchanged.
    fused: dict[str, Any] = {"fused": True} if cfg.fused is True else {}
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=cfg.nesterov, **fused
        )
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    raise ValueError(f"optim.name={cfg.name!r} is unknown; choose sgd, adam or adamw")


def lr_factor(step: int, total_steps: int, steps_per_epoch: int, cfg: SchedulerConfig) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    name = cfg.name.lower()
    if name == "constant":
        return 1.0
    if name == "step":
        return cfg.gamma ** ((step // max(steps_per_epoch, 1)) // max(cfg.step_epochs, 1))
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    floor = cfg.min_lr_ratio
    if name == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if name == "poly":
        return floor + (1 - floor) * (1 - progress) ** cfg.power
    raise ValueError(f"scheduler.name={cfg.name!r} is unknown; choose constant, cosine, poly or step")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, *, total_steps: int, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    lr_factor(0, total_steps, steps_per_epoch, cfg)  # fail now on a bad name, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, steps_per_epoch, cfg)
    )


LR_SCALING_RULES = ("none", "linear", "sqrt")


def scaled_lr(lr: float, global_batch: int, reference_batch: int, rule: str) -> float:
    """``lr`` tuned for ``reference_batch``, rescaled for ``global_batch`` (Goyal et al.'s linear rule, or sqrt).

    ``none`` returns ``lr`` unchanged; ``linear`` gives ``lr * G / ref``; ``sqrt`` gives
    ``lr * sqrt(G / ref)`` (often better for Adam-type optimizers). A pure function, so the
    loop, ``gputrain doctor`` and tests compute the same number.
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"optim.scale_lr={rule!r} is unknown; choose none, linear or sqrt")
    if reference_batch <= 0:
        raise ValueError(f"optim.reference_batch={reference_batch} must be a positive batch size (the global batch "
                         f"optim.lr={lr} was tuned for)")
    if global_batch <= 0:
        raise ValueError(f"the global batch is {global_batch}; trainer.batch_size must be at least 1")
    if rule == "none":
        return lr
    ratio = global_batch / reference_batch
    return lr * ratio if rule == "linear" else lr * math.sqrt(ratio)


NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
               nn.LocalResponseNorm)
"""Normalisation layers, as torchvision's reference lists them for ``--norm-weight-decay``."""


def _decay(model: nn.Module, names: list[str], cfg: OptimConfig) -> dict[str, float]:
    """Each parameter's weight decay, as the reference's ``set_weight_decay``: a parameter named ``bias`` takes
    ``bias_weight_decay`` (norms' biases too), a normalisation layer's other parameters ``norm_weight_decay``, the
    rest ``weight_decay``; an option left None is ``weight_decay``."""
    norms = {f"{m}.{p}" if m else p for m, module in model.named_modules() if isinstance(module, NORM_LAYERS)
             for p, _ in module.named_parameters(recurse=False)}
    decay = {}
    for name in names:
        if name.rpartition(".")[2] == "bias" and cfg.bias_weight_decay is not None:
            decay[name] = cfg.bias_weight_decay
        elif name in norms and cfg.norm_weight_decay is not None:
            decay[name] = cfg.norm_weight_decay
        else:
            decay[name] = cfg.weight_decay
    return decay


def _groups(model: nn.Module, named: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> list[Any]:
    """The parameters, in groups only where an option asks for them: the tensors ``model.weights`` loaded at
    ``lr * pretrained_lr_scale``, and each weight decay of :func:`_decay`. Groups keep the model's order of first
    appearance, the fresh tensors' first; the scheduler multiplies each group's rate by the same factor, and checkpoints hold every group."""
    if cfg.pretrained_lr_scale == 1 and cfg.norm_weight_decay is None and cfg.bias_weight_decay is None:
        return [p for _, p in named]
    pretrained = getattr(model, "gputrain_pretrained", None)
    if cfg.pretrained_lr_scale != 1 and pretrained is None:
        raise ValueError(f"optim.pretrained_lr_scale={cfg.pretrained_lr_scale} scales the tensors model.weights "
                         f"loaded, and this model has none; set model.weights (with a strategy that keeps the whole "
                         f"model in each process, not pipeline) or drop optim.pretrained_lr_scale")
    decay = _decay(model, [n for n, _ in named], cfg)
    groups: dict[tuple[bool, float], dict[str, Any]] = {}
    for name, param in named:
        scaled = cfg.pretrained_lr_scale != 1 and name in (pretrained or ())
        group = groups.setdefault((scaled, decay[name]), {"params": [], "weight_decay": decay[name]})
        if scaled:
            group["lr"] = cfg.lr * cfg.pretrained_lr_scale
        group["params"].append(param)
    # The fresh tensors' groups before the pretrained ones: the order checkpoints of earlier versions hold.
    return [g for (scaled, _), g in groups.items() if not scaled] + [g for (scaled, _), g in groups.items() if scaled]
