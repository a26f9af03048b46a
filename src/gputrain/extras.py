"""What lives outside gputrain: optional packages (the ``gputrain[...]`` extras) and user code a recipe names.

Nothing here imports torch, so the command line and the loggers can use it freely. Every failure is one line
naming the package or the config field and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from gputrain.errors import MissingExtra

EXTRAS: dict[str, str] = {
    "tensorboard": "loggers", "wandb": "loggers", "pycocotools": "coco", "matplotlib": "plot",
    "onnx": "export", "onnxruntime": "export", "onnxscript": "export",
}
"""Optional packages, by import name, and the ``gputrain[...]`` extra that installs each."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (tensorboard alone takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def install_hint(module: str) -> str:
    extra = EXTRAS.get(module)
    return f"pip install 'gputrain[{extra}]'" if extra else f"pip install {module}"


def require(module: str, what: str) -> None:
    """Raise :class:`~gputrain.errors.MissingExtra` (one line) when ``module``, needed by ``what``, is not installed."""
    if not installed(module):
        raise MissingExtra(f"{what} needs the {module} package, which is not installed; {install_hint(module)}")


def resolve(target: str, *, field: str) -> Any:
    """Import ``package.module:attribute`` (how recipes name user code); errors name the config ``field``."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}={target!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field}={target!r}: cannot import {module_name} ({err}); is it on PYTHONPATH?") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{field}={target!r}: module {module_name} has no attribute {attr!r}") from None
