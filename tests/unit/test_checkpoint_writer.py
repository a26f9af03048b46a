"""The checkpoint writer on its own (trainer.async_checkpoint): what a save copies, when it writes, how it fails.

* The state is copied before ``save`` returns: a step that updates the weights in place while the thread is held
  before its write does not reach the file (the thread is held on a FIFO the test controls through the ``write``
  it injects, so the order is fixed, not timed). The host buffers are reused by the next save only once the save
  that holds them is on disk.
* A save that fails in the thread fails the next save (or the end) with one line naming the file.
* With ``asynchronous=False`` the file is on disk when ``save`` returns and a failure raises there; an entry a
  resume could not load is refused at ``save``, in the caller's thread, either way.
* A sharded checkpoint's file is committed only after its shards are written.
* A failed save names the newest whole checkpoint; a skipped non-finite one warns once per run.

Each test drives a :class:`~gputrain.checkpoint.snapshot.CheckpointWriter` directly, the FIFO tests with a real
thread; the same writer inside ``Trainer.fit`` runs: test_checkpoint_writer_fit.py.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from checkpoint_helpers import HeldSave, assert_same_state
from gputrain.checkpoint import CheckpointStore, load_checkpoint
from gputrain.checkpoint.snapshot import CheckpointWriteError, CheckpointWriter


def test_the_step_cannot_change_a_checkpoint_being_written(tmp_path):
    """Planted fault: the state is not copied before save returns (the step then mutates it)."""
    held = HeldSave(tmp_path)
    writer = CheckpointWriter(CheckpointStore(tmp_path / "checkpoints"), write=held.write)
    weights = torch.arange(1000, dtype=torch.float32)
    momentum = {"state": {0: {"momentum_buffer": torch.ones(10)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    state = {"model": {"w": weights, "tied": weights}, "optimizer": momentum, "state": {"global_step": 1}}
    assert writer.save(state, name="step_000001") == tmp_path / "checkpoints" / "step_000001.pt"
    held.reached()
    weights.add_(1.0)  # what the next optimizer step does, in place, while the thread writes
    momentum["state"][0]["momentum_buffer"].mul_(0.0)
    momentum["param_groups"][0]["lr"] = 0.5
    held.release()
    writer.wait()
    saved = load_checkpoint(tmp_path / "checkpoints" / "step_000001.pt")
    assert torch.equal(saved["model"]["w"], torch.arange(1000, dtype=torch.float32))
    assert saved["model"]["tied"] is saved["model"]["w"] or torch.equal(saved["model"]["tied"], saved["model"]["w"])
    assert torch.equal(saved["optimizer"]["state"][0]["momentum_buffer"], torch.ones(10))
    assert saved["optimizer"]["param_groups"][0]["lr"] == 0.1


def test_a_failed_background_save_fails_the_next_save_in_one_line(tmp_path):
    held = HeldSave(tmp_path)
    store = CheckpointStore(tmp_path / "checkpoints")
    writer = CheckpointWriter(store, write=held.write)
    writer.save({"model": {}, "state": {"global_step": 1}}, name="step_000001")
    held.reached()
    shutil.rmtree(store.folder)  # the folder vanishes under the write (an unmounted disk, say)
    held.release()
    writer.write = CheckpointWriter(store).write  # the next saves are not held
    with pytest.raises(CheckpointWriteError) as caught:
        writer.save({"model": {}, "state": {"global_step": 2}}, name="step_000002")
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 1
    assert message.startswith(f"checkpoint {store.folder / 'step_000001.pt'} was not written (FileNotFoundError")
    assert "no earlier checkpoint exists" in message and "trainer.async_checkpoint=false" in message
    writer.wait()  # raised once, not again
    store.folder.mkdir()
    writer.save({"model": {}, "state": {"global_step": 2}}, name="step_000002")
    writer.wait()
    assert load_checkpoint(store.folder / "step_000002.pt")["state"]["global_step"] == 2


def test_the_next_save_reuses_the_host_buffers_only_after_the_previous_one_is_on_disk(tmp_path):
    """The snapshot's host buffers are reused by the next save (no fresh 135 MB allocation per save), and only
    once the save that holds them has been written. Planted fault: ``save`` does not wait for the one in flight."""
    import threading

    held = HeldSave(tmp_path)
    writer = CheckpointWriter(CheckpointStore(tmp_path / "checkpoints"), write=held.write)
    weights = torch.arange(1000, dtype=torch.float32)
    writer.save({"model": {"w": weights}, "state": {"global_step": 1}}, name="step_000001")
    first = [b.data_ptr() for b in writer._buffers]
    held.reached()  # the first save is inside its write, reading the buffers
    weights.add_(1.0)
    second = threading.Thread(target=writer.save, args=({"model": {"w": weights}, "state": {"global_step": 2}},),
                              kwargs={"name": "step_000002"})
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()  # it waits for the first save before touching the buffers
    held.release()
    second.join(timeout=60)
    assert not second.is_alive()
    held.reached()  # the second save pauses at the same place; let it through
    held.release()
    writer.wait()
    assert [b.data_ptr() for b in writer._buffers] == first  # the same memory, copied into again
    folder = tmp_path / "checkpoints"
    assert torch.equal(load_checkpoint(folder / "step_000001.pt")["model"]["w"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(load_checkpoint(folder / "step_000002.pt")["model"]["w"], torch.arange(1000, dtype=torch.float32) + 1)


def _layouts(step: int) -> dict[str, Any]:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) + step
    return {"model": {"w": w, "tied": w, "every_other": w[:, ::2], "transposed": w.t(), "empty": torch.empty(0, 3),
                      "half": torch.full((5,), 0.5 + step, dtype=torch.bfloat16), "flag": torch.tensor(step % 2 == 0),
                      "image": torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(step)).contiguous(
                          memory_format=torch.channels_last)},
            "state": {"global_step": step, "epoch": 0}}


def test_two_saves_of_one_layout_reuse_every_buffer_views_included(tmp_path):
    """Views of bigger tensors (every other column, a transpose) get buffers of their own strides; those are reused
    too, and each save is written whole. Planted fault: a view's buffer allocated anew at every save."""
    writer = CheckpointWriter(CheckpointStore(tmp_path))
    writer.save(_layouts(1), name="step_000001")
    writer.wait()
    buffers = list(writer._buffers)
    writer.save(_layouts(2), name="step_000002")
    writer.wait()
    assert all(a is b for a, b in zip(writer._buffers, buffers, strict=True))
    assert_same_state(load_checkpoint(tmp_path / "step_000002.pt"), _layouts(2))
    assert_same_state(load_checkpoint(tmp_path / "step_000001.pt"), _layouts(1))
    writer.close()


