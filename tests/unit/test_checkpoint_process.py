"""The checkpoint writer process (``trainer.checkpoint_process``): the same files, the same safety, off the GIL.

* A save the process writes loads to the state the thread writes (tied, strided, empty, bf16 and bool tensors,
  Python's random state), and the process did write it; a state of another layout gets new shared memory.
* The process dies with the training process: SIGKILL the trainer while the process is inside a write and the
  process is gone; the previous checkpoint stays the newest whole one.
* The process killed (idle, or inside a write), the save is written by the thread instead, with one warning line,
  and so are the later ones.
* It ignores Ctrl-C and SIGTERM (they reach every process of a terminal's group): the save in flight is finished.
* A write that fails there fails the next save with the thread's one line; a NaN snapshot is skipped with the
  thread's warning; a state the shared memory cannot hold (a sparse tensor) is written whole by the thread.
* ``fit`` on a CPU uses it by default and leaves no process behind, also when it returns early; with
  ``trainer.checkpoint_process=false`` none starts.

Real processes throughout; the FIFO of ``GPUTRAIN_TEST_PAUSE_SAVE`` holds a write at a known point, no sleeps.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from checkpoint_helpers import HeldSave, assert_same_state
from gputrain import Trainer, fast_path
from gputrain.checkpoint import CheckpointStore, load_checkpoint, remove_stale_temporaries, verify
from gputrain.checkpoint_io import PAUSE_ENV
from gputrain.checkpoint_writer import CheckpointWriteError, CheckpointWriter
from gputrain.hooks.base import Hook

_FORK = mp.get_context("fork")


def _writer(folder: Path, **store: Any) -> CheckpointWriter:
    writer = CheckpointWriter(CheckpointStore(folder, **store), process=True)
    writer.start()
    assert writer.process_ready(timeout=120), "the writer process did not start"
    return writer


def _state(step: int) -> dict[str, Any]:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) + step
    return {
        "model": {"w": w, "tied": w, "every_other": w[:, ::2], "transposed": w.t(), "empty": torch.empty(0, 3),
                  "half": torch.full((5,), 0.5 + step, dtype=torch.bfloat16), "flag": torch.tensor(step % 2 == 0),
                  "image": torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(step)).contiguous(
                      memory_format=torch.channels_last)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.full((3, 4), float(step))}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "rng": {"0": {"torch": torch.get_rng_state(), "python": random.getstate()}},
        "state": {"global_step": step, "epoch": 0},
    }


def _writer_processes() -> list[int]:
    """Live (not zombie) writer processes whose parent is this process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if b"gputrain.checkpoint_process" in cmdline and int(ppid) == os.getpid() and state != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_the_process_writes_what_the_thread_writes(tmp_path):
    """Planted faults: the process never used (the thread writes every save); tensors rebuilt at the wrong place."""
    by_process = _writer(tmp_path / "process")
    by_thread = CheckpointWriter(CheckpointStore(tmp_path / "thread"))
    state = _state(3)
    for writer in (by_process, by_thread):
        writer.save(state, name="step_000003", metrics={"train/loss": 0.5}, check_finite=True)
        writer.wait()
    assert by_process.process_writes == 1 and by_thread.process_writes == 0
    written = load_checkpoint(tmp_path / "process" / "step_000003.pt")
    assert_same_state(written, load_checkpoint(tmp_path / "thread" / "step_000003.pt"), strides=True)
    assert_same_state(written, state)
    model = written["model"]
    assert model["tied"].untyped_storage().data_ptr() == model["w"].untyped_storage().data_ptr()  # still one tensor
    assert model["every_other"].untyped_storage().data_ptr() != model["w"].untyped_storage().data_ptr()
    verify(tmp_path / "process" / "last.pt")
    by_process.close()
    assert _writer_processes() == []


def test_a_state_of_another_layout_gets_new_shared_memory(tmp_path):
    writer = _writer(tmp_path)
    writer.save({"model": {"w": torch.ones(1000)}, "state": {"global_step": 1}}, name="step_000001")
    writer.wait()
    first = writer._memory
    writer.save({"model": {"w": torch.full((3000,), 2.0), "b": torch.zeros(7)}, "state": {"global_step": 2}},
                name="step_000002")
    writer.wait()
    assert writer._memory is not first and writer.process_writes == 2
    writer.save({"model": {"w": torch.full((3000,), 3.0), "b": torch.ones(7)}, "state": {"global_step": 3}},
                name="step_000003")
    writer.wait()
    assert writer.process_writes == 3
    assert torch.equal(load_checkpoint(tmp_path / "step_000001.pt")["model"]["w"], torch.ones(1000))
    assert torch.equal(load_checkpoint(tmp_path / "step_000002.pt")["model"]["w"], torch.full((3000,), 2.0))
    assert torch.equal(load_checkpoint(tmp_path / "step_000003.pt")["model"]["b"], torch.ones(7))
    writer.close()


