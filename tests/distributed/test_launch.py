import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from multiproc import run_ranks


def _sum_ranks(info):
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    return info.rank, info.world_size, float(t)


def test_two_real_processes_see_each_other():
    results = run_ranks(_sum_ranks, fresh=True)  # gputrain's launcher
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]
    results = run_ranks(_sum_ranks)  # forked from the tests' server
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]


# -- the Python API's failures (issue 15 item 6): one exception, a few lines, the caller's handlers back ------

SCRIPT = '''
import os, signal, sys
import torch
import gputrain


def work():
    torch.set_num_threads(1)
    if os.environ["RANK"] == "1":
        raise ValueError("rank one refuses this model")
    return "ok"


def own_handler(signum, frame):
    print("own handler", signum, flush=True)
    sys.exit(7)


if __name__ == "__main__":
    restarts = int(sys.argv[2])
    if sys.argv[1] == "uncaught":
        gputrain.launch(work, devices=2, max_restarts=restarts)
    signal.signal(signal.SIGTERM, own_handler)
    try:
        gputrain.launch(work, devices=2, max_restarts=restarts)
    except Exception as err:
        print("caught", type(err).__name__, err, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
'''


def _script(tmp_path: Path, mode: str, restarts: int = 0) -> subprocess.CompletedProcess:
    script = tmp_path / "api_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GPUTRAIN_DEBUG", None)
    return subprocess.run([sys.executable, str(script), mode, str(restarts)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=240)


@pytest.mark.parametrize("restarts", [0, 1], ids=["direct", "elastic-agent"])
def test_a_failing_rank_under_launch_is_one_exception_and_the_callers_handler_comes_back(tmp_path, restarts):
    """Without restarts the ranks start directly; with them torchrun's elastic agent starts (and restarts) them, and
    its log lines and signal handlers must not reach the caller either."""
    done = _script(tmp_path, "caught", restarts)
    caught = [line for line in done.stdout.splitlines() if line.startswith("caught")]
    assert len(caught) == 1 and "rank 1: ValueError: rank one refuses this model" in caught[0], done.stdout
    assert caught[0].startswith("caught WorkerFailed")
    log = Path(re.search(r"full traceback in (\S+)\)", caught[0]).group(1))
    assert log.is_file() and "Traceback" in log.read_text() and "rank one refuses" in log.read_text()
    assert done.stderr.strip() == "", done.stderr  # nothing from the agent or the workers on the terminal
    # SIGTERM after launch returned reaches the caller's own handler, not elastic's SignalException.
    assert done.returncode == 7 and "own handler 15" in done.stdout, (done.returncode, done.stdout, done.stderr)


def test_an_uncaught_failure_under_launch_is_a_few_lines(tmp_path):
    done = _script(tmp_path, "uncaught")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) <= 12, done.stderr
    assert re.match(r"gputrain\.launcher\.worker_errors\.WorkerFailed: rank 1: ValueError: rank one refuses this model \(full "
                    r"traceback in .*failures\.log\)$", lines[-1]), lines[-1]


# -- the direct launcher's own failures ----------------------------------------------------------------------


def test_a_rank_that_cannot_start_leaves_none_of_the_others_running(monkeypatch):
    """Out of processes or files at the second rank's fork: the first rank (a real process) must not be left
    waiting for a peer that never comes."""
    from gputrain.launcher import direct as direct_launch

    started = []
    real_popen = subprocess.Popen

    def second_fails(*args, **kwargs):
        if started:
            raise OSError(24, "Too many open files")
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(direct_launch.subprocess, "Popen", second_fails)
    try:
        with pytest.raises(OSError, match="Too many open files"):
            direct_launch._Job(2, [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ))
        assert len(started) == 1 and started[0].poll() is not None, "the first rank was left running"
    finally:
        for proc in started:
            proc.kill()
            proc.wait()


ORPHAN_RANK = '''
import os, pathlib, time

pathlib.Path(os.environ["MARKER_DIR"], "rank" + os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(120)  # outside any collective, and not gputrain's command line: nothing but the kernel's signal ends it
'''


