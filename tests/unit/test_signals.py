"""Stop signals in one process: which signals stop a run, the second Ctrl-C's window, handlers put back after ``fit``."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gputrain.dist.stop
from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.dist.stop import StopRequest
from gputrain.engine.hooks import Hook
from gputrain.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _fit(out: Path, *, n: int = 16, **trainer: Any) -> Trainer:
    torch.manual_seed(0)
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    t = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.05)), strategy="single", accelerator="cpu",
                progress_bar=False, loggers=[], batch_size=8, epochs=2, out=str(out), **trainer)
    t.fit(nn.Linear(4, 1), TensorDataset(x, x.sum(1, keepdim=True)), loss=F.mse_loss)
    return t


def _previous(signum: int, frame: Any) -> None:
    """A handler of the caller's own (a notebook's, a job script's): what fit must leave in place."""


@pytest.fixture
def own_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, _previous)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_second_ctrl_c_within_two_seconds_is_absorbed_and_one_later_aborts(monkeypatch, own_handlers):
    """One stop request can reach a worker twice within moments (sent to every process of the job, as `srun` or a
    script may do, and forwarded by the launcher as well): that must not abort the checkpoint. A second Ctrl-C more than two seconds after the first aborts at once. Planted fault: any
    second SIGINT aborts. Duplicate real signals merge in Python, so the installed handler is called directly
    and the clock is moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(gputrain.dist.stop, "time", SimpleNamespace(monotonic=lambda: now[0]))  # this module's clock
    with StopRequest() as stop:
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)
        assert stop.received == signal.SIGINT
        for now[0] in (1000.01, 1001.9):  # the forwarded copy of the same Ctrl-C; still within two seconds
            try:
                handler(signal.SIGINT, None)
            except KeyboardInterrupt:  # a failure of this test, not an interrupt of pytest
                pytest.fail(f"a second Ctrl-C {now[0] - 1000:.2f} s after the first aborted at once")
        assert stop.received == signal.SIGINT and stop.agreed() == signal.SIGINT
        now[0] = 1002.1
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, None)


def test_sigusr1_stops_a_run_at_a_step_boundary_with_exit_code_138(tmp_path, own_handlers, capsys):
    """SLURM's --signal=USR1@120 (docs/fault-tolerance.md, the signals table). Planted fault: SIGUSR1 is not a
    stop signal (its handler is the caller's, or the default one, which would kill the process)."""
    class SendUsr1(Hook):
        def after_step(self, ctx, logs):
            if ctx.state.global_step == 1:
                # Checked before the signal is sent: with the default handler it would end pytest itself.
                assert signal.getsignal(signal.SIGUSR1) == signal.getsignal(signal.SIGTERM), \
                    f"SIGUSR1's handler during fit is {signal.getsignal(signal.SIGUSR1)!r}, not the stop request's"
                signal.raise_signal(signal.SIGUSR1)

    with pytest.raises(Interrupted) as info:
        _fit(tmp_path, hooks=[SendUsr1()])
    assert info.value.signum == signal.SIGUSR1 and info.value.exit_code == 138
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["last.pt", "step_000001.pt"]
    assert f"interrupted at epoch 1, after step 1 of that epoch (global step 1); checkpoint {folder / 'step_000001.pt'};" in capsys.readouterr().out


class _SignalAtStep1(Hook):
    def __init__(self, signum: int) -> None:
        self.signum = signum

    def after_step(self, ctx, logs):
        if ctx.state.global_step == 1:
            signal.raise_signal(self.signum)


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_the_interrupt_line_says_when_torchrun_will_restart_the_workers_by_itself(tmp_path, own_handlers, capsys,
                                                                                    monkeypatch, restarts):
    """torchrun's agent stops its workers with SIGTERM before it restarts them (a node joined or left an elastic job,
    or a rank failed with restarts left): the line must not tell the user that a resume by hand is the only way on.
    Without restarts it says just that. Planted fault: the line ignores torchrun's restarts."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(Interrupted):
        _fit(tmp_path, hooks=[_SignalAtStep1(signal.SIGTERM)])
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("interrupted at")]
    automatic = "if torchrun restarts the workers (a node joined or left, or a rank failed with restarts left), " \
                "they continue from it by themselves; if the whole job was stopped, continue with: Trainer("
    assert (automatic in line) == (restarts == "2"), line
    assert restarts == "2" or "step_000001.pt; continue with: Trainer(..., resume='auto'" in line, line


def test_fit_puts_back_the_signal_handlers_it_found_after_success_and_after_failure(tmp_path, own_handlers):
    """A notebook or a script that calls fit keeps its own Ctrl-C, SIGTERM and SIGUSR1 handlers afterwards.
    Planted fault: StopRequest.__exit__ leaves the run's handlers installed."""
    _fit(tmp_path / "ok", enable_checkpointing=False)
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == dict.fromkeys(SIGNALS, _previous)

    class Fail(Hook):
        def after_step(self, trainer, logs):
            raise RuntimeError("a user hook failed")

    with pytest.raises(RuntimeError, match="a user hook failed"):
        _fit(tmp_path / "failed", enable_checkpointing=False, hooks=[Fail()])
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == dict.fromkeys(SIGNALS, _previous)


def test_a_signal_after_the_last_epoch_says_the_run_finished(tmp_path, own_handlers, capsys):
    """issue 28 item 10: Ctrl-C while the end of a run draws its pictures or waits for its last checkpoint left the
    user guessing. Planted fault: the signal is noted and nothing said."""
    class LateCtrlC(Hook):
        def after_fit(self, ctx, summary):
            signal.raise_signal(signal.SIGINT)

    trainer = _fit(tmp_path, hooks=[LateCtrlC()])
    assert trainer.state.epoch == 2
    assert (f"gputrain: SIGINT came after the last epoch had trained: the run finished and is complete in {tmp_path}; "
            "nothing was lost") in capsys.readouterr().out.splitlines()