def test_two_saves_of_one_layout_reuse_the_shared_memory_views_included(tmp_path):
    """Views of bigger tensors (every other column, a transpose) get contiguous buffers; those must be reused too.
    Planted fault: buffers allocated anew at each save."""
    writer = _writer(tmp_path)
    writer.save(_state(1), name="step_000001")
    writer.wait()
    memory, buffers = writer._memory, writer._buffers
    writer.save(_state(2), name="step_000002")
    writer.wait()
    assert writer._memory is memory and all(a is b for a, b in zip(writer._buffers, buffers, strict=True))
    assert_same_state(load_checkpoint(tmp_path / "step_000002.pt"), _state(2))
    writer.close()


def _explode() -> None:
    raise RuntimeError("this object does not unpickle in the writer process")


class _Unpicklable:
    def __reduce__(self) -> tuple[Any, ...]:
        return _explode, ()


def test_a_request_the_process_cannot_read_is_refused_and_the_process_stays(tmp_path):
    """The thread writes such a save itself (:class:`WriterProcessRefused`); the next save goes to the process."""
    from gputrain.checkpoint_process import SharedHostMemory, WriterProcess, WriterProcessRefused

    process = WriterProcess()
    try:
        assert process.ready(timeout=120)
        memory = SharedHostMemory([torch.ones(3)])
        memory.buffers[0].copy_(torch.arange(3.0))
        with pytest.raises(WriterProcessRefused, match="does not unpickle in the writer process"):
            process.write({"w": memory.buffers[0], "odd": _Unpicklable()}, memory, folder=tmp_path, name="a.pt",
                          reuse=None, check_finite=False)
        tmp, size, _ = process.write({"w": memory.buffers[0]}, memory, folder=tmp_path, name="b.pt", reuse=None,
                                     check_finite=False)
        assert size == tmp.stat().st_size and torch.equal(torch.load(tmp, weights_only=True)["w"], torch.arange(3.0))
    finally:
        process.close()


def test_a_writer_process_that_fails_to_start_says_why_in_the_warning(tmp_path, monkeypatch, capsys):
    from gputrain import checkpoint_process

    monkeypatch.setattr(checkpoint_process, "_BOOTSTRAP",
                        "import sys; sys.stderr.write('ImportError: no torch here\\n'); sys.exit(3)")
    writer = CheckpointWriter(CheckpointStore(tmp_path), process=True)
    writer.start()
    assert not writer.process_ready(timeout=60)
    writer.save(_state(1), name="step_000001")
    writer.wait()
    assert writer.process_writes == 0 and writer._process is None
    assert_same_state(load_checkpoint(tmp_path / "step_000001.pt"), _state(1))
    warning = capsys.readouterr().err
    assert "(exit code 3;" in warning and "it said: ImportError: no torch here" in warning
    assert "trainer.checkpoint_process=false" in warning


def _save_in_process_then_hold(folder: Path, fifo: Path, conn: Connection) -> None:
    """Child: a trainer whose writer process pauses inside the write of step 3; then it keeps 'training'."""
    store = CheckpointStore(folder, keep_last=2)
    writer = CheckpointWriter(store, process=True)
    writer.start()
    assert writer.process_ready(timeout=120)
    os.environ[PAUSE_ENV] = str(fifo)
    writer.save(_state(3), name="step_000003")
    conn.send(writer._process.pid)
    conn.recv()  # until the parent kills us