def test_ranks_end_when_their_launcher_is_killed_whatever_they_run(tmp_path):
    """SIGKILL to the direct launcher alone (it cannot forward that): each rank asked the kernel for SIGTERM when its
    launcher dies (PR_SET_PDEATHSIG) as it started, so none is orphaned, whatever it runs: ``gputrain.launch`` runs
    a caller's function, not gputrain's command line (whose ranks ask again as they start, issue 45)."""
    (tmp_path / "orphan_rank.py").write_text(ORPHAN_RANK)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)  # gputrain's copy too
    env = {**os.environ, "PYTHONPATH": path, "MARKER_DIR": str(tmp_path)}
    launcher = subprocess.Popen([sys.executable, "-c", "from gputrain.launcher.direct import run_direct\n"
                                 "run_direct(2, 'orphan_rank', [])"], env=env, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120  # a bound for a broken launch, not a speed check
        while len(pids) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks never started"
            pids = [int(p.read_text()) for p in tmp_path.glob("rank[01]") if p.read_text()]
            time.sleep(0.05)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in pids if _running(pid)], "ranks left running after their launcher was killed"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for init to reap it counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


FAKE_RANK = '''
import os, pathlib, signal, sys, time

folder = pathlib.Path(os.environ["MARKER_DIR"])
if os.environ["RANK"] == "1":
    while not (folder / "ready").exists():  # rank 0 can take a signal now
        time.sleep(0.01)
    sys.exit(1)  # fails, with no error file (as a rank the kernel killed for memory)


def leave(signum, frame):
    (folder / "rank0").write_text(signal.Signals(signum).name)
    sys.exit(143)  # what a gputrain rank stopped by SIGTERM exits with


signal.signal(signal.SIGTERM, leave)
(folder / "ready").touch()
time.sleep(15)  # busy outside any collective: only the launcher's SIGTERM ends it early (about 1 s)
'''


def test_when_a_rank_fails_the_launcher_stops_the_others_with_sigterm(tmp_path, monkeypatch, capsys):
    """Over gloo a peer usually dies of the lost connection anyway; a rank busy outside a collective (data loading,
    a long evaluation, a hook) does not, and must get SIGTERM (then SIGKILL) rather than run on alone. The rank
    that failed is the one reported, not the one that left, as asked, with 143."""
    from gputrain.errors import EXIT_FAILED
    from gputrain.launcher.direct import run_direct

    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MARKER_DIR", str(tmp_path))
    assert run_direct(2, "fake_rank", []) == EXIT_FAILED
    assert (tmp_path / "rank0").read_text() == "SIGTERM"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gputrain: error: rank 1 exited with code 1 without an error message")


LATE_CAUSE = '''
import os, pathlib, time

import gputrain.launcher.worker_errors as errors

folder = pathlib.Path(os.environ["MARKER_DIR"])


def consequence():
    raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")


def cause():
    failed_at = time.time()
    while not (folder / "rank1-left").exists():  # the peer saw the closed connection and left first
        time.sleep(0.01)
    # A loaded machine: the rank that failed is still on its way to writing its error. 3 s, well inside the
    # launcher's 10 s grace, and long enough that a launcher without the grace (its SIGTERM comes as soon as it
    # sees rank 1 leave) is caught even under load: at 1 s a loaded CI run (stop 51) let that fault survive.
    time.sleep(3.0)
    err = ValueError("image frames/0.jpg is truncated; re-export it")
    err.gputrain_time = failed_at
    raise err


if os.environ["RANK"] == "1":
    try:
        errors.worker_record(consequence, usage=(ValueError,))()
    finally:
        (folder / "rank1-left").touch()
errors.worker_record(cause, usage=(ValueError,))()
'''


def test_a_rank_that_only_lost_its_peer_and_left_first_does_not_hide_the_rank_that_failed(tmp_path, monkeypatch, capsys):
    """CI of stop 50: the rank that failed tears its process group down, its peer sees the closed connection and
    leaves before the failed rank has written its error; a SIGTERM to it then lost the line that explains the run."""
    from gputrain.errors import EXIT_USAGE
    from gputrain.launcher.direct import run_direct

    (tmp_path / "late_cause.py").write_text(LATE_CAUSE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MARKER_DIR", str(tmp_path))
    assert run_direct(2, "late_cause", []) == EXIT_USAGE
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gputrain: error: rank 0: image frames/0.jpg is truncated; re-export it")
