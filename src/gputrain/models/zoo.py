"""Any torchvision model by its torchvision name: classification, detection and segmentation.

``model.name`` that is not one of gputrain's built-in names (:data:`gputrain.models.BUILTIN_MODELS`) nor a
``package.module:function`` is looked up among torchvision's builders of the task's kind, through torchvision's
own registry (``list_models(module=...)``, ``get_model``); nothing here lists models by hand. Each is built with
``weights=None`` (never a download here: ``model.weights`` loads afterwards, :mod:`gputrain.models.pretrained`) and
with the data's number of classes, so the head fits the data and pretrained heads of another size are left fresh.

A few builders need more than the class count, and get it from the data:
- a model whose input size is fixed at build time (ViT's ``image_size``, MaxViT's ``input_size``) is built for
  the data's image size;
- a model with a floor on its input (Inception v3: 75 px, as its weights' ``min_size`` says) refuses a smaller
  one in one line naming the smallest size, instead of failing deep in a convolution;
- GoogLeNet and Inception v3 are built without their auxiliary classifiers, which return a tuple in training that
  no task's loss reads (their pretrained weights still load: the auxiliary tensors are simply not used).
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any

from torch import nn

KIND_MODULES = {
    "classification": "torchvision.models",
    "detection": "torchvision.models.detection",
    "segmentation": "torchvision.models.segmentation",
}
"""The model kinds gputrain trains, and the torchvision module holding each kind's builders."""

NO_AUX_LOGITS = ("googlenet", "inception_v3")
"""Classifiers whose training-mode forward returns auxiliary logits too unless built with ``aux_logits=False``."""


UNSUPPORTED = {"keypointrcnn_resnet50_fpn": "Keypoint R-CNN trains on keypoint targets, and the detection task reads "
               "COCO boxes and masks; choose a box or mask detector (docs/models.md)"}
"""torchvision models of a kind gputrain trains whose targets its tasks do not read."""


def names(kind: str) -> list[str]:
    """torchvision's model names of ``kind`` (sorted), as ``torchvision.models.list_models`` gives them."""
    import torchvision

    return sorted(torchvision.models.list_models(module=import_module(KIND_MODULES[kind])))


def kind_of(name: str) -> str | None:
    """The kind of torchvision model ``name`` is, or None for a name torchvision does not build in these kinds."""
    return next((kind for kind in KIND_MODULES if name in names(kind)), None)


def check_name(name: str, kind: str, builtin: Sequence[str]) -> None:
    """Refuse in one line a name that is no model of ``kind``: another kind's model, or an unknown name with the
    closest valid names for the task."""
    if name in UNSUPPORTED:
        raise ValueError(f"model.name={name!r}: {UNSUPPORTED[name]}")
    if name in names(kind):
        return
    other = kind_of(name)
    valid = sorted({*names(kind), *builtin} - UNSUPPORTED.keys())
    close = difflib.get_close_matches(name, valid, n=4, cutoff=0.5)
    like = ", ".join(close or valid[:6])
    if other is not None:
        raise ValueError(f"model.name={name!r} is a torchvision {other} model, and this recipe's task trains a "
                         f"{kind} model; choose a {kind} model, e.g. {like} (docs/models.md lists them)")
    raise ValueError(f"model.name={name!r} is not a {kind} model gputrain knows; closest: {like} (docs/models.md "
                     "lists them), or write package.module:function for a model of your own")


NOT_CHAINS = ("vit_", "googlenet", "inception_v3")
"""Classifiers whose forward is no chain of blocks (a class token; an input transform and branches), by name: the
splitting strategies refuse them before any worker starts (:mod:`gputrain.parallel.families` holds the classes)."""


def check_splits(name: str, strategy: str, kwargs: dict[str, Any]) -> None:
    """Refuse in one line a torchvision model that is no chain under model_parallel or pipeline."""
    if strategy not in ("model_parallel", "pipeline"):  # first: kind_of imports torchvision, seconds in a launcher
        return
    kind = kind_of(name)
    if kind is None:
        return
    if kind == "segmentation" and name.startswith(("deeplabv3_", "fcn_")) and kwargs.get("aux_loss", True):
        raise ValueError(f"strategy {strategy} cannot split torchvision's {name} with its auxiliary head (it reads an "
                         "earlier feature); set model.kwargs.aux_loss=false to split it, or train it with strategy "
                         "single, ddp, dp or fsdp")
    if kind == "segmentation" and name.startswith(("deeplabv3_", "fcn_")):
        return
    if kind != "classification" or name.startswith(NOT_CHAINS):
        raise ValueError(f"strategy {strategy} cannot split torchvision's {name} into a chain of blocks (its forward "
                         "is no chain: docs/models.md); train it with strategy single, ddp, dp or fsdp")


