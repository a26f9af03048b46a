"""Every planted fault of tests/faults.py still finds its code: each pattern occurs exactly once in its file, and
each test it names exists. ``make mutants`` checks the same before it plants anything, but only after ``make test``;
here a stale pattern fails in the suite, seconds in, where the change that made it stale is made."""

from __future__ import annotations

import re
from pathlib import Path

from faults import FAULTS

ROOT = Path(__file__).resolve().parents[2]


def test_each_fault_pattern_occurs_once_in_its_file_and_its_tests_exist():
    stale = []
    for fault in FAULTS:
        text = (ROOT / fault.file).read_text()
        stale += [f"{fault.name}: {old[:60]!r} occurs {text.count(old)} times in {fault.file}"
                  for old, _ in fault.replacements if text.count(old) != 1]
        for test in fault.tests:
            path, _, name = test.partition("::")
            source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
            function = name.split("[")[0]
            if not source or (function and not re.search(rf"^def {re.escape(function)}\(", source, re.M)):
                stale.append(f"{fault.name}: its test {test} does not exist")
    assert not stale, "\n".join(stale)
