"""Model builders. Built-in names map to functions in this package; any other torchvision model by its torchvision
name (:mod:`gputrain.models.zoo`); any ``package.module:function`` too.

Model code knows nothing about parallelism: strategies wrap models, models never wrap themselves.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gputrain.extras import resolve
from gputrain.models import timm_zoo

if TYPE_CHECKING:
    from torch import nn

    from gputrain.config import ModelConfig

BUILTIN_MODELS: dict[str, str] = {
    "conv_autoencoder": "gputrain.models.vision:conv_autoencoder",
    "resnet18": "gputrain.models.vision:resnet18_classifier",
    "resnet50": "gputrain.models.vision:resnet50_classifier",
    "deeplabv3plus": "gputrain.models.deeplabv3plus:DeepLabV3Plus",
    "maskrcnn_resnet50_fpn": "gputrain.models.vision:maskrcnn",
}
BUILTIN_KINDS: dict[str, str] = {"resnet18": "classification", "resnet50": "classification",
                                 "deeplabv3plus": "segmentation", "maskrcnn_resnet50_fpn": "detection"}
"""The kind of task each built-in model serves (the autoencoder serves its own task alone)."""


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """``name`` is a key of :data:`BUILTIN_MODELS`, a torchvision model name, or ``package.module:function``."""
    target = BUILTIN_MODELS.get(name, name)
    if timm_zoo.is_timm(name):
        return timm_zoo.build(name, **kwargs)
    if ":" not in target:
        from gputrain.models import zoo

        kind = zoo.kind_of(name)
        if kind is None:
            raise ValueError(f"model.name={name!r} is unknown; built-in: {sorted(BUILTIN_MODELS)}, a torchvision model "
                             "name (docs/models.md), or package.module:function")
        return zoo.build(name, kind, **kwargs)
    from torch import (
        nn,  # here: the launcher checks a model's name (check_model_name) without importing torch
    )

    builder = resolve(target, field="model.name")
    check_kwargs(builder, name, kwargs)
    model = builder(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model.name={name!r} returned {type(model).__name__}, not an nn.Module")
    return model


def check_kwargs(builder: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> None:
    """Refuse in one line a ``model.kwargs`` key that ``builder`` takes no argument of (a misspelt option would
    otherwise end in Python's TypeError from inside the builder); the closest option it takes is named."""
    try:
        params = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = (f"did you mean model.kwargs.{close[0]}?" if close
                    else f"drop it (its options: {', '.join(accepted) or 'none'})")
            raise ValueError(f"model.kwargs.{key}: model.name={name!r} takes no option {key!r}; {hint}")


def check_model_name(name: str, kind: str) -> None:
    """Refuse in one line a ``model.name`` that is no model of the task's ``kind`` (before any worker starts)."""
    if kind and timm_zoo.is_timm(name):
        timm_zoo.check_name(name, kind)
    elif kind and name and name not in BUILTIN_MODELS and ":" not in name:
        from gputrain.models import zoo

        zoo.check_name(name, kind, [n for n, k in BUILTIN_KINDS.items() if k == kind])


def build_configured_model(cfg: ModelConfig, default: str, *, kind: str = "", input_size: tuple[int, int] | None = None,
                           **derived: Any) -> nn.Module:
    """Build ``cfg``'s model, first writing the resolved name and kwargs back into ``cfg``.

    Tasks derive some arguments from the data (``num_classes``; for a torchvision model of the task's ``kind``,
    what its builder needs from the data's ``input_size``); recording them in the config that is saved with every
    checkpoint lets export and evaluation rebuild the same model without the data. Explicit ``model.kwargs`` win
    over derived values.
    """
    cfg.name = cfg.name or default
    check_model_name(cfg.name, kind)
    if kind and cfg.name not in BUILTIN_MODELS and ":" not in cfg.name and not timm_zoo.is_timm(cfg.name):
        from gputrain.models import zoo

        derived = {**derived, **zoo.derived_kwargs(cfg.name, kind, input_size)}
    cfg.kwargs = {**derived, **cfg.kwargs}
    model = build_model(cfg.name, **cfg.kwargs)
    if cfg.weights:
        from gputrain.models.pretrained import apply_pretrained

        apply_pretrained(model, cfg.name, cfg.kwargs, cfg.weights)
    return finetuned(model, cfg)


def finetuned(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """``model`` with ``cfg``'s frozen blocks and BatchNorm; a checkpoint's model is rebuilt with them too."""
    if not cfg.freeze and not cfg.frozen_batchnorm:
        return model
    from gputrain.models.finetune import apply_finetuning

    return apply_finetuning(model, cfg.freeze, cfg.frozen_batchnorm)