def detects_masks(name: str) -> bool:
    """Whether a detection model predicts masks: Mask R-CNN and models of your own do (as before); torchvision's
    other detectors predict boxes alone."""
    return kind_of(name) != "detection" or name.startswith("maskrcnn")


def _min_size(name: str) -> tuple[int, int]:
    """The smallest input (height, width) the model's own weights metadata states; (1, 1) where it states none."""
    import torchvision

    try:
        weights = torchvision.models.get_model_weights(name)
    except ValueError:  # a builder without weights
        return (1, 1)
    sizes = [tuple(w.meta.get("min_size", (1, 1))) for w in weights]
    return (max(s[0] for s in sizes), max(s[1] for s in sizes)) if sizes else (1, 1)


def derived_kwargs(name: str, kind: str, input_size: tuple[int, int] | None) -> dict[str, Any]:
    """What the builder needs from the data beyond the class count, checked against its input floor."""
    import torchvision

    params = inspect.signature(torchvision.models.get_model_builder(name)).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    extra: dict[str, Any] = {}
    if kind == "classification" and name in NO_AUX_LOGITS:
        extra.update(aux_logits=False, init_weights=True)
    if kind == "detection":
        extra["weights_backbone"] = None  # the builders' default downloads ImageNet weights for the backbone
    if kind == "segmentation":
        extra.update(weights_backbone=None, aux_loss=_has_aux(name))
    if input_size is None or kind != "classification":
        return extra
    sized = input_size[0] == input_size[1]
    if name.startswith("vit_") and takes_kwargs and sized:
        return {**extra, "image_size": input_size[0]}
    if name.startswith("maxvit_") and takes_kwargs:
        return {**extra, "input_size": list(input_size)}
    if name.startswith("swin_"):  # its weights state 224 (256 for v2), but it pads each window: any size runs
        return extra
    floor = _min_size(name)
    if input_size[0] < floor[0] or input_size[1] < floor[1]:
        raise ValueError(f"model.name={name!r} needs images of at least {floor[0]}x{floor[1]} px and the data gives "
                         f"{input_size[0]}x{input_size[1]}; set data.image_size={max(floor)} or choose another model")
    return extra


def _has_aux(name: str) -> bool:
    """Segmentation models with an auxiliary head (DeepLabv3, FCN): trained with it, as torchvision's reference."""
    return not name.startswith("lraspp")


def build(name: str, kind: str, **kwargs: Any) -> nn.Module:
    """torchvision's ``name`` built without weights; ``kwargs`` (the class count, :func:`derived_kwargs`, the
    user's ``model.kwargs``) go to its builder."""
    import torchvision

    try:
        model = torchvision.models.get_model(name, weights=None, **kwargs)
    except (TypeError, ValueError, AssertionError) as err:  # an option the builder refuses, a size it cannot take
        reason = " ".join(str(err).split()).rstrip(".")
        raise ValueError(f"model.name={name!r} cannot be built with {kwargs}: {reason}{_hint(reason)}") from None
    _note_ignored(name, model, kwargs)
    return model


def _hint(reason: str) -> str:
    """The fix for a builder's refusal: drop an option it does not take, or choose another input size."""
    option = re.search(r"(?:multiple values for argument|unexpected keyword argument) '(\w+)'", reason)
    if option:
        return f"; drop model.kwargs.{option.group(1)} (this model sets or lacks it)"
    if "size" in reason:
        return "; choose data.image_size (224 fits every torchvision model)"
    return ""


_NOTED: set[tuple[str, ...]] = set()
"""The (model name, options) :func:`_note_ignored` has named in this process."""


def _note_ignored(name: str, model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Some builders and classes take ``**kwargs`` and drop what they do not know (MobileNetV3, the segmentation
    builders): a misspelled option would change nothing, silently. Named here, in one line, not refused (a class may
    pass it on to a part that takes it)."""
    import torchvision

    known: set[str] = set(inspect.signature(torchvision.models.get_model_builder(name)).parameters)
    for cls in type(model).__mro__:
        if "__init__" in vars(cls):
            known |= set(inspect.signature(cls.__init__).parameters)  # type: ignore[misc]
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown and os.environ.get("RANK", "0") == "0" and (name, *unknown) not in _NOTED:
        _NOTED.add((name, *unknown))  # eval and predict build the model twice: one line, not two
        print(f"gputrain: model.kwargs {', '.join(unknown)}: no option of that name in {name}'s builder or "
              f"{type(model).__name__}; it may be ignored (check the spelling)", file=sys.stderr, flush=True)