def test_the_writer_process_dies_with_the_training_process(tmp_path):
    """Planted fault: no PR_SET_PDEATHSIG (the process would go on writing, and live on, after a SIGKILL)."""
    folder = tmp_path / "checkpoints"
    store = CheckpointStore(folder, keep_last=2)
    store.save(_state(1), name="step_000001")
    store.save(_state(2), name="step_000002")
    fifo = tmp_path / "hold.fifo"
    os.mkfifo(fifo)
    receive, send = _FORK.Pipe()
    child = _FORK.Process(target=_save_in_process_then_hold, args=(folder, fifo, send))
    child.start()
    try:
        assert receive.poll(180), "the child's save did not return"
        writer_pid = receive.recv()
        end = os.open(fifo, os.O_WRONLY)  # blocks until the writer process is inside the write
        partial = [p for p in folder.iterdir() if p.name.startswith(".step_000003.pt.")]
        assert len(partial) == 1
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        deadline = time.monotonic() + 30
        while _alive(writer_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        alive = _alive(writer_pid)
        os.close(end)
        if alive:
            os.kill(writer_pid, signal.SIGKILL)
        assert not alive, "the writer process outlived the training process"
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    latest = CheckpointStore(folder, keep_last=2).latest_valid()
    assert latest == folder / "step_000002.pt" and load_checkpoint(folder / "last.pt")["state"]["global_step"] == 2
    assert not (folder / "step_000003.pt").exists()
    assert remove_stale_temporaries(folder) == partial


def test_a_writer_process_killed_while_idle_leaves_the_saves_to_the_thread(tmp_path, capsys):
    """Planted fault: a lost process fails the save instead of falling back to the thread."""
    writer = _writer(tmp_path)
    writer.save(_state(1), name="step_000001")
    writer.wait()
    os.kill(writer._process.pid, signal.SIGKILL)
    for step in (2, 3):
        writer.save(_state(step), name=f"step_{step:06d}")
        writer.wait()
    assert writer.process_writes == 1 and writer._process is None
    assert_same_state(load_checkpoint(tmp_path / "step_000003.pt"), _state(3))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "writer process" in line]
    assert len(warnings) == 1 and "killed by SIGKILL" in warnings[0] and "written by a thread" in warnings[0]
    assert _writer_processes() == []


def test_a_writer_process_killed_inside_a_write_leaves_that_save_to_the_thread(tmp_path, monkeypatch, capsys):
    held = HeldSave(tmp_path, monkeypatch)
    writer = _writer(tmp_path / "checkpoints")
    writer.save(_state(1), name="step_000001")
    held.reached()  # the process is inside the write
    pid = writer._process.pid
    os.kill(pid, signal.SIGKILL)
    while _alive(pid):  # dead before its end of the FIFO is let go, so the thread's write pauses on it next
        time.sleep(0.01)
    held.release()
    held.reached()  # the thread writes the same save, and pauses at the same place
    held.release()
    writer.wait()
    assert writer.process_writes == 0
    assert_same_state(load_checkpoint(tmp_path / "checkpoints" / "step_000001.pt"), _state(1))
    assert "killed by SIGKILL" in capsys.readouterr().err
    # The killed write's part is a hidden temporary, which the next run's start removes.
    assert [p.name.split(".")[1] for p in remove_stale_temporaries(tmp_path / "checkpoints")] == ["step_000001"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_writer_process_finishes_its_save_through_a_stop_signal(tmp_path, monkeypatch, signum):
    """Ctrl-C reaches every process of the terminal's group. Planted fault: the process does not ignore it."""
    held = HeldSave(tmp_path, monkeypatch)
    writer = _writer(tmp_path / "checkpoints")
    writer.save(_state(1), name="step_000001")
    held.reached()
    os.kill(writer._process.pid, signum)
    held.release()
    writer.wait()
    assert writer.process_writes == 1 and writer.process_ready()
    assert_same_state(load_checkpoint(tmp_path / "checkpoints" / "step_000001.pt"), _state(1))
    writer.close()


def test_a_write_that_fails_in_the_process_fails_the_next_save_in_the_threads_line(tmp_path, monkeypatch):
    held = HeldSave(tmp_path, monkeypatch)
    writer = _writer(tmp_path / "checkpoints")
    writer.save(_state(1), name="step_000001")
    held.reached()
    shutil.rmtree(tmp_path / "checkpoints")  # the folder vanishes under the write
    held.release()
    monkeypatch.delenv(PAUSE_ENV)
    with pytest.raises(CheckpointWriteError) as caught:
        writer.save(_state(2), name="step_000002")
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        f"checkpoint {tmp_path / 'checkpoints' / 'step_000001.pt'} was not written (FileNotFoundError")
    assert writer.process_ready()  # the process itself is fine and takes the next save
    (tmp_path / "checkpoints").mkdir()
    writer.save(_state(2), name="step_000002")
    writer.wait()
    assert writer.process_writes == 1 and load_checkpoint(tmp_path / "checkpoints" / "step_000002.pt")
    writer.close()


