"""What ``make test`` already proved, for ``make mutants``: its JUnit report, and the files it ran on.

``make mutants`` must know that every test it chose for a fault passes without the fault, or a test that fails
anyway would count as catching it (the baseline). ``make test`` has just run every one of those tests on the same
files, so the runner reads its report (``.test-results.xml``, written by the Makefile) instead of running them all
again, which cost 350 s of CI's 30 minutes. The report counts only when no file of the tree changed after the
suite started; a selection it does not show passing (new, skipped, failed, or no report at all) still runs as the
baseline. Each fault's copy holds the whole tree (git's tracked and untracked, not ignored, files), so it differs
from what ``make test`` ran only in its path.
"""

from __future__ import annotations

import datetime
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / ".test-results.xml"
"""``make test``'s JUnit report (pytest --junitxml in the Makefile; ignored by git)."""

WITHOUT_GIT = ("src", "tests", "scripts", "docs", "pyproject.toml", "README.md")
"""What a copy holds where git cannot list the tree (an unpacked archive)."""


def tree_files(root: Path = ROOT) -> list[str]:
    """The tree ``make test`` runs on, relative to ``root``: git's tracked and untracked files, not the ignored."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                                capture_output=True).stdout.decode()
        return sorted(p for p in listed.split("\0") if p and (root / p).is_file())
    except (OSError, subprocess.CalledProcessError):
        found = []
        for name in WITHOUT_GIT:
            path = root / name
            paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            found += [str(p.relative_to(root)) for p in paths if "__pycache__" not in p.parts]
        return sorted(found)


def _matches(selection: str, classname: str, name: str) -> bool:
    """Whether a JUnit test case (``classname``, ``name``) is one of ``selection``'s (a file or a pytest node id)."""
    path, *inside = selection.split("::")
    module = path.removesuffix(".py").replace("/", ".")
    # A parametrised case (test_x[a-b]) belongs to a selection of its test or of the case itself.
    named = inside[-1] in (name, name.split("[")[0]) if inside else False
    if not inside:
        return classname == module or classname.startswith(module + ".")
    if len(inside) == 1:
        return (classname == module and named) or classname == f"{module}.{inside[0]}"
    return classname == f"{module}.{inside[0]}" and named


def _cases(report: Path) -> tuple[list[tuple[str, str, set[str], float]], float]:
    """The report's test cases (class name, name, what they held, seconds) and when the suite started."""
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")  # type: ignore[assignment]
    started = datetime.datetime.fromisoformat(suite.get("timestamp", "")).timestamp()
    return [(c.get("classname", ""), c.get("name", ""), {child.tag for child in c}, float(c.get("time") or 0))
            for c in suite.iter("testcase")], started


def longest_first(jobs: list[tuple[str, ...]], report: Path = REPORT) -> list[int]:
    """The indexes of ``jobs`` (each a fault's test selections), the longest first by the seconds their tests took
    in the report (setup included; none shown: 0, in the list's order). ``make mutants`` starts them in this order:
    a long fault started last would run alone while the other cores idle."""
    try:
        cases, _ = _cases(report)
    except (OSError, ET.ParseError, AttributeError, ValueError):
        cases = []
    took = [sum(t for s in job for classname, name, _, t in cases if _matches(s, classname, name)) for job in jobs]
    return sorted(range(len(jobs)), key=lambda i: took[i], reverse=True)


def unproven(selections: list[str], files: list[str], report: Path = REPORT, root: Path = ROOT
             ) -> tuple[list[str], str]:
    """The selections the report does not show passing on today's tree, and why (a line; '' when all are shown)."""
    if not report.is_file():
        return list(selections), f"no report of make test ({report.name})"
    try:
        cases, started = _cases(report)
    except (ET.ParseError, AttributeError, ValueError) as err:
        return list(selections), f"{report.name} cannot be read ({err})"
    changed = [f for f in files if (root / f).stat().st_mtime > started]
    if changed:
        return list(selections), f"{changed[0]} changed after make test started"
    # A case is passed, skipped (it skips in a fault's copy too: no verdict either way) or failed.
    missing = []
    for selection in selections:
        tags = [t for classname, name, t, _ in cases if _matches(selection, classname, name)]
        if not any(not t & {"failure", "error", "skipped"} for t in tags) or any(t & {"failure", "error"} for t in tags):
            missing.append(selection)
    why = f"{len(missing)} not shown passing by {report.name}" if missing else ""
    return missing, why
