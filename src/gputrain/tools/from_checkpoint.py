"""Rebuild what a checkpoint was trained with: its saved config, its model, and one line when they do not fit.

Every gputrain checkpoint carries the resolved config of its run (``state["config"]``), model
arguments derived from the data (``num_classes``) included. ``gputrain eval`` and ``gputrain
export onnx`` start from it, so a checkpoint needs no recipe and no repeated ``model.kwargs``
overrides; command-line overrides still win. A model that does not fit the weights is reported
as the first differing keys and shapes and the config fields that decide them, not as a
``load_state_dict`` traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gputrain.config import RunConfig, load_config, to_dict

PYTHON_TASK = "custom"
"""``task`` saved by runs of the Python API (``Trainer(...).fit(model, ...)``); ``model.name`` is the class."""

_NOT_CARRIED = {"out": "", "resume": "", "overwrite": False, "devices": 1}
"""Trainer fields of the training run that say where and how big it ran, not what to evaluate."""


def load_for_eval(path: str | Path, weights: str = "model") -> dict[str, Any]:
    """A gputrain checkpoint, or a bare ``state_dict`` file as ``{"model": ...}`` (it has no saved config).

    A sharded checkpoint's weights are gathered from its folder; ``weights="ema"`` puts the moving average of the
    weights in ``state["model"]``. Errors are the checkpoint loader's one line naming the file (truncated, corrupt,
    unsafe, no moving average).
    """
    from gputrain.checkpoint import load_checkpoint, model_weights

    try:
        return load_checkpoint(path, gather_sharded=True, weights=weights)
    except ValueError as first:
        if weights != "model":
            raise
        try:
            return {"model": model_weights(path)}
        except Exception:  # not a state_dict either: the first message says why
            raise first from None


def saved_config(state: dict[str, Any]) -> dict[str, Any] | None:
    """The config dict a checkpoint was saved with, or None for checkpoints without one."""
    saved = state.get("config")
    return saved if isinstance(saved, dict) and saved else None


def python_run_message(path: str | Path, saved: dict[str, Any], command: str) -> str:
    """What to do with a checkpoint of a Python-API run, whose model only the user's code can build."""
    name = saved.get("model", {}).get("name") or "your model"
    if command == "export":
        return (f"checkpoint {path} was trained from Python with model {name}; export it from Python with "
                f"gputrain.tools.export.export_model(model, {str(path)!r}, 'model.onnx', input_shape=[1, 3, H, W]), "
                f"where model is a new {name} built as in training")
    return (f"checkpoint {path} was trained from Python with model {name}; `gputrain eval` builds recipe tasks only: "
            f"load it with model.load_state_dict(gputrain.checkpoint.load_checkpoint({str(path)!r})['model']) and "
            "call Trainer(...).validate(model, val_data, task=...)")


