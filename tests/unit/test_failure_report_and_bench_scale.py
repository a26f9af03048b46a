"""Pure pieces of a user's first hour: the launcher's report of failed ranks (the first failing rank, last, in one
line) and ``gputrain bench scale``'s table, threads per process and plot."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from gputrain.launcher.failures import report_failure
from gputrain.launcher.worker_errors import WorkerErrorHandler
from gputrain.tools.bench.scale import (
    ScaleRow,
    _error_line,
    add_speedup,
    markdown_table,
    plot,
    run_command,
    threads_per_process,
)

# -- launcher reports and bench scale ---------------------------------------------------------


def _failure(tmp_path: Path, monkeypatch, rank: int, err: BaseException, exitcode: int) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise err
    except BaseException as e:  # noqa: BLE001  (recorded as torch's record() does)
        WorkerErrorHandler((ValueError,)).record_exception(e)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_first_failing_rank_is_reported_last_in_one_line(tmp_path, monkeypatch, capsys):
    first = _failure(tmp_path, monkeypatch, 1, ValueError("image data/x.jpg is truncated; re-export it"), 2)
    later = _failure(tmp_path, monkeypatch, 0, RuntimeError("[gloo] Connection closed by peer"), 1)
    code = report_failure({0: later, 1: first})
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == ["gputrain: error: rank 1: image data/x.jpg is truncated; re-export it"]
    crash = _failure(tmp_path, monkeypatch, 0, RuntimeError("boom"), 1)
    assert report_failure({0: crash}) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == "gputrain: error: rank 0: RuntimeError: boom" and len(lines) <= 5


def test_bench_scale_cautions_where_efficiency_exceeds_one():
    rows = [ScaleRow(devices=1, batch_size=8, iters_per_epoch=4, train_time_s=1, startup_s=1, images_per_s=100),
            ScaleRow(devices=2, batch_size=8, iters_per_epoch=2, train_time_s=1, startup_s=1, images_per_s=250)]
    add_speedup(rows)
    assert rows[0].caution == "" and "above the 2 devices" in rows[1].caution
    table = markdown_table(rows)
    assert "| 2.50 (!) | 1.25 (!) |" in table and "efficiency above 1 is not possible" in table
    assert _error_line("noise\ngputrain: error: data.root=x does not exist\n") == "data.root=x does not exist"


def test_bench_scale_gives_every_row_the_same_threads_per_process_and_states_them(tmp_path):
    """Issue 15 item 10: unset OMP_NUM_THREADS gave 1 process all cores and N processes a share each."""
    assert threads_per_process([1, 2], cores=2, env={}) == 1  # the largest device count's share, for every row
    assert threads_per_process([1, 2, 4], cores=16, env={}) == 4
    assert threads_per_process([1, 2], cores=2, env={"OMP_NUM_THREADS": "3"}) == 3  # the user's choice is kept
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='x' must be a whole number"):
        threads_per_process([1], cores=2, env={"OMP_NUM_THREADS": "x"})
    threads = threads_per_process([1, 2], cores=8, env={})
    envs = [run_command("autoencoder", d, 8, epochs=2, out=tmp_path / str(d), accelerator="cpu", threads=threads,
                        overrides=["data.root=x"])[1] for d in (1, 2)]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["4", "4"]
    cmd, _ = run_command("autoencoder", 2, 8, epochs=2, out=tmp_path, accelerator="cpu", threads=4,
                         overrides=["data.root=x"])
    assert cmd[-1] == "data.root=x" and "--devices=2" in cmd  # the user's overrides come last and win
    rows = [ScaleRow(devices=1, batch_size=8, iters_per_epoch=4, train_time_s=1, startup_s=1, images_per_s=100,
                     threads=4),
            ScaleRow(devices=2, batch_size=8, iters_per_epoch=2, train_time_s=1, startup_s=1, images_per_s=250,
                     threads=4)]
    add_speedup(rows)
    table = markdown_table(rows).splitlines()
    assert table[0].startswith("| devices | threads per process |") and table[3].startswith("| 2 | 4 | 8 |")


def test_bench_scale_plot_marks_the_impossible_points_as_the_table_does(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [ScaleRow(devices=d, batch_size=b, iters_per_epoch=4, train_time_s=1, startup_s=1, images_per_s=ips,
                     threads=1) for d, b, ips in ((1, 8, 100), (2, 8, 250), (1, 16, 100), (2, 16, 150))]
    add_speedup(rows)
    assert plot(rows, tmp_path / "scale.png") == [(2, 8)]
    assert (tmp_path / "scale.png").stat().st_size > 1000
