"""``make mutants`` takes its baseline from ``make test``'s JUnit report only for the tests that report shows passing
on the tree as it is now (scripts/suite_report.py); everything else still runs without a fault first."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite_report():
    spec = importlib.util.spec_from_file_location("suite_report", ROOT / "scripts" / "suite_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = '''
import time

import pytest

def test_passes():
    pass

def test_slow():
    time.sleep(0.3)

def test_fails():
    assert False

def test_skips():
    pytest.skip("no GPU")

@pytest.mark.parametrize("n", [1, 2])
def test_each(n):
    pass

class TestGroup:
    def test_inside(self):
        pass
'''


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A small tree, its suite run by real pytest with --junitxml as the Makefile runs it."""
    root = tmp_path_factory.mktemp("tree")
    (root / "tests").mkdir()
    (root / "tests" / "test_cases.py").write_text(CASES)
    (root / "src.py").write_text("x = 1\n")
    old = time.time() - 60  # the files predate the run, as a fresh clone's do
    for path in (root / "tests" / "test_cases.py", root / "src.py"):
        os.utime(path, (old, old))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=report.xml",
                    "tests"], cwd=root, capture_output=True, check=False)
    assert (root / "report.xml").is_file()
    return root


def test_only_the_selections_make_test_showed_passing_are_spared(suite_report, tree):
    files = ["src.py", "tests/test_cases.py"]
    selections = ["tests/test_cases.py::test_passes", "tests/test_cases.py::test_each",
                  "tests/test_cases.py::test_each[1]", "tests/test_cases.py::test_each[3]",
                  "tests/test_cases.py::TestGroup::test_inside", "tests/test_cases.py::TestGroup",
                  "tests/test_cases.py::test_fails", "tests/test_cases.py::test_skips",
                  "tests/test_cases.py::test_new", "tests/test_cases.py"]
    todo, why = suite_report.unproven(selections, files, report=tree / "report.xml", root=tree)
    # A failed test, one that only skipped, one the report lacks, and a file that holds a failure still run.
    # A parametrised case is spared by its own passing, and runs where the report lacks it (test_each[3]).
    assert todo == ["tests/test_cases.py::test_each[3]", "tests/test_cases.py::test_fails",
                    "tests/test_cases.py::test_skips", "tests/test_cases.py::test_new", "tests/test_cases.py"], why
    assert why == "5 not shown passing by report.xml"


def test_make_mutants_starts_the_faults_whose_tests_took_longest_first(suite_report, tree):
    jobs = [("tests/test_cases.py::test_passes",), ("tests/test_cases.py::test_new",),
            ("tests/test_cases.py::test_fails", "tests/test_cases.py::test_slow"), ("tests/test_cases.py::test_each",)]
    # test_slow's 0.3 s first; a selection the report lacks counts 0 s and keeps its place among the quick.
    order = suite_report.longest_first(jobs, report=tree / "report.xml")
    assert order[0] == 2 and sorted(order) == [0, 1, 2, 3]
    assert suite_report.longest_first(jobs, report=tree / "absent.xml") == [0, 1, 2, 3]


def test_a_file_changed_after_the_suite_started_voids_the_report(suite_report, tree, tmp_path):
    copy = tmp_path / "tree"
    subprocess.run(["cp", "-a", str(tree), str(copy)], check=True)
    (copy / "src.py").write_text("x = 2\n")  # edited after make test: the report says nothing about this tree
    selections = ["tests/test_cases.py::test_passes"]
    todo, why = suite_report.unproven(selections, ["src.py", "tests/test_cases.py"], report=copy / "report.xml",
                                      root=copy)
    assert todo == selections and why == "src.py changed after make test started"
    todo, why = suite_report.unproven(selections, ["src.py"], report=copy / "absent.xml", root=copy)
    assert todo == selections and why == "no report of make test (absent.xml)"


def test_a_faults_copy_holds_the_whole_tree_make_test_ran_on(suite_report):
    """Not a hand-kept list of folders: a test that reads a file outside src/ and tests/ passes in the copy too."""
    files = suite_report.tree_files()
    for name in ("Makefile", "README.md", "CHANGELOG.md", "pyproject.toml", ".ci/run", "tests/faults.py",
                 "scripts/suite_report.py", "docs/testing.md"):
        assert name in files
    assert not any(f.startswith((".venv/", "runs/", "data/")) or "__pycache__" in f for f in files)
