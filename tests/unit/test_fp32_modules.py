"""``trainer.fp32_modules`` (issue 41, item 3): named modules run outside autocast, in float32, and that is the fix
for a region that overflows float16; names and checkpoints stay the model's; a name of nothing is one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gputrain import Trainer
from gputrain.config import OptimConfig, RunConfig
from gputrain.nn.float32 import keep_float32


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)),
                         nn.Linear(16, 3))


def _dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}

    def record(name: str):  # a hook that returns nothing, so the output stays the module's
        def hook(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
            seen.setdefault(name, out.dtype)
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in model.named_modules() if n]
    with torch.autocast("cpu", dtype=dtype):
        model(torch.randn(4, 8))
    for h in hooks:
        h.remove()
    return seen


def test_named_modules_and_types_run_in_float32_the_rest_in_16_bits():
    plain = _dtypes(_net(), torch.bfloat16)
    assert plain["0"] == plain["2.0"] == plain["3"] == torch.bfloat16
    model = _net()
    keys = list(model.state_dict())
    assert keep_float32(model, ["2", "LayerNorm"]) == ["2", "2.1"]
    kept = _dtypes(model, torch.bfloat16)
    assert kept["2"] == kept["2.0"] == kept["2.1"] == torch.float32  # the block and what runs inside it
    assert kept["0"] == kept["3"] == torch.bfloat16
    assert list(model.state_dict()) == keys
    _net().load_state_dict(model.state_dict(), strict=True)
    assert keep_float32(model, ["Linear"]) == ["0", "2.0", "3"]  # by class; twice is harmless
    assert _dtypes(model, torch.bfloat16)["3"] == torch.float32


def test_a_module_that_overflows_float16_is_finite_in_float32():
    model = _net()
    with torch.no_grad():
        model[2][0].weight.mul_(1e6)  # its outputs pass float16's 65,504
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model[2][0](model[1](model[0](x)))).all()
    keep_float32(model, ["2.0"])
    with torch.autocast("cpu", dtype=torch.float16):
        inner = model[2][0](model[1](model[0](x)))
        assert inner.dtype == torch.float32 and torch.isfinite(inner).all()
        assert torch.isfinite(model(x)).all()


def test_a_name_of_nothing_is_one_line_with_the_closest():
    with pytest.raises(ValueError, match=r"^trainer.fp32_modules: 'LayerNrm' is no module of Sequential \(by "
                                         r"qualified name or class\); closest: LayerNorm$"):
        keep_float32(_net(), ["LayerNrm"])


def test_a_bf16_run_trains_with_them_and_says_so(tmp_path, capsys):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
    trainer = Trainer(RunConfig(optim=OptimConfig(name="sgd", lr=0.1)), strategy="single", accelerator="cpu",
                      precision="bf16-mixed", batch_size=8, epochs=1, out=str(tmp_path), progress_bar=False,
                      loggers=[], fp32_modules=["2.1"])
    summary = trainer.fit(_net(), data, loss=F.cross_entropy)
    assert summary["final"]["train/loss"] > 0
    assert "gputrain: trainer.fp32_modules: 2.1 run in float32, outside autocast" in capsys.readouterr().out
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    _net().load_state_dict(saved["model"], strict=True)