def test_a_synchronous_writer_writes_in_the_callers_thread_and_fails_at_the_save(tmp_path):
    """``trainer.async_checkpoint=false`` is the way out the error messages offer: the file is on disk when ``save``
    returns, and a save that fails raises there, at the step that saved. Planted fault: the synchronous writer
    still hands the save to the thread."""
    writer = CheckpointWriter(CheckpointStore(tmp_path / "checkpoints"), asynchronous=False)
    path = writer.save({"model": {"w": torch.ones(3)}, "state": {"global_step": 1}}, name="step_000001")
    assert writer.idle  # nothing was handed to a thread
    assert path == tmp_path / "checkpoints" / "step_000001.pt"
    assert load_checkpoint(path)["state"]["global_step"] == 1
    (tmp_path / "a-file").write_text("")
    writer.store = CheckpointStore(tmp_path / "a-file" / "checkpoints")  # a folder that cannot be made
    with pytest.raises(OSError):  # the store's own error, at once; not a CheckpointWriteError at a later save
        writer.save({"model": {}, "state": {"global_step": 2}}, name="step_000002")
    assert writer.idle
    writer.wait()  # nothing left over to raise


@pytest.mark.parametrize("asynchronous", [True, False], ids=["background", "synchronous"])
def test_a_file_that_names_shards_is_committed_only_after_they_are_written(tmp_path, asynchronous):
    """A sharded checkpoint's ``.pt`` names its DCP folder; committed before every rank's shards are on disk, a crash
    there leaves a valid-looking checkpoint that cannot load, and a failed shard write must fail the save, not commit
    it. Planted fault: the writer does not wait for the shards (the ``after`` future)."""
    import threading
    from concurrent.futures import Future

    folder = tmp_path / "checkpoints"
    writer = CheckpointWriter(CheckpointStore(folder), asynchronous=asynchronous)
    shards: Future[None] = Future()
    state = {"model": {}, "sharded": "step_000001.dcp", "state": {"global_step": 1}}
    saving = threading.Thread(target=writer.save, args=(state,), kwargs={"name": "step_000001", "after": shards})
    saving.start()
    saving.join(timeout=0.5 if not asynchronous else 60)
    writer_thread = writer._thread
    if writer_thread is not None:
        writer_thread.join(timeout=0.5)
    assert not (folder / "step_000001.pt").exists() and not (folder / "manifest.json").exists()
    shards.set_result(None)
    saving.join(timeout=60)
    writer.wait()
    assert load_checkpoint(folder / "step_000001.pt")["sharded"] == "step_000001.dcp"

    failed: Future[None] = Future()
    failed.set_exception(OSError("rank 1 could not write its shards"))
    state = {"model": {}, "sharded": "step_000002.dcp", "state": {"global_step": 2}}
    with pytest.raises((OSError, CheckpointWriteError), match="rank 1 could not write its shards"):
        writer.save(state, name="step_000002", after=failed)
        writer.wait()
    assert not (folder / "step_000002.pt").exists()


