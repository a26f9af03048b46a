"""A checkpoint that rank 0 could not write stops every rank at once, with the same one line (2 real gloo ranks).

Only rank 0 writes, so only rank 0 sees the failure (a background write's at the next save). Before, rank 0 raised
alone and the others waited in their next collective: over gloo until they noticed the lost connection, over NCCL
until the launcher's SIGTERM and, 30 s later, its SIGKILL.
"""

from __future__ import annotations

from pathlib import Path

from multiproc import run_ranks


def _train_while_the_folder_goes_away(info, out: str) -> tuple[str, str, int]:
    """(error type, its first line, the step it stopped at) on this rank."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    from gputrain import Trainer
    from gputrain.engine.hooks import Hook

    class TakeTheFolderAway(Hook):
        """On rank 0, before the first save (step 2): a file stands where the checkpoint folder goes (put there by
        hand, say), so that save, in the background, fails."""

        def after_step(self, ctx, logs):
            if info.rank == 0 and ctx.state.global_step == 2:
                (ctx.out / "checkpoints").write_text("not a folder")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=g)
    torch.manual_seed(0)
    trainer = Trainer(strategy="ddp", devices=2, accelerator="cpu", progress_bar=False, loggers=[], batch_size=2,
                      epochs=1, out=out, checkpoint_every_n_steps=2, checkpoint_every_n_epochs=0, pictures=0,
                      async_checkpoint=True,
                      hooks=[TakeTheFolderAway()])
    try:
        trainer.fit(nn.Linear(8, 4), TensorDataset(x, x[:, :4]), loss=F.mse_loss)
    except Exception as err:  # noqa: BLE001  (what each rank raised is the result)
        return type(err).__name__, (str(err).splitlines() or [""])[0], trainer.state.global_step
    return "", "", trainer.state.global_step


def test_a_checkpoint_rank_0_could_not_write_stops_every_rank_with_its_line(tmp_path: Path):
    """Planted fault: the agreement replaced by the barrier it stands in for (rank 1 then fails on the lost
    connection, or waits)."""
    (kind0, line0, step0), (kind1, line1, step1) = run_ranks(_train_while_the_folder_goes_away, str(tmp_path / "run"),
                                                             timeout_s=20)  # under the fault rank 1 waits this long
    assert kind0 == kind1 == "CheckpointWriteError", (kind0, line0, kind1, line1)
    assert line1 == line0 and "step_000002.pt was not written" in line0
    assert step0 == step1 == 4  # the next save, where the background failure shows