def _as_layer(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved config as a layer for :func:`~gputrain.config.load_config`, without where the run ran."""
    layer = {k: v for k, v in saved.items() if k != "launch"}
    layer["trainer"] = {**saved.get("trainer", {}), **_NOT_CARRIED}
    return layer


HOW_TO_RUN = ("trainer", "launch", "parallel")
"""Config sections a recipe given to ``eval`` contributes, whole; task, model and data are the checkpoint's."""


def trained_as(saved: dict[str, Any]) -> str:
    """``task=... model.name=...`` of a saved config, as a user would pass them."""
    return f"task={saved.get('task')} model.name={(saved.get('model') or {}).get('name') or '(default)'}"


def config_from_checkpoint(state: dict[str, Any], path: str | Path, *, recipe: str | None, overrides: list[str],
                           command: str = "eval") -> tuple[RunConfig, str]:
    """The config to evaluate or export a checkpoint with, and a note to print (or ""); see :func:`_config_for`.

    ``model.weights`` is cleared: the checkpoint holds the trained weights, so the pretrained ones it started
    from are neither fetched nor loaded again (offline machines can evaluate what they trained).
    """
    cfg, note = _config_for(state, path, recipe=recipe, overrides=overrides, command=command)
    cfg.model.weights = ""
    return cfg, note


def _config_for(state: dict[str, Any], path: str | Path, *, recipe: str | None, overrides: list[str],
                command: str) -> tuple[RunConfig, str]:
    """The config to evaluate or export a checkpoint with, and a note to print (or "").

    Without a recipe: the saved config, then ``overrides``. With one that trains the same task and
    model: the recipe's sections in :data:`HOW_TO_RUN` say how to run, the checkpoint's task, model
    and data say what it is (whole sections: a recipe's ``model.kwargs`` never reach another's
    checkpoint), then ``overrides``. With a recipe of another task or model: the recipe is ignored,
    and the note says so and what the checkpoint was trained as.
    """
    saved = saved_config(state)
    if saved is None:
        if not recipe:
            raise ValueError(f"checkpoint {path} holds no saved config (an older or hand-made file); name the recipe "
                             f"it was trained with: gputrain {command} RECIPE --checkpoint {path}")
        return load_config(recipe, overrides), ""
    if saved.get("task") == PYTHON_TASK:
        raise ValueError(python_run_message(path, saved, command))
    if not recipe:
        return load_config(None, overrides, layers=[_as_layer(saved)]), ""
    plain = load_config(recipe)
    recipe_trains = trained_as({"task": plain.task, "model": {"name": plain.model.name}})
    if recipe_trains != trained_as(saved):
        note = (f"gputrain: {command} ignores recipe {recipe} ({recipe_trains}): {path} was trained as "
                f"{trained_as(saved)}, so it is used with the config saved in it; drop the recipe to silence this")
        return load_config(None, overrides, layers=[_as_layer(saved)]), note
    how = {k: v for k, v in to_dict(plain).items() if k in HOW_TO_RUN}
    return load_config(None, overrides, layers=[_as_layer(saved), how]), ""


def _shape(t: torch.Tensor) -> str:
    return "x".join(str(n) for n in t.shape) or "scalar"


def misfit(model_state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], limit: int = 3) -> str:
    """The first differences between a model's state_dict and checkpoint weights, as one phrase ("" if none)."""
    shapes = [f"{k} is {_shape(weights[k])} in the checkpoint but {_shape(v)} in the model"
              for k, v in model_state.items() if k in weights and weights[k].shape != v.shape]
    missing = [k for k in model_state if k not in weights]
    extra = [k for k in weights if k not in model_state]
    parts = shapes[:limit] + ([f"{len(shapes) - limit} more shapes differ"] if len(shapes) > limit else [])
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing[:limit])}" + (f" ({len(missing)} in all)"
                                                                                   if len(missing) > limit else ""))
    if extra:
        parts.append(f"not in the model: {', '.join(extra[:limit])}" + (f" ({len(extra)} in all)"
                                                                       if len(extra) > limit else ""))
    return "; ".join(parts)


def _setting_diffs(cfg: RunConfig, saved: dict[str, Any] | None) -> list[str]:
    """``model.*`` fields set differently here than in the checkpoint's config."""
    if not saved:
        return []
    trained = saved.get("model", {})
    diffs = []
    if trained.get("name") and trained["name"] != cfg.model.name:
        diffs.append(f"model.name={cfg.model.name} here but {trained['name']} in training")
    old, new = trained.get("kwargs", {}) or {}, cfg.model.kwargs
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            diffs.append(f"model.kwargs.{key}={new.get(key)!r} here but {old.get(key)!r} in training")
    return diffs


def load_fitting(model: nn.Module, weights: dict[str, torch.Tensor], *, path: str | Path,
                 cfg: RunConfig | None = None, saved: dict[str, Any] | None = None) -> nn.Module:
    """``model.load_state_dict(weights)``, or one ``ValueError`` line naming what differs and what decides it."""
    problem = misfit(model.state_dict(), weights)
    if problem:
        fields = _setting_diffs(cfg, saved) if cfg is not None else []
        decided = (f"{'; '.join(fields)}: drop the override to use the checkpoint's own config" if fields else
                   "the architecture is decided by model.name and model.kwargs.*; use the values it was trained with")
        built = f" {cfg.model.name} with model.kwargs={cfg.model.kwargs}" if cfg is not None else ""
        raise ValueError(f"checkpoint {path} does not fit the model{built}: {problem}; {decided}")
    model.load_state_dict(weights)
    return model


def build_fitting_model(cfg: RunConfig, state: dict[str, Any], path: str | Path) -> nn.Module:
    """The model ``cfg`` names, with the checkpoint's weights loaded (or the one-line misfit error)."""
    from gputrain.models import build_model, finetuned

    try:
        model = finetuned(build_model(cfg.model.name, **cfg.model.kwargs), cfg.model)  # frozen BN: its own keys
    except TypeError as err:  # an argument the builder does not take
        raise ValueError(f"model.name={cfg.model.name} model.kwargs={cfg.model.kwargs}: {err}") from None
    return load_fitting(model, state["model"], path=path, cfg=cfg, saved=saved_config(state))
