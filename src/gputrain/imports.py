"""Resolve ``package.module:attribute`` strings, the way recipes name user code."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(target: str, *, field: str) -> Any:
    """Import ``package.module:attribute``; errors name the config ``field`` and the failing part."""
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
