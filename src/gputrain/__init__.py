"""gputrain: train vision models on one CPU, one GPU, many GPUs or many nodes from one recipe."""

from gputrain.config import RunConfig, load_config
from gputrain.dist import DistInfo, init_distributed
from gputrain.launch import launch, launch_all
from gputrain.loop import Trainer

__version__ = "0.1.0"
__all__ = ["DistInfo", "RunConfig", "Trainer", "init_distributed", "launch", "launch_all", "load_config"]
