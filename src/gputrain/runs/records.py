"""What a run writes besides checkpoints: strict JSON, which every parser reads.

Python's ``json`` writes ``NaN`` and ``Infinity``, which strict parsers (browsers, ``jq``, Go) refuse; a diverged
metric is written as ``null`` instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
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


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` ([] when there is none); a line cut short by a crash (the last) is skipped."""
    records = []
    if Path(path).is_file():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One record at the end of a ``metrics.jsonl`` (an event beside what the loggers write)."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def last_event(path: Path, event: str) -> dict[str, Any] | None:
    """The last record of ``event`` (say ``"pace"``) in a ``metrics.jsonl``, without its event name; None if none."""
    found = [r for r in read_metrics(path) if r.get("event") == event]
    return {k: v for k, v in found[-1].items() if k != "event"} if found else None
