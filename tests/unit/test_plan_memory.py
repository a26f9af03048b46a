"""issue 30 (in progress): one step's tensor memory predicted on fake tensors equals MemTracker's count of a real step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

from gputrain.tools.plan.memory import _parts, predict_step_memory, run_steps


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


@pytest.mark.parametrize("size", [8, 40])
def test_single_device_prediction_equals_the_measured_step(size):
    torch.manual_seed(0)
    batch = (torch.randn(4, 3, size, size), torch.randint(0, 5, (4,)))
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    predicted = predict_step_memory(_model, batch, nn.functional.cross_entropy, adam)
    model = _model()
    optimizer = adam(list(model.parameters()))
    run_steps(model, optimizer, batch, nn.functional.cross_entropy, steps=1)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        run_steps(model, optimizer, batch, nn.functional.cross_entropy, steps=1)
    assert predicted == _parts(tracker.get_tracker_snapshot("peak"))
    assert predicted.optimizer == 2 * sum(p.numel() * 4 for p in model.parameters()) + 4 * len(list(model.parameters()))
