"""Plant each known fault in a copy of the repository and check that a fast test catches it.

``make mutants`` runs this. The faults are data, in ``tests/faults.py``, grouped by the module each one breaks.
For every fault it copies the tree ``make test`` ran on (git's tracked and untracked, not ignored, files) to a
temporary folder, applies the fault (exact text replacements in one file), runs the few fast tests chosen to
catch it against that copy, and prints a table: fault, the first test that failed, seconds. It exits 1 when a
fault survives (every chosen test passed), when a run times out, when the chosen tests fail without any fault
(the baseline: the tests ``make test``'s report does not show passing on this very tree are run without a
fault first; ``scripts/suite_report.py``), or when a fault's text no longer occurs exactly once in its file, so
the list cannot rot silently: after a refactor, update the pattern to plant the same fault in the new code.

Faults run in parallel, ``--jobs`` at a time (default: one per core). Each runs in a process forked from this one
after torch, torchvision and pytest are imported, so no fault pays for those imports again; gputrain itself is
never imported here, so each fault's process imports its own planted copy (the runner checks this), and the
ranks and commands its tests start are new processes that import the copy too. The table is in the list's order
whatever the order the faults finish in, so ``--jobs 1`` and ``--jobs 2`` print the same table.

    python scripts/mutants.py            # every fault
    python scripts/mutants.py -k resume  # faults whose name contains "resume"
    python scripts/mutants.py --list     # the faults and their tests, without running anything
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import suite_report  # scripts/, beside this file

ROOT = Path(__file__).resolve().parent.parent

# Imported once here, before any fork, so that no fault's process imports them again. None of them is gputrain's,
# and none starts a thread (forking a process that runs threads is unsafe; checked in warm_imports).
WARM = ("torch", "torchvision", "torchvision.models", "torchvision.transforms.v2", "torch.distributed",
        "torch.distributed.checkpoint", "torch.distributed.elastic.multiprocessing", "torch.nn.parallel",
        "numpy", "PIL.Image", "omegaconf", "yaml", "tqdm", "pytest", "xdist.plugin")


def load_faults():
    spec = importlib.util.spec_from_file_location("gputrain_faults", ROOT / "tests" / "faults.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module.FAULTS


def check_patterns(faults) -> list[str]:
    """One line per replacement whose text does not occur exactly once in its file (the list rotted)."""
    problems = []
    for fault in faults:
        path = ROOT / fault.file
        if not path.is_file():
            problems.append(f"{fault.name}: {fault.file} does not exist")
            continue
        text = path.read_text()
        for old, _ in fault.replacements:
            count = text.count(old)
            if count != 1:
                problems.append(f"{fault.name}: {old!r} occurs {count} times in {fault.file} (expected once); "
                                "update the pattern so it plants the same fault in the current code")
    return problems


def make_copy(parent: Path, files: list[str], fault=None) -> Path:
    """``files`` (the tree make test ran on, :func:`suite_report.tree_files`) copied to ``parent``, ``fault``
    planted."""
    for name in files:
        target = parent / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    if fault is not None:
        path = parent / fault.file
        text = path.read_text()
        for old, new in fault.replacements:
            text = text.replace(old, new, 1)
        path.write_text(text)
    return parent


def warm_imports() -> None:
    # Every fault's tests ran with one OpenMP thread before; set here, it also keeps OpenBLAS (numpy) from starting
    # its thread pool, so the process forks with one thread.
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in WARM:
        importlib.import_module(name)
    leaked = sorted(name for name in sys.modules if name.split(".")[0] == "gputrain")
    if leaked:  # a fault's process would run this checkout's code instead of its planted copy
        raise SystemExit(f"mutants: the runner imported {leaked[0]}; it must import no gputrain module")
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        raise SystemExit(f"mutants: {threads} threads run after the warm imports; forking them is unsafe")


class _FirstFailure:
    """A pytest plugin that keeps the first failed test of the run, with its one-line reason."""

    def __init__(self) -> None:
        self.node, self.why = "", ""

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed and not self.node:
            self.node = report.nodeid
            crash = getattr(report.longrepr, "reprcrash", None)
            text = (getattr(crash, "message", None) or str(report.longrepr)).strip().splitlines()
            self.why = text[0][:150] if text else ""

    def pytest_collectreport(self, report) -> None:
        if report.failed and not self.node:
            self.node, self.why = f"(collecting {report.nodeid})", str(report.longrepr).strip()[-150:]


def _run_in_child(copy: Path, tests: tuple[str, ...], folder: Path) -> None:
    """The forked process: pytest on ``tests`` against ``copy``; never returns."""
    code = 3
    try:
        os.setsid()  # its own process group: a timeout ends the ranks and commands it started too
        out = os.open(folder / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(copy)
        os.environ.update(PYTHONPATH=str(copy / "src"), COLUMNS="300", OMP_NUM_THREADS="1",
                          PYTHONDONTWRITEBYTECODE="1")
        sys.path.insert(0, str(copy / "src"))
        sys.dont_write_bytecode = True
        import pytest

        first = _FirstFailure()
        code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--tb=line", "-rfE",
                                "-W", "ignore::UserWarning", *tests], plugins=[first]))
        imported = sys.modules.get("gputrain")
        own = imported is None or str(copy) in str(getattr(imported, "__file__", ""))
        (folder / "result.json").write_text(json.dumps({"code": code, "node": first.node, "why": first.why,
                                                        "own_copy": own}))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclass
class Job:
    index: int
    name: str
    tests: tuple[str, ...]
    folder: Path
    timeout_s: float
    pid: int = 0
    start: float = 0.0
    outcome: str = ""
    node: str = ""
    seconds: float = 0.0

    def output(self) -> str:
        path = self.folder / "output.txt"
        return path.read_text(errors="replace") if path.exists() else ""


def _finish(job: Job, status: int | None) -> None:
    job.seconds = time.perf_counter() - job.start
    result_path = job.folder / "result.json"
    if status is None:
        job.outcome = "timeout"
    elif not result_path.exists():
        job.outcome = f"error (the process ended with status {status} before pytest finished)"
    else:
        result = json.loads(result_path.read_text())
        if not result["own_copy"]:
            job.outcome = "error (the tests imported gputrain from outside their copy)"
        elif result["code"] == 0:
            job.outcome = "passed"
        elif result["code"] in (1, 2) and result["node"]:  # 1: a test failed; 2: interrupted by -x after an error
            job.outcome, job.node = "failed", result["node"] + (f" - {result['why']}" if result["why"] else "")
        else:
            job.outcome = f"error (pytest exit {result['code']})"


def run_jobs(jobs: list[Job], make: dict[int, object], parallel: int, report) -> None:
    """Fork up to ``parallel`` jobs at a time, in the order given; ``make[index]`` makes a job's copy just before it
    starts."""
    waiting, running = list(jobs), {}
    while waiting or running:
        while waiting and len(running) < parallel:
            job = waiting.pop(0)
            copy = make[job.index]()
            job.start = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                _run_in_child(copy, job.tests, job.folder)
            job.pid, running[pid] = pid, job
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.1)
            now = time.perf_counter()
            for job in [j for j in running.values() if now - j.start > j.timeout_s]:
                _kill_group(job.pid)
                os.waitpid(job.pid, 0)
                running.pop(job.pid)
                _finish(job, None)
                report(job)
            continue
        if pid in running:
            job = running.pop(pid)
            _kill_group(pid)  # ranks or servers its tests left behind
            _finish(job, os.waitstatus_to_exitcode(status))
            report(job)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def short(node: str) -> str:
    return node.removeprefix("tests/").replace(".py::", "::")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="match", default="", help="only faults whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the faults and their tests, run nothing")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per fault before it counts as failed")
    parser.add_argument("--no-baseline", action="store_true", help="trust that the chosen tests pass without faults (no baseline)")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="faults run at once (default: one per core)")
    args = parser.parse_args(argv)
    faults = tuple(f for f in load_faults() if args.match.lower() in f.name.lower())
    if not faults:
        print(f"mutants: no fault name contains {args.match!r}", file=sys.stderr)
        return 2
    if args.list:
        for f in faults:
            print(f"{f.name}\n    {f.file}\n    " + "\n    ".join(short(t) for t in f.tests))
        return 0
    problems = check_patterns(faults)
    if problems:
        print("mutants: the fault list no longer matches the source:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    total = time.perf_counter()
    warm_imports()
    print(f"mutants: {len(faults)} faults, {args.jobs} at a time; imports warmed in {time.perf_counter() - total:.1f} s",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="gputrain-mutants-") as tmp:
        tmp_path = Path(tmp)
        files = suite_report.tree_files()
        tests = list(dict.fromkeys(t for f in faults for t in f.tests))
        # Every chosen test must pass without its fault: make test's report shows most (suite_report's docstring).
        todo, why = ([], "") if args.no_baseline else suite_report.unproven(tests, files)
        if len(todo) < len(tests):
            print(f"baseline: {len(tests) - len(todo)} of {len(tests)} test selections passed in make test on this "
                  f"tree ({suite_report.REPORT.name}){f'; {why}' if why else ''}", flush=True)
        if todo:
            base = Job(-1, "baseline", ("-n", str(args.jobs), *todo) if args.jobs > 1 else tuple(todo),
                       _folder(tmp_path, "baseline-run"), args.timeout * 4)
            run_jobs([base], {-1: lambda: make_copy(tmp_path / "baseline", files)}, 1, lambda job: None)
            print(f"baseline (no fault, {len(todo)} test selections{f'; {why}' if why else ''}): {base.outcome} in "
                  f"{base.seconds:.0f} s", flush=True)
            if base.outcome != "passed":
                print(base.output()[-3000:], file=sys.stderr)
                print(f"mutants: the chosen tests fail without any fault ({short(base.node) or base.outcome}); "
                      "fix that first", file=sys.stderr)
                return 1
            shutil.rmtree(tmp_path / "baseline", ignore_errors=True)
        jobs = [Job(i, f.name, f.tests, _folder(tmp_path, f"run{i:03d}"), args.timeout) for i, f in enumerate(faults)]
        makers = {i: (lambda f=f, i=i: make_copy(tmp_path / f"fault{i:03d}", files, f)) for i, f in enumerate(faults)}

        def report(job: Job) -> None:
            caught = job.outcome == "failed"
            print(f"{'caught ' if caught else 'SURVIVED'} {job.name}: {short(job.node) or job.outcome} "
                  f"({job.seconds:.0f} s)", flush=True)
            if not caught:
                print(job.output()[-2000:], file=sys.stderr)
            shutil.rmtree(tmp_path / f"fault{job.index:03d}", ignore_errors=True)

        # The longest first (by make test's report); the table below keeps the list's order.
        order = suite_report.longest_first([j.tests for j in jobs])
        run_jobs([jobs[i] for i in order], makers, max(1, args.jobs), report)
    survived = [j.name for j in jobs if j.outcome != "failed"]
    width = max(len(j.name) for j in jobs)
    cells = [short(j.node.split(" - ")[0]) if j.outcome == "failed" else j.outcome.upper() for j in jobs]
    test_width = max(len(c) for c in cells)
    print(f"\n{'fault':<{width}}  {'caught by (first failing test)':<{test_width}}  seconds")
    for job, cell in zip(jobs, cells, strict=True):
        print(f"{job.name:<{width}}  {cell:<{test_width}}  {job.seconds:7.1f}")
    print(f"\n{len(jobs) - len(survived)} of {len(jobs)} faults caught in {time.perf_counter() - total:.0f} s "
          f"({args.jobs} at a time)")
    if survived:
        print("survived: " + "; ".join(survived), file=sys.stderr)
        return 1
    return 0


def _folder(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    return folder


if __name__ == "__main__":
    sys.exit(main())
