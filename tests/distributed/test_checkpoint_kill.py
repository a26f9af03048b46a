"""SIGKILL a process while it saves a checkpoint: the previous one stays loadable, no final name holds a part.

Two ways of choosing the instant, both with real processes (forked, so torch is not imported again):
every call that touches the disk during a save (``os.open``, ``fsync``, ``link``, ``replace``,
``unlink``: the child kills itself just before the k-th one), and wall-clock delays spread over a
save of a few MB, which also land inside ``torch.save``'s writes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from checkpoint_helpers import HeldSave
from gputrain.checkpoint import CheckpointStore, load_checkpoint, remove_stale_temporaries, verify

_DISK_CALLS = (os.open, os.fsync, os.link, os.replace, os.unlink)
_FORK = mp.get_context("fork")


def _state(step: int, numel: int = 1000) -> dict:
    return {"model": {"w": torch.full((numel,), float(step))}, "state": {"global_step": step, "epoch": step}}


def _save_and_die_at(folder: Path, kill_at: int, conn: Connection) -> None:
    """Child: save step 3, sending itself SIGKILL just before the ``kill_at``-th disk call (0: never)."""
    store = CheckpointStore(folder, keep_last=2, monitor="val/loss")
    calls = 0

    def trap(frame, event, arg):  # noqa: ANN001
        nonlocal calls
        if event == "c_call" and any(arg is f for f in _DISK_CALLS):
            calls += 1
            if calls == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.setprofile(trap)
    store.save(_state(3), name="step_000003", metrics={"val/loss": 0.5})
    sys.setprofile(None)
    conn.send(calls)


def _run_child(target, *args) -> tuple[int | None, list]:  # noqa: ANN001
    receive, send = _FORK.Pipe(duplex=False)
    child = _FORK.Process(target=target, args=(*args, send))
    child.start()
    send.close()
    child.join(60)
    if child.is_alive():  # a hung save must fail the test, not the suite
        child.kill()
        child.join()
    messages = []
    while receive.poll():
        try:
            messages.append(receive.recv())
        except EOFError:
            break
    return child.exitcode, messages


def _assert_nothing_lies(folder: Path) -> Path:
    """Strict-JSON manifest listing only present files, every final name whole, a latest valid one, nothing skipped."""
    manifest = json.loads((folder / "manifest.json").read_text(), parse_constant=lambda token: 1 / 0)
    listed = set(manifest["files"]) - set(manifest["retire"])  # pending names may not be renamed yet
    assert all((folder / name).is_file() for name in listed), f"manifest.json lists absent files: {manifest}"
    for path in folder.glob("*.pt"):
        verify(path)  # raises on a partial or damaged file under a final name
        load_checkpoint(path)
    store = CheckpointStore(folder, keep_last=2)
    latest = store.latest_valid()
    assert latest is not None and store.skipped == []
    return latest


def test_kill_before_every_disk_call_of_a_save(tmp_path):
    template = tmp_path / "template"
    store = CheckpointStore(template, keep_last=2, monitor="val/loss")
    store.save(_state(1), name="step_000001", metrics={"val/loss": 2.0})
    store.save(_state(2), name="step_000002", metrics={"val/loss": 1.0})

    exitcode, messages = _run_child(_save_and_die_at, shutil.copytree(template, tmp_path / "count"), 0)
    assert exitcode == 0
    calls = messages[0]
    assert calls >= 15  # temporaries, links, manifest twice, renames, folder syncs, the retired file

    outcomes = set()
    for kill_at in range(1, calls + 1):
        folder = shutil.copytree(template, tmp_path / f"kill_{kill_at:02d}")
        exitcode, _ = _run_child(_save_and_die_at, folder, kill_at)
        assert exitcode == -signal.SIGKILL, f"the child was not killed at disk call {kill_at}"
        latest = _assert_nothing_lies(folder)
        step = load_checkpoint(latest)["state"]["global_step"]
        assert step in (2, 3)
        assert load_checkpoint(folder / "step_000002.pt")["state"]["global_step"] == 2  # the previous one
        outcomes.add((step, load_checkpoint(folder / "last.pt")["state"]["global_step"]))

        # The next run: clean up, save again, and find everything settled.
        remove_stale_temporaries(folder)
        CheckpointStore(folder, keep_last=2, monitor="val/loss").save(_state(4), name="step_000004",
                                                                      metrics={"val/loss": 3.0})
        assert _assert_nothing_lies(folder) == folder / "step_000004.pt"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert (manifest["pending"], manifest["retire"]) == ({}, [])
        on_disk = sorted(p.name for p in folder.iterdir())
        assert on_disk == sorted([*manifest["files"], "manifest.json"])  # no temporaries, no unlisted leftovers
        assert len([n for n in on_disk if n.startswith("step_")]) == 2
        assert load_checkpoint(folder / "best.pt")["state"]["global_step"] in (2, 3)
    # The kill points span the save: before the renames (step 2 is newest) and after (step 3 is).
    assert {step for step, _ in outcomes} == {2, 3}
    assert (3, 2) in outcomes  # killed between renaming step_000003.pt and last.pt


def _save_in_a_loop(folder: Path, conn: Connection) -> None:
    """Child: resume from the newest valid checkpoint and save a 4 MB state again and again, reporting each."""
    store = CheckpointStore(folder, keep_last=2)
    latest = store.latest_valid()
    step = load_checkpoint(latest)["state"]["global_step"] if latest else 0
    while True:
        step += 1
        start = time.perf_counter()
        store.save(_state(step, numel=1 << 20), name=f"step_{step:06d}")
        conn.send((step, time.perf_counter() - start))


def test_kill_at_many_instants_during_a_large_save(tmp_path):
    trials = 15
    for trial in range(trials):
        receive, send = _FORK.Pipe(duplex=False)
        child = _FORK.Process(target=_save_in_a_loop, args=(tmp_path, send))
        child.start()
        send.close()
        if not receive.poll(60):
            child.kill()
            raise AssertionError("the saving child did not finish a first save within 60 s")
        completed, seconds = receive.recv()
        # The next save starts as the first returns; spread the kills from its start to past its end.
        time.sleep(seconds * 1.2 * trial / (trials - 1))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        while receive.poll():
            try:
                completed, _ = receive.recv()
            except EOFError:
                break
        latest = _assert_nothing_lies(tmp_path)
        assert load_checkpoint(latest)["state"]["global_step"] >= completed  # nothing that returned is lost
        assert load_checkpoint(tmp_path / f"step_{completed:06d}.pt")["state"]["global_step"] == completed
        remove_stale_temporaries(tmp_path)


def _async_save_then_hold(folder: Path, held: HeldSave, conn: Connection) -> None:
    """Child: hand step 3 to the background writer, which pauses inside its write (``held``); then keep 'training'."""
    from gputrain.checkpoint.snapshot import CheckpointWriter

    state = _state(3)
    path = CheckpointWriter(CheckpointStore(folder, keep_last=2, monitor="val/loss"), write=held.write).save(
        state, name="step_000003", metrics={"val/loss": 0.5})
    state["model"]["w"].add_(1.0)  # the next step, while the writer is still inside the write
    conn.send(str(path))
    conn.recv()  # wait here, as a training loop would, until the parent kills us


def test_kill_while_the_background_writer_is_inside_a_save(tmp_path):
    folder = tmp_path / "checkpoints"
    store = CheckpointStore(folder, keep_last=2, monitor="val/loss")
    store.save(_state(1), name="step_000001", metrics={"val/loss": 2.0})
    store.save(_state(2), name="step_000002", metrics={"val/loss": 1.0})
    held = HeldSave(tmp_path, "inside")
    fifo = held.fifo
    receive, send = _FORK.Pipe()
    child = _FORK.Process(target=_async_save_then_hold, args=(folder, held, send))
    child.start()
    try:
        assert receive.poll(60), "the child's save did not return while its writer was held"
        assert receive.recv() == str(folder / "step_000003.pt")  # save returned: the step goes on
        end = None
        while end is None and child.is_alive():  # the writer opens its end once it is inside its write
            try:
                end = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.01)
        assert end is not None, f"the child died (exit {child.exitcode}) before its writer reached the write"
        partial = [p for p in folder.iterdir() if p.name.startswith(".step_000003.pt.")]
        assert len(partial) == 1  # a temporary holding part of the checkpoint exists now
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        os.close(end)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == -signal.SIGKILL
    latest = _assert_nothing_lies(folder)
    assert latest == folder / "step_000002.pt" and load_checkpoint(folder / "last.pt")["state"]["global_step"] == 2
    assert not (folder / "step_000003.pt").exists()
    assert remove_stale_temporaries(folder) == partial  # the next start removes the part, and only it
    assert sorted(p.name for p in folder.iterdir()) == ["best.pt", "last.pt", "manifest.json", "step_000001.pt",
                                                        "step_000002.pt"]