def test_an_entry_a_resume_could_not_load_is_refused_at_the_save_in_the_callers_thread(tmp_path):
    """A ``Path`` in the state would be written fine and refused by ``torch.load(weights_only=True)`` at resume; the
    step that put it there must fail with the entry named, not a later save with a background error. Planted
    fault: the check left to the writer thread."""
    writer = CheckpointWriter(CheckpointStore(tmp_path / "checkpoints"))
    state = {"model": {"w": torch.ones(3)}, "state": {"global_step": 1, "data": tmp_path}}
    with pytest.raises(ValueError, match=r"^checkpoint entry state\['state'\]\['data'\] is a pathlib\.\w*Path, "
                                         r"which torch\.load\(weights_only=True\) refuses"):
        writer.save(state, name="step_000001")
    assert writer.idle  # the thread never started
    writer.wait()
    assert not (tmp_path / "checkpoints" / "step_000001.pt").exists()


def test_a_non_finite_snapshot_is_skipped_with_one_warning_per_run(tmp_path, capsys):
    """A diverged run would otherwise print the same line at every later save. Planted fault: the warning printed
    for every skipped save."""
    writer = CheckpointWriter(CheckpointStore(tmp_path / "checkpoints"))
    nan = torch.tensor([1.0, float("nan")])
    for step in (1, 2, 3):
        writer.save({"model": {"w": nan}, "state": {"global_step": step}}, name=f"step_{step:06d}", check_finite=True)
    writer.wait()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "was not written" in line]
    assert warnings == [f"gputrain: warning: checkpoint {tmp_path / 'checkpoints' / 'step_000001.pt'} was not "
                        "written: its weights or optimizer state hold NaN/inf; the newest written checkpoint is kept, "
                        "and the run stops at its next check of the loss or the weights"]
    assert not list((tmp_path / "checkpoints").glob("*.pt"))  # none of the three was written
    writer.save({"model": {"w": torch.ones(2)}, "state": {"global_step": 4}}, name="step_000004", check_finite=True)
    writer.wait()  # a finite save after them is written as usual
    assert load_checkpoint(tmp_path / "checkpoints" / "step_000004.pt")["state"]["global_step"] == 4


def test_a_failed_background_save_names_the_newest_whole_checkpoint(tmp_path):
    """The error says where to resume from. The second save's temporary is deleted under the write (a cleanup
    script, say), so it fails after the first is on disk. Planted fault: the message names none."""
    store = CheckpointStore(tmp_path / "checkpoints")
    writer = CheckpointWriter(store)
    writer.save({"model": {"w": torch.ones(3)}, "state": {"global_step": 1}}, name="step_000001")
    writer.wait()
    held = HeldSave(tmp_path, "after")
    writer.write = held.write
    writer.save({"model": {"w": torch.zeros(3)}, "state": {"global_step": 2}}, name="step_000002")
    held.reached()
    (temporary,) = store.folder.glob(".step_000002.pt.*.tmp")
    temporary.unlink()
    held.release()
    with pytest.raises(CheckpointWriteError) as caught:
        writer.wait()
    message = str(caught.value)
    assert message.startswith(f"checkpoint {store.folder / 'step_000002.pt'} was not written (FileNotFoundError")
    assert f"; {store.folder / 'step_000001.pt'} is the newest whole one; " in message
    assert "no earlier checkpoint exists" not in message
