"""A hang is a failure: two ranks that wait for each other fail their test at its limit, with both ranks' stacks.

The test runs pytest on a small test file whose two gloo ranks deadlock (each waits to receive from the other), with
a limit of a few seconds, and checks what a developer would read: the failed test named, the limit, and each rank's
stack at the line it waited on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent

DEADLOCK = '''
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import pytest

from multiproc import _forkserver, run_ranks


def wait_for_the_other_rank(info):
    # Each rank waits to receive from the other before it sends: neither ever sends.
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1 - info.rank)
    dist.send(buffer, dst=1 - info.rank)


HELPER = chr(10).join(["import time", "def wait_in_a_helper_process():", "    time.sleep(600)",
                     "wait_in_a_helper_process()"])


@pytest.fixture
def fork_server_up():
    # The fork server imports torch as it starts (3 s here, twice that on a loaded machine): started before the
    # limit's clock runs (func_only), so the limit is the ranks' start and wait alone.
    context = _forkserver()
    warm = context.Process(target=os.getpid)
    warm.start()
    warm.join()


@pytest.mark.timeout({limit}, func_only=True)
def test_two_ranks_wait_for_each_other(tmp_path, fork_server_up):
    # A plain Python process the test started too: its stack comes from PYTHONFAULTHANDLER alone (torch's elastic
    # error handler enables faulthandler in the ranks by itself).
    helper = subprocess.Popen([sys.executable, "-c", HELPER], stderr=open(tmp_path / "helper.err", "w"))
    try:
        run_ranks(wait_for_the_other_rank, timeout_s=600)
    finally:
        helper.kill()
'''


# About 12 s: it waits for its inner test's limit (limit_s), which must leave the ranks time to start from the
# warm fork server and reach their receive (under a second here, a few on a loaded machine).
@pytest.mark.timeout(150)
def test_a_deadlock_between_two_ranks_fails_at_the_limit_with_both_stacks(tmp_path):
    limit_s = 6
    (tmp_path / "test_deadlock.py").write_text(textwrap.dedent(DEADLOCK.format(limit=limit_s)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}  # tests/hangs.py must set it
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "hangs", "-o", "timeout_method=signal",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_deadlock.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=limit_s + 40)
    seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert seconds < limit_s + 40, f"took {seconds:.0f} s for a limit of {limit_s} s"
    assert "FAILED" in output and "test_deadlock.py::test_two_ranks_wait_for_each_other" in output, output[-3000:]
    assert f"ran past its limit of {limit_s} s" in output, output[-3000:]
    # each rank's own stack, at the receive it waited in, and the plain helper process's
    assert output.count("in wait_for_the_other_rank") >= 2, output[-5000:]
    assert "in wait_in_a_helper_process" in output, output[-5000:]
