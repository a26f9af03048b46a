"""No Python file of the project is over 300 lines (issue 39 item 5, docs/architecture.md).

A file past 300 lines owns more than one thing: split it where the things it owns part (a config section into a
file of its own, a helper its tests share into tests/*_runs.py). Two files are long by design: the fault table,
which is data (one entry per planted fault), and the runner of ``make mutants`` that reads it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("src", "tests", "scripts", "benchmarks")
LONG_BY_DESIGN = {"tests/faults.py", "scripts/mutants.py"}
MOST_LINES = 300


def test_no_python_file_is_over_300_lines_but_the_fault_table_and_its_runner():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
               for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")}
    assert len(lengths) > 150 and set(LONG_BY_DESIGN) <= set(lengths)  # the walk found the project's files
    over = sorted(f"{name} ({lines} lines)" for name, lines in lengths.items()
                  if lines > MOST_LINES and name not in LONG_BY_DESIGN)
    assert not over, f"over {MOST_LINES} lines: {', '.join(over)}; split each where what it owns parts"
