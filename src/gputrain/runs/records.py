"""What a run writes besides checkpoints: strict JSON, which every parser reads.

Python's ``json`` writes ``NaN`` and ``Infinity``, which strict parsers (browsers, ``jq``, Go) refuse; a diverged
metric is written as ``null`` instead.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float (nested in dicts and lists) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or numpy scalar
        return finite_or_none(value.item())
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """JSON that every parser accepts: non-finite floats become ``null`` (Python's default writes ``NaN``)."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)