def test_a_non_finite_snapshot_is_skipped_by_the_process_with_the_threads_warning(tmp_path, capsys):
    """Planted faults: the process does not check what it writes; the retired file the refused save was to overwrite
    is dropped from the store's spares (each later save then writes a new file)."""
    writer = _writer(tmp_path, keep_last=2, recycle=True)
    for step in range(1, 5):
        writer.save(_state(step), name=f"step_{step:06d}", check_finite=True)
        writer.wait()
    spares = list(writer.store._spares)
    assert spares and writer.process_writes == 4
    state = _state(5)
    state["optimizer"]["state"][0]["exp_avg"][1, 2] = float("nan")
    writer.save(state, name="step_000005", check_finite=True)
    writer.wait()
    assert not (tmp_path / "step_000005.pt").exists() and writer.process_writes == 4
    assert "was not written: its weights or optimizer state hold NaN/inf" in capsys.readouterr().err
    assert sorted(writer.store._spares) == sorted(spares) and all(p.exists() for p in spares)
    writer.save(_state(6), name="step_000006", check_finite=True)
    writer.wait()
    assert writer.process_writes == 5 and load_checkpoint(tmp_path / "step_000006.pt")["state"]["global_step"] == 6
    writer.close()


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")  # torch.load's, for weights_only
def test_a_state_the_shared_memory_cannot_hold_is_written_by_the_thread(tmp_path):
    writer = _writer(tmp_path)
    sparse = torch.sparse_coo_tensor([[0, 1], [1, 0]], [1.0, 2.0], (2, 2), check_invariants=True)
    writer.save({"model": {"w": torch.ones(3), "adjacency": sparse}, "state": {"global_step": 1}}, name="step_000001")
    writer.wait()
    assert writer.process_writes == 0
    loaded = load_checkpoint(tmp_path / "step_000001.pt")["model"]
    assert torch.equal(loaded["adjacency"].to_dense(), sparse.to_dense()) and torch.equal(loaded["w"], torch.ones(3))
    writer.close()


class _SeeTheWriter(Hook):
    def __init__(self) -> None:
        self.pids: list[int | None] = []

    def after_epoch(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        process = trainer.checkpoint_writer._process
        self.pids.append(None if process is None else process.pid)


@pytest.fixture(autouse=True)
def _process_pays_after_16_saves(monkeypatch):
    """The threshold is a tuning figure (128 on the test machine); 16 saves keep the fits below short."""
    monkeypatch.setattr(fast_path, "WRITER_PROCESS_MIN_SAVES", 16)


def _fit(out: Path, samples: int = 64, **trainer: Any) -> tuple[Trainer, _SeeTheWriter]:
    """8 steps a save each, 2 epochs: 16 saves planned, as many as make the writer process pay."""
    torch.manual_seed(0)
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
    seen = _SeeTheWriter()
    t = Trainer(strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=8, epochs=2,
                out=str(out), checkpoint_every_n_steps=1, hooks=[seen], **trainer)
    t.fit(nn.Linear(4, 1), TensorDataset(x, x.sum(1, keepdim=True)), loss=F.mse_loss)
    return t, seen


@pytest.mark.parametrize(("samples", "setting"), [(64, "auto"), (56, True)])
def test_fit_on_a_cpu_starts_the_writer_process_and_leaves_none_behind(tmp_path, samples, setting):
    """auto for a run of enough saves; true for any run. Planted fault: fit does not close the writer (its process
    lives on after the run)."""
    t, seen = _fit(tmp_path / "run", samples, checkpoint_process=setting)
    assert t.cfg.trainer.checkpoint_process is True and t.fast.describe().endswith("+checkpoint_process")
    assert len(seen.pids) == 2 and seen.pids[0] is not None  # started with the run, on rank 0
    assert _writer_processes() == [] and not _alive(seen.pids[0])
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["state"]["global_step"] == samples // 4
    # A resumed run that has nothing left to train returns early: the process it started leaves all the same.
    again = Trainer(strategy="single", accelerator="cpu", progress_bar=False, loggers=[], batch_size=8, epochs=2,
                    out=str(tmp_path / "run"), resume="auto")
    x = torch.randn(64, 4)
    again.fit(nn.Linear(4, 1), TensorDataset(x, x.sum(1, keepdim=True)), loss=F.mse_loss)
    assert _writer_processes() == []


@pytest.mark.parametrize(("samples", "setting"), [(64, False), (64, None), (56, "auto")])
def test_no_process_starts_when_turned_off_or_for_a_run_of_few_saves(tmp_path, samples, setting):
    """Off by default (None: not set). Planted fault: with auto, a run planned to write 14 checkpoints (fewer than
    WRITER_PROCESS_MIN_SAVES) starts one too."""
    t, seen = _fit(tmp_path / "run", samples, **({} if setting is None else {"checkpoint_process": setting}))
    assert t.cfg.trainer.checkpoint_process is False and seen.pids == [None, None]
    assert "checkpoint_process" not in t.fast.describe()
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["state"]["global_step"] == samples // 4
