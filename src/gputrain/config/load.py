"""Loading a run configuration: recipes (built-in names or YAML files), saved configs, dotted overrides.

OmegaConf does the merging and type checking (a string given for an int field is refused with the field's
dotted name); the dataclasses of :mod:`gputrain.config.schema` are the single source of defaults, and
:func:`~gputrain.config.checks.validate` checks what a merge accepted. Every error is one line naming the
file, line or key.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from gputrain.config.checks import validate
from gputrain.config.schema import RunConfig


def builtin_recipes() -> list[str]:
    """Names of the recipes shipped with the package."""
    folder = resources.files("gputrain") / "recipes"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def recipe_path(recipe: str) -> Path:
    """A recipe name (built-in) or a YAML path, as a path that exists."""
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {path} does not exist")
        return path
    candidate = resources.files("gputrain") / "recipes" / f"{recipe}.yaml"
    if not candidate.is_file():
        here = [f"{recipe}{suffix}" for suffix in (".yaml", ".yml") if Path(f"{recipe}{suffix}").is_file()]
        if here:  # a recipe of one's own named without its suffix
            raise ValueError(f"unknown recipe {recipe!r}; to train the recipe file {here[0]}, name it with its "
                             f"suffix: gputrain train {here[0]}")
        close = difflib.get_close_matches(recipe, builtin_recipes(), n=1)
        raise ValueError(f"unknown recipe {recipe!r}" + (f" (did you mean {close[0]}?)" if close else "")
                         + f"; built-in recipes: {', '.join(builtin_recipes())}, or a .yaml path")
    return Path(str(candidate))


def load_config(recipe: str | None = None, overrides: list[str] | None = None, *,
                layers: Sequence[dict[str, Any]] = ()) -> RunConfig:
    """Defaults, then the recipe's YAML, then ``layers`` (plain dicts), then dotted overrides (``trainer.epochs=3``).

    ``layers`` is how ``gputrain eval`` puts the config saved in a checkpoint between the recipe
    and the command line. The result is checked by :func:`~gputrain.config.checks.validate`.
    """
    merged_layers = [OmegaConf.structured(RunConfig)]
    try:
        if recipe:
            path = recipe_path(recipe)
            merged_layers.append(load_recipe_yaml(path))
            refuse_removed(OmegaConf.to_container(merged_layers[-1]), f"recipe {path}")
            check_recipe_types(path, merged_layers)
        # A config saved by an older gputrain may hold keys removed since: they said how it ran, not what it is.
        merged_layers += [OmegaConf.create(without_removed(layer)) for layer in layers]
        if overrides:
            merged_layers.append(dotlist(overrides))
            refuse_removed(OmegaConf.to_container(merged_layers[-1]), "the override")
            _drop_other_models_kwargs(merged_layers)
        merged = OmegaConf.merge(*merged_layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        # OmegaConf names the dotted key (full_key) and the expected type; keep that, drop the noise.
        key = getattr(err, "full_key", None) or "?"
        raise ValueError(f"{_what_is_wrong(err, 'config ')} {key}: {first_line(err)}") from None
    assert isinstance(cfg, RunConfig)
    validate(cfg)
    return cfg


def _drop_other_models_kwargs(layers: list[DictConfig]) -> None:
    """An override that names another model drops the earlier layers' ``model.kwargs`` and ``parallel.split_points``:
    they were options and block names of the recipe's model (``cifar_stem``, a DeepLabv3+ backbone, Mask R-CNN's
    image scale, ResNet's ``layer3``), which another model would refuse or silently ignore. Those given with the new
    name (``model.kwargs.dropout=0.3``) are kept; a note says what was dropped."""
    override = layers[-1].get("model") or {}
    merged = OmegaConf.merge(*layers[:-1])
    kwargs, splits = dict(merged.model.kwargs), list(merged.parallel.split_points)
    if "split_points" in (layers[-1].get("parallel") or {}):
        splits = []  # given with the new name: kept
    if "name" not in override or override["name"] == merged.model.name or not (kwargs or splits):
        return
    for layer in layers[:-1]:
        if "model" in layer and "kwargs" in layer.model:
            layer.model.kwargs = {}
        if splits and "parallel" in layer and "split_points" in layer.parallel:
            layer.parallel.split_points = []
    dropped = [f"model.kwargs ({', '.join(f'{k}={v}' for k, v in kwargs.items())})"] if kwargs else []
    dropped += [f"parallel.split_points ({', '.join(map(str, splits))})"] if splits else []
    print(f"gputrain: model.name={override['name']} replaces {merged.model.name}; dropped its "
          f"{' and '.join(dropped)}, options of that model (set them again for the new one)", flush=True)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """The :class:`RunConfig` saved in a checkpoint (``to_dict``), type-checked again."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), without_removed(data)))
    assert isinstance(cfg, RunConfig)
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain containers only (safe for ``torch.load(weights_only=True)``)."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


