"""timm's classifiers by name, as an optional extra (``pip install 'gputrain[timm]'``): ``model.name=timm/ARCH``.

The ``timm/`` prefix cannot clash with torchvision's names (none has a slash) and is how timm names its weights on the
Hugging Face hub (``timm/resnet50.a1_in1k``). Built with ``timm.create_model(ARCH, pretrained=False,
num_classes=...)``; ``model.weights`` takes ``DEFAULT`` (the architecture's default pretrained tag), a tag of its
own (``a1_in1k``), or a local file (``.safetensors``, ``.pth``), and loads like any weights here: what fits is loaded,
the rest is named in one line (:mod:`gputrain.models.pretrained`). A tag is fetched once per node into the Hugging
Face cache (``$HF_HOME/hub``) by ``huggingface_hub``; offline and not cached, one line names the file to place.

timm's models are classifiers: classification recipes take them, under every strategy that does not split the model
(their forwards are not chains gputrain knows; docs/models.md).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn  # annotations only: the launcher's check of a name imports no torch


PREFIX = "timm/"
EXTRA = "pip install 'gputrain[timm]' (timm==1.0.31)"


def is_timm(name: str) -> bool:
    return name.startswith(PREFIX)


def _timm(name: str) -> Any:
    try:
        import timm
    except ImportError:
        raise ValueError(f"model.name={name!r} needs timm, which is not installed: {EXTRA}") from None
    return timm


def check_name(name: str, kind: str) -> None:
    """Refuse in one line a timm name for a task that is not classification, or an architecture timm lacks."""
    if kind != "classification":
        raise ValueError(f"model.name={name!r}: timm's models are classifiers, and this recipe's task trains a {kind} "
                         "model; choose a torchvision one (docs/models.md)")
    timm = _timm(name)
    arch = name.removeprefix(PREFIX)
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch.split(".")[0], timm.list_models(), n=4, cutoff=0.5)
        hint = f"closest: {', '.join(PREFIX + c for c in close)}" if close else "timm.list_models() lists them"
        raise ValueError(f"model.name={name!r} is not a timm model; {hint}")


def check_splits(name: str, strategy: str) -> None:
    if strategy in ("model_parallel", "pipeline"):
        raise ValueError(f"strategy {strategy} cannot split {name} (gputrain derives chains for torchvision's models "
                         "only: docs/models.md); train it with strategy single, ddp, dp or fsdp")


def build(name: str, **kwargs: Any) -> nn.Module:
    """``timm.create_model`` without weights; ``kwargs`` (the class count, ``model.kwargs``) go to the model."""
    timm = _timm(name)
    try:
        model = timm.create_model(name.removeprefix(PREFIX), pretrained=False, **kwargs)
    except (TypeError, ValueError, RuntimeError) as err:
        reason = " ".join(str(err).split()).rstrip(".")
        raise ValueError(f"model.name={name!r} cannot be built with {kwargs}: {reason}") from None
    return model


def weights_repo(name: str, weights: str) -> str:
    """The Hugging Face repo of ``model.weights`` (``DEFAULT`` or a tag) for ``name``; one line if timm has none."""
    timm = _timm(name)
    arch = name.removeprefix(PREFIX).split(".")[0]
    tags = [t.split(".", 1)[1] for t in timm.list_pretrained(f"{arch}.*") if "." in t]
    if weights == "DEFAULT":
        cfg = timm.models.get_pretrained_cfg(name.removeprefix(PREFIX))
        if cfg is None or not cfg.hf_hub_id:
            raise ValueError(f"model.weights=DEFAULT: timm has no pretrained weights on the hub for {name}; pass a file")
        return str(cfg.hf_hub_id)
    if weights not in tags:
        raise ValueError(f"model.weights={weights!r} is not a weights tag of timm's {arch}; valid: DEFAULT, "
                         f"{', '.join(tags) or '(none: pass a file)'}")
    return f"timm/{arch}.{weights}"


def _cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (huggingface_hub reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def download(repo: str, given: str, *, local_only: bool = False) -> Path:
    """``model.safetensors`` of ``repo`` from the Hugging Face cache, downloaded there unless it is there already."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    from huggingface_hub.utils import logging as hub_logging

    offline = local_only or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    hub_logging.set_verbosity_error()  # its retries print a line each; the failure is said once, below
    try:
        return Path(hf_hub_download(repo, "model.safetensors", cache_dir=_cache_dir(), local_files_only=offline))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model.weights={given!r}: cannot fetch model.safetensors of {repo} ({reason}); download "
                         f"https://huggingface.co/{repo}/resolve/main/model.safetensors and pass "
                         f"model.weights=/path/to/model.safetensors (or fill {_cache_dir()} where the hub can be "
                         "reached; HF_HUB_OFFLINE=1 skips the retries)") from None
