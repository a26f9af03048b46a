"""README.md's layout paragraph names only files and folders that exist.

The paragraph that begins ``Layout:`` once named ``cli.py``, ``config.py``, ``loop.py``, ``train_step.py``,
``resume.py`` and ``checkpoint.py`` long after issue 29's layout had replaced them. Every path-like name in
backticks there (one holding a ``/`` or ending in ``.py``) must exist: a name inside the parentheses that follow
``src/gputrain/`` under ``src/gputrain`` (``engine/trainer.py``, ``checkpoint/``), any other one from the
repository's root (``tests/unit/``, ``benchmarks/``). A failure names the missing one.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "gputrain"
OPENING = "`src/gputrain/` ("


def _layout_paragraph() -> str:
    paragraphs = re.split(r"\n\s*\n", (ROOT / "README.md").read_text())
    found = [p for p in paragraphs if p.lstrip().startswith("Layout:")]
    assert len(found) == 1, f"README.md should have one paragraph beginning 'Layout:', found {len(found)}"
    return found[0]


def _split(paragraph: str) -> tuple[str, str]:
    """The text inside the parentheses after `src/gputrain/`, and the rest of the paragraph."""
    start = paragraph.index(OPENING) + len(OPENING)
    depth = 1
    for end in range(start, len(paragraph)):
        depth += {"(": 1, ")": -1}.get(paragraph[end], 0)
        if depth == 0:
            return paragraph[start:end], paragraph[:start] + paragraph[end:]
    raise AssertionError("README.md's layout paragraph: the parenthesis after `src/gputrain/` is never closed")


def _paths(text: str) -> list[str]:
    return [name for name in re.findall(r"`([^`\s]+)`", text) if "/" in name or name.endswith(".py")]


def test_every_name_in_the_readme_layout_paragraph_exists():
    paragraph = _layout_paragraph()
    assert OPENING in paragraph, "README.md's layout paragraph should open its package list with `src/gputrain/` ("
    inside, outside = _split(paragraph)
    in_package, in_repository = _paths(inside), _paths(outside)
    assert len(in_package) >= 10, f"too few names under src/gputrain in README.md's layout paragraph: {in_package}"
    missing = [f"src/gputrain/{name}" for name in in_package if not (PACKAGE / name).exists()]
    missing += [name for name in in_repository if not (ROOT / name).exists()]
    assert not missing, f"README.md's layout paragraph names what does not exist: {', '.join(missing)}"