REMOVED: dict[str, str] = {
    "trainer.checkpoint_process": "checkpoints are written by the training process (a background thread where "
                                  "trainer.async_checkpoint is on)",
}
"""Keys a recipe may no longer set, with what replaced them (a saved config that holds one still loads)."""


def refuse_removed(layer: Any, where: str) -> None:
    """One line naming a removed key that ``layer`` (a recipe's or the overrides' plain dict) sets."""
    for dotted, instead in REMOVED.items():
        section, key = dotted.split(".")
        if isinstance(layer, dict) and isinstance(layer.get(section), dict) and key in layer[section]:
            raise ValueError(f"{where} sets {dotted}, which gputrain no longer has: {instead}; delete the key")


def without_removed(layer: dict[str, Any]) -> dict[str, Any]:
    """``layer`` (a saved config) without the keys of :data:`REMOVED`."""
    out = dict(layer)
    for dotted in REMOVED:
        section, key = dotted.split(".")
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section] = {k: v for k, v in out[section].items() if k != key}
    return out


def yaml_line(path: Path, dotted: str) -> int | None:
    """The 1-based line of ``dotted`` (``trainer.epochs``) in the YAML file ``path``, or None where it is not found."""
    try:
        node: Any = yaml.compose(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        node = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
        if node is None:
            return None
    return int(node.start_mark.line) + 1


def first_line(err: BaseException) -> str:
    msg = getattr(err, "msg", None) or str(err)
    return str(msg).strip().splitlines()[0]


def load_recipe_yaml(path: Path) -> Any:
    """The recipe's YAML; a syntax error becomes one line naming the file, line and column."""
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark, start = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or first_line(err)
        if start is not None and getattr(err, "context", None):
            problem += f", {err.context} started at line {start.line + 1} column {start.column + 1}"
        raise ValueError(f"recipe {path}{where}: YAML syntax error ({problem}); fix the file, e.g. a missing "
                         "bracket, quote or colon") from None
    if not isinstance(layer, DictConfig):
        raise ValueError(f"recipe {path} is not a mapping of sections (task:, data:, model:, trainer: ...)")
    return layer


def dotlist(overrides: list[str]) -> Any:
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except yaml.YAMLError as err:
        bad = next((o for o in overrides if _bad_yaml(o)), " ".join(overrides))
        raise ValueError(f"override {bad!r} is not valid YAML ({first_line(err)}); quote lists like "
                         "'trainer.loggers=[csv,tensorboard]'") from None


def _bad_yaml(override: str) -> bool:
    try:
        yaml.safe_load(override.partition("=")[2])
    except yaml.YAMLError:
        return True
    return False


def check_recipe_types(path: Path, layers: list[Any]) -> None:
    """The recipe file's values have their fields' types; a wrong one names the file and its line."""
    try:
        OmegaConf.merge(*layers)
    except OmegaConfBaseException as err:
        key = str(getattr(err, "full_key", None) or "")
        line = yaml_line(path, key) if key else None
        where = f"recipe {path}" + (f" line {line}" if line else "")
        raise ValueError(f"{where}: {_what_is_wrong(err, '')} {key or '?'}: {first_line(err)}; "
                         "fix the file") from None


def _what_is_wrong(err: OmegaConfBaseException, config: str) -> str:
    """A key no config has is a misspelt name, not a bad value: say which (a new user read "bad value" as the
    value being wrong)."""
    return f"unknown {config}key" if isinstance(err, ConfigAttributeError | ConfigKeyError) else f"bad {config}value for"
