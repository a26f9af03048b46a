"""``gputrain export onnx``: export a checkpoint's model and check it with onnxruntime.

The model is rebuilt from the config saved in the checkpoint (overrides win), so a checkpoint
alone is enough. A model trained from Python has no recipe to rebuild it from: pass the model
to :func:`export_model` instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from gputrain.checkpoint import load_checkpoint
from gputrain.config import RunConfig
from gputrain.extras import require
from gputrain.tools.from_checkpoint import build_fitting_model, config_from_checkpoint, load_fitting

EXPORT_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
"""What the dynamo exporter and the onnxruntime check need (the ``export`` extra)."""


def check_export_packages() -> None:
    for module in EXPORT_PACKAGES:
        require(module, "gputrain export onnx")


def model_from_checkpoint(path: str | Path, overrides: Sequence[str] = (),
                          recipe: str | None = None, weights: str = "model") -> tuple[nn.Module, RunConfig]:
    """Rebuild the model a checkpoint was trained with (from its saved config) and load its weights.

    ``recipe`` is needed only for a checkpoint without a saved config; one of another task or model
    is ignored with a printed line (never merged into the checkpoint's model).
    """
    state = load_checkpoint(path, gather_sharded=True, weights=weights)
    cfg, note = config_from_checkpoint(state, path, recipe=recipe, overrides=list(overrides), command="export")
    if note:
        print(note, flush=True)
    if cfg.task == "detection":
        raise ValueError(
            f"{path} is a detection model ({cfg.model.name}); `gputrain export onnx` exports models that map one image "
            "batch to one tensor. See docs/export.md for exporting a detector with torch.onnx.export(dynamo=False)"
        )
    return build_fitting_model(cfg, state, path).eval(), cfg


class MainOutput(nn.Module):
    """A model whose output is a dict, exported with its main output alone: torchvision's segmentation models
    return ``{"out", "aux"}``, and evaluation and predict read ``out``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["out"]


def _one_tensor(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """``model``, or its main output where it returns a dict with ``out``; refused in one line otherwise."""
    with torch.no_grad():
        output = model(example)
    if isinstance(output, torch.Tensor):
        return model
    if isinstance(output, dict) and isinstance(output.get("out"), torch.Tensor):
        return MainOutput(model).eval()
    raise ValueError(f"{type(model).__name__} returns {type(output).__name__}, not a tensor or a dict with 'out'; "
                     "`gputrain export onnx` exports models that map one image batch to one tensor (docs/export.md)")


def _example(cfg: RunConfig, input_shape: Sequence[int] | None) -> torch.Tensor:
    """A random input of ``input_shape``, else of ``data.image_size``, else one read from the training data."""
    if input_shape:
        if len(input_shape) != 4 or min(input_shape) < 1:
            raise ValueError(f"--input-shape {','.join(map(str, input_shape))} must be 4 positive numbers N,C,H,W")
        return torch.rand(*input_shape)
    if cfg.data.image_size:
        return torch.rand(1, 3, cfg.data.image_size, cfg.data.image_size)
    from gputrain.tasks import build_task

    try:
        example = build_task(cfg).example_input
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"cannot read a sample input from the training data ({err}); pass --input-shape N,C,H,W") from None
    if example is None:
        raise ValueError("this task has no sample input; pass --input-shape N,C,H,W")
    return example


def _export(model: nn.Module, example: torch.Tensor, out: str | Path, opset: int) -> float:
    """Export with a dynamic batch axis, check with onnxruntime, then move into place (no partial file at ``out``).

    The exporter writes the weights beside the model (``FILE.data``) and records that name inside
    it, so both are written under their final names in a temporary folder and moved together.
    """
    import onnxruntime as ort

    model = _one_tensor(model, example)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    batch = torch.export.Dim("batch", min=1, max=1024)
    try:
        torch.onnx.export(model, (example,), str(staging / out.name), dynamo=True, opset_version=opset, verbose=False,
                          input_names=["input"], output_names=["output"], dynamic_shapes=({0: batch},))
        with torch.no_grad():
            expected = model(example).numpy()
        session = ort.InferenceSession(str(staging / out.name), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: example.numpy()})[0]
        for part in sorted(staging.iterdir(), key=lambda p: p.name == out.name):  # the model file last
            os.replace(part, out.parent / part.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    diff = float(abs(got - expected).max())
    print(f"exported {out} (opset {opset}); onnxruntime vs PyTorch on input {tuple(example.shape)}: "
          f"max abs diff {diff:.3g}")
    return diff


def export_onnx(checkpoint: str | Path, out: str | Path, *, input_shape: Sequence[int] | None = None,
                opset: int = 18, overrides: Sequence[str] = (), recipe: str | None = None,
                weights: str = "model") -> float:
    """Export a checkpoint's model (``weights="ema"``: its moving average) to ``out``; returns max |onnxruntime -
    PyTorch| on a sample input."""
    check_export_packages()
    model, cfg = model_from_checkpoint(checkpoint, overrides, recipe, weights)
    return _export(model, _example(cfg, input_shape), out, opset)


def export_model(model: nn.Module, checkpoint: str | Path | None, out: str | Path, input_shape: Sequence[int], *,
                 opset: int = 18) -> float:
    """Export your own ``model`` (e.g. one trained with ``Trainer.fit``) with ``checkpoint``'s weights loaded.

    >>> export_model(Net(), "runs/net/checkpoints/last.pt", "net.onnx", input_shape=[1, 3, 64, 64])  # doctest: +SKIP

    ``checkpoint`` None exports the model's current weights. Returns max |onnxruntime - PyTorch|.
    """
    check_export_packages()
    if checkpoint is not None:
        load_fitting(model, load_checkpoint(checkpoint, gather_sharded=True)["model"], path=checkpoint)
    if len(input_shape) < 1 or min(input_shape) < 1:
        raise ValueError(f"input_shape={list(input_shape)} must be positive sizes, e.g. [1, 3, 64, 64]")
    return _export(model.eval(), torch.rand(*input_shape), out, opset)
