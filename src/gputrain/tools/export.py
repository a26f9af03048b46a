"""``gputrain export onnx``: export a checkpoint's model and check it with onnxruntime."""

from __future__ import annotations

from pathlib import Path

import torch

from gputrain.checkpoint import load_checkpoint
from gputrain.config import RunConfig, config_from_dict
from gputrain.models import build_model
from gputrain.tasks import build_task


def model_from_checkpoint(path: str | Path) -> tuple[torch.nn.Module, RunConfig]:
    """Rebuild the model a checkpoint was trained with (from its saved config) and load its weights."""
    state = load_checkpoint(path)
    cfg = config_from_dict(state.get("config", {}))
    if cfg.task == "detection":
        raise ValueError(
            f"{path} is a detection model; `gputrain export onnx` exports models that map one image batch to one "
            "tensor. See docs/export.md for exporting Mask R-CNN with torch.onnx.export(dynamo=False)"
        )
    model = build_model(cfg.model.name, **cfg.model.kwargs)  # the config saved with the checkpoint is resolved
    model.load_state_dict(state["model"])
    return model.eval(), cfg


def export_onnx(checkpoint: str | Path, out: str | Path, *, input_shape: list[int] | None = None,
                opset: int = 18) -> float:
    """Export to ``out`` with a dynamic batch axis; returns max |onnxruntime - PyTorch| on a sample input."""
    import onnxruntime as ort

    model, cfg = model_from_checkpoint(checkpoint)
    if input_shape:
        example = torch.rand(*input_shape)
    else:
        try:
            example = build_task(cfg).example_input
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"cannot read a sample input from the training data ({err}); pass --input-shape N,C,H,W") from None
        if example is None:
            raise ValueError("this task has no sample input; pass --input-shape N,C,H,W")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=1024)
    torch.onnx.export(model, (example,), str(out), dynamo=True, opset_version=opset, verbose=False,
                      input_names=["input"], output_names=["output"], dynamic_shapes=({0: batch},))
    with torch.no_grad():
        expected = model(example).numpy()
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: example.numpy()})[0]
    diff = float(abs(got - expected).max())
    print(f"exported {out} (opset {opset}); onnxruntime vs PyTorch on input {tuple(example.shape)}: "
          f"max abs diff {diff:.3g}")
    return diff
