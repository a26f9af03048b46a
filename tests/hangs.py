"""A test that runs past its time limit ends with the stacks of the processes it started.

pytest-timeout (configured in pyproject.toml) fails a test that runs too long and prints the test process's own
stack. A hang between ranks lives in other processes: the ranks of ``run_ranks`` or of a ``gputrain`` command. So
before pytest-timeout fails the test, every process the test started is sent SIGABRT; ``PYTHONFAULTHANDLER``,
which conftest.py sets for every process a test starts, makes each Python process write its threads' stacks to its
stderr as it ends. Ranks write their stderr to files (the launcher's logs), which are read back here and printed
on the test's stderr, so the failure report shows them under "Captured stderr call".
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

# Read by every Python process a test starts (ranks, commands): each writes its stacks on SIGABRT.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children (Linux's /proc children lists)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop(0)}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found.extend(children)
            todo.extend(children)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def stacks_of_descendants(wait_s: float = 5.0) -> str:
    """SIGABRT every process this one started and return the stacks they wrote to files, one block each."""
    pids = descendants(os.getpid())
    if not pids:
        return ""
    streams: dict[int, tuple[str, str, int]] = {}
    for pid in pids:
        try:
            path = os.readlink(f"/proc/{pid}/fd/2")
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if os.path.isfile(path):
            streams[pid] = (path, command.strip()[:200], os.path.getsize(path))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in streams):
        time.sleep(0.1)
    blocks = []
    for pid, (path, command, offset) in streams.items():
        with open(path, errors="replace") as f:
            f.seek(offset)
            written = f.read()[-6000:].strip()
        if written:
            blocks.append(f"--- process {pid}: {command}\n    (its stderr, {path})\n{written}")
    return "\n".join(blocks)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's signal timer, with the stacks of the test's processes printed before the failure."""
    import pytest_timeout

    if settings.method != "signal" or not hasattr(signal, "SIGALRM"):
        return None  # pytest-timeout's own timer

    def handler(signum, frame):
        __tracebackhide__ = True
        stacks = stacks_of_descendants()
        print(f"\n+++ {item.nodeid} ran past its limit of {settings.timeout:.0f} s; the stacks of the processes it "
              f"started:\n{stacks or '(it started none that write their stderr to a file)'}", file=sys.stderr)
        pytest_timeout.timeout_sigalrm(item, settings)

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
