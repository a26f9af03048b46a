"""Pretrained weights: ``model.weights`` as a torchvision name, a timm tag, a local file or a URL.

A torchvision name (``DEFAULT``, ``IMAGENET1K_V1``, ``COCO_V1``, ... as torchvision spells them for the
model, any torchvision model gputrain builds; for DeepLabv3+ its ResNet backbone's) resolves through torchvision's own weights API to a URL.
URLs are fetched into the torch hub cache (``$TORCH_HOME/hub/checkpoints``) with torch.hub's download,
which checks the hash prefix that torchvision puts in its file names. The launcher fetches once per
node before any worker starts (:func:`fetch`); workers then find the file in the cache and only load it.

Loading keeps every pretrained tensor whose name and shape fit the model; the rest (the classification
head sized for the dataset's classes, the CIFAR stem) keep their fresh initialisation and are named in
one line, so a user sees exactly what was not transferred.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from gputrain.models import timm_zoo

TORCHVISION_MODEL = {"resnet18": "resnet18", "resnet50": "resnet50", "maskrcnn_resnet50_fpn": "maskrcnn_resnet50_fpn"}
"""gputrain's built-in model name -> the torchvision model whose weights it takes (DeepLabv3+: its backbone's)."""
KEY_PREFIX = {"deeplabv3plus": "backbone."}
"""Where the torchvision model's tensors sit inside ours (DeepLabv3+ holds the ResNet trunk as ``backbone``)."""


@dataclass(frozen=True)
class WeightsSource:
    """Where ``model.weights`` points: a file on disk, possibly still to be fetched from ``url``."""

    given: str
    path: Path
    url: str = ""


def _torchvision_name(model_name: str, kwargs: dict[str, Any]) -> str:
    if model_name == "deeplabv3plus":
        return str(kwargs.get("backbone", "resnet50"))
    if model_name == "maskrcnn_resnet50_fpn" and kwargs.get("backbone", "resnet50") != "resnet50":
        raise ValueError(f"model.weights: torchvision has COCO weights for Mask R-CNN on resnet50 only, not "
                         f"model.kwargs.backbone={kwargs['backbone']!r}; drop the backbone option or model.weights")
    if model_name in TORCHVISION_MODEL:
        return TORCHVISION_MODEL[model_name]
    from gputrain.models.zoo import kind_of

    if kind_of(model_name) is None:
        raise ValueError(f"model.weights by name needs a torchvision model (docs/models.md), not "
                         f"model.name={model_name!r}; pass a file path or URL instead")
    return model_name


def hub_checkpoints() -> Path:
    """The torch hub cache folder for weights files (``$TORCH_HOME/hub/checkpoints``)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def weights_source(model_name: str, kwargs: dict[str, Any], weights: str) -> WeightsSource:
    """Resolve ``model.weights`` (no download); a name unknown to torchvision is one line listing the valid ones."""
    if weights.startswith(("http://", "https://")):
        return WeightsSource(weights, hub_checkpoints() / Path(urlparse(weights).path).name, weights)
    if os.sep in weights or weights.endswith((".pt", ".pth", ".safetensors")) or Path(weights).exists():
        path = Path(weights).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.weights={weights!r} is not a file; pass a state_dict file, a URL or a "
                                    f"torchvision weights name such as DEFAULT")
        return WeightsSource(weights, path)
    if timm_zoo.is_timm(model_name):  # a tag of timm's, from the Hugging Face hub: path known once fetched
        return WeightsSource(weights, Path(), f"hf://{timm_zoo.weights_repo(model_name, weights)}")
    import torchvision

    tv_name = _torchvision_name(model_name, kwargs)
    enum = torchvision.models.get_model_weights(tv_name)
    if weights not in enum.__members__:
        raise ValueError(f"model.weights={weights!r} is not a weights name of torchvision's {tv_name}; valid: "
                         f"{', '.join(enum.__members__)}")
    url = enum[weights].url
    return WeightsSource(weights, hub_checkpoints() / Path(urlparse(url).path).name, url)


def fetch(source: WeightsSource) -> Path:
    """The weights file on disk: downloaded into the hub cache (hash-checked) unless it is there already."""
    if source.url.startswith("hf://"):  # the cached file without asking the hub first, as torch.hub's cache does
        repo = source.url.removeprefix("hf://")
        try:
            return timm_zoo.download(repo, source.given, local_only=True)
        except ValueError:
            return timm_zoo.download(repo, source.given)
    if source.path.is_file() or not source.url:
        return source.path
    source.path.parent.mkdir(parents=True, exist_ok=True)
    match = re.search(torch.hub.HASH_REGEX, source.path.name)  # torchvision's names carry a sha256 prefix
    try:
        torch.hub.download_url_to_file(source.url, str(source.path), match.group(1) if match else None,
                                       progress=False)
    except (OSError, RuntimeError, ValueError) as err:  # URLError is an OSError; a hash mismatch a RuntimeError
        reason = str(getattr(err, "reason", "") or err).splitlines()[0]
        raise ValueError(f"model.weights={source.given!r}: cannot download {source.url} ({reason}); put the file "
                         f"{source.path.name} in {source.path.parent} (or set TORCH_HOME) and run again") from None
    return source.path


def apply_pretrained(model: nn.Module, model_name: str, kwargs: dict[str, Any], weights: str) -> nn.Module:
    """Load ``weights`` into ``model``: every tensor whose name and shape fit; the rest are named in one line."""
    source = weights_source(model_name, kwargs, weights)
    path = fetch(source)
    state: Any
    if path.suffix == ".safetensors":  # timm's weights on the hub
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise ValueError(f"model.weights={weights!r}: {path} holds a {type(state).__name__}, not a state_dict")
    prefix = KEY_PREFIX.get(model_name, "")
    state = {prefix + k.removeprefix("module."): v for k, v in state.items()}
    own = model.state_dict()
    fitting = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    if not fitting:
        raise ValueError(f"model.weights={weights!r}: no tensor of {path} fits {model_name}; check model.name and "
                         f"model.kwargs match the model the weights were saved from")
    model.load_state_dict(fitting, strict=False)
    parameters = {name for name, _ in model.named_parameters()}
    # optim.pretrained_lr_scale gives these their own learning rate (read by gputrain.optim.build_optimizer)
    object.__setattr__(model, "gputrain_pretrained", frozenset(k for k in fitting if k in parameters))
    fresh = [k for k in own if k not in fitting and not k.endswith("num_batches_tracked")]
    if os.environ.get("RANK", "0") == "0":  # every rank loads; one says what was loaded
        new = f"; kept fresh (not in the weights or another shape): {', '.join(_tensor_groups(fresh))}" if fresh else ""
        print(f"gputrain: model.weights={weights} ({path.name}): loaded {len(fitting)} of {len(own)} tensors{new}",
              file=sys.stderr, flush=True)
    return model


def _tensor_groups(keys: list[str]) -> list[str]:
    """``fc.weight, fc.bias`` -> ``fc.{weight,bias}``: short enough for one line."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        module, _, leaf = key.rpartition(".")
        groups.setdefault(module, []).append(leaf)
    return [f"{m}.{{{','.join(v)}}}" if len(v) > 1 else f"{m}.{v[0]}" for m, v in groups.items()]
