"""The ranks' agreement on a stop request (signals.StopRequest) on 2 real gloo ranks.

Fast steps are agreed on every few steps, not every step (a per-step all-reduce cost 8 % of a 20 ms step on
2 CPU ranks); the interval is agreed from the slowest rank's pace, so every rank checks at the same calls and
a signal seen by one rank stops both after the same call. The epoch's last step (``now``) always agrees.
"""

from __future__ import annotations

import time

from gputrain.dist.stop import PROBE_STEPS, StopRequest
from multiproc import run_ranks


def _steps(info, signal_at: int, step_s: float, now_at: int) -> tuple[int, int, int]:
    """(call that returned the signal, the interval chosen, agreements made) on this rank."""
    from torch import distributed as dist

    agreements = 0
    real = dist.all_reduce

    def counted(*args, **kwargs):
        nonlocal agreements
        agreements += 1
        return real(*args, **kwargs)

    dist.all_reduce = counted
    with StopRequest(info.world_size) as stop:
        for call in range(1, 400):
            # Rank 1 is slower; only rank 0 receives the signal, at its call ``signal_at``.
            time.sleep(step_s * (3 if info.rank == 1 else 1))
            if info.rank == 0 and call == signal_at:
                stop.received = 15
            if stop.agreed(now=call == now_at):
                return call, stop.every, agreements
    return -1, stop.every, agreements


def test_fast_steps_agree_every_few_steps_at_the_same_calls_on_every_rank():
    """Planted faults: a rank stopping on its own flag, or an interval each rank picks from its own pace."""
    (call0, every0, made0), (call1, every1, made1) = run_ranks(_steps, 30, 0.002, 0)
    # 6 ms a step (the slower rank) -> an agreement every ~30 calls; only a step over 0.2 s, 30 times the
    # sleep, would give 1, so a loaded machine does not change the outcome.
    assert every0 == every1 > 1
    assert call0 == call1 >= 30  # both stop at the first agreement at or after the signal
    assert made0 == made1 < call0 / 2  # far fewer than one per step


def test_the_last_step_of_an_epoch_agrees_at_once():
    (call0, _, _), (call1, _, _) = run_ranks(_steps, PROBE_STEPS + 2, 0.002, PROBE_STEPS + 3)
    assert call0 == call1 == PROBE_STEPS + 3
