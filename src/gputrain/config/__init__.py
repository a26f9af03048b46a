"""The run configuration: its dataclasses, how a recipe and overrides fill them, the checks, and ``auto`` resolved.

Layers of this package, lowest first: :mod:`~gputrain.config.schema` (the dataclasses; the ``data:`` section's in
:mod:`~gputrain.config.data`), :mod:`~gputrain.config.checks` (ranges and combinations), :mod:`~gputrain.config.load`
(recipes, saved configs, overrides) and :mod:`~gputrain.config.resolve` (every ``auto`` decided once). The names
below are the public ones.
"""

from gputrain.config.checks import validate
from gputrain.config.data import DataConfig
from gputrain.config.load import builtin_recipes, config_from_dict, load_config, recipe_path, to_dict, to_yaml
from gputrain.config.schema import (
    LaunchConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    SchedulerConfig,
    TrainerConfig,
)

__all__ = ["DataConfig", "LaunchConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RunConfig",
           "SchedulerConfig", "TrainerConfig", "builtin_recipes", "config_from_dict", "load_config", "recipe_path",
           "to_dict", "to_yaml", "validate"]
