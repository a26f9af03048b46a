"""What one rank of a diagnostic run did: its outcome, the records it streamed, and the lines that describe a failure."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RankOutcome:
    """What one rank did: its body's value, or how it failed and where it was."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    """One line: the exception, or the signal that killed the rank."""
    last_collective: str = ""
    """The collective this rank entered last (name, sequence number, sizes), where known."""
    where: str = ""
    """The innermost frame outside torch when it failed (file:line in function)."""
    log_tail: list[str] = field(default_factory=list)
    """The rank's last stderr lines that look like errors."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """What the body streamed with :func:`append_record`, kept even when the rank died."""
    logs: str = ""
    """Folder with the rank's full stdout/stderr (kept only when some rank failed)."""


RECORDS_DIR = "GPUTRAIN_RANKS_DIR"
_records_file: Any = None


def append_record(record: dict[str, Any]) -> None:
    """Stream one JSON record from this rank to the parent of :func:`run_on_ranks` (no-op elsewhere).

    Written and flushed at once, so the parent reads it even if the rank is killed a moment later.
    """
    open_records()
    if _records_file is None:
        return
    _records_file.write(json.dumps(record) + "\n")
    _records_file.flush()


def open_records() -> None:
    """Open this rank's record file now (before any write watching starts), if running under :func:`run_on_ranks`."""
    global _records_file
    folder = os.environ.get(RECORDS_DIR)
    if folder and _records_file is None:
        _records_file = open(Path(folder) / f"records{os.environ.get('RANK', '0')}.jsonl", "a")  # noqa: SIM115


def mode_result_path(folder: str, mode: str, rank: int) -> Path:
    """Where a rank keeps a diagnostic mode's result as the mode ends (read back if the rank is stopped later)."""
    return Path(folder) / f"{mode}.rank{rank}.pt"


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            break
    return out


def describe_failure(outcomes: list[RankOutcome]) -> list[str]:
    """One line per failed rank: the error, its last collective, and where it was."""
    lines = []
    for o in outcomes:
        if o.ok:
            continue
        parts = [f"rank {o.rank}: {o.error}"]
        if o.last_collective:
            parts.append(f"last collective {o.last_collective}")
        if o.where:
            parts.append(f"at {o.where}")
        lines.append("; ".join(parts))
        lines += [f"  rank {o.rank} stderr: {ln[:300]}" for ln in o.log_tail if ln[:200] not in o.error]
    return lines

