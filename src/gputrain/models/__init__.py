"""Model builders. Built-in names map to functions in this package; any ``package.module:function`` works too.

Model code knows nothing about parallelism: strategies wrap models, models never wrap themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from gputrain.extras import resolve

if TYPE_CHECKING:
    from gputrain.config import ModelConfig

BUILTIN_MODELS: dict[str, str] = {
    "conv_autoencoder": "gputrain.models.vision:conv_autoencoder",
    "resnet18": "gputrain.models.vision:resnet18_classifier",
    "resnet50": "gputrain.models.vision:resnet50_classifier",
    "deeplabv3plus": "gputrain.models.deeplabv3plus:DeepLabV3Plus",
    "maskrcnn_resnet50_fpn": "gputrain.models.vision:maskrcnn",
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """``name`` is a key of :data:`BUILTIN_MODELS` or ``package.module:function``."""
    target = BUILTIN_MODELS.get(name, name)
    if ":" not in target:
        raise ValueError(f"model.name={name!r} is unknown; built-in: {sorted(BUILTIN_MODELS)}, or package.module:function")
    model = resolve(target, field="model.name")(**kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model.name={name!r} returned {type(model).__name__}, not an nn.Module")
    return model


def build_configured_model(cfg: ModelConfig, default: str, **derived: Any) -> nn.Module:
    """Build ``cfg``'s model, first writing the resolved name and kwargs back into ``cfg``.

    Tasks derive some arguments from the data (``num_classes``); recording them in the config that
    is saved with every checkpoint lets export and evaluation rebuild the same model without the data.
    Explicit ``model.kwargs`` win over derived values.
    """
    cfg.name = cfg.name or default
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
