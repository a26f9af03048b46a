"""Checks of a :class:`~gputrain.config.schema.RunConfig` before anything starts: ranges of numbers, and combinations.

Every number in the config is checked by one generic walk (:func:`check_numbers`) against the
range declared for its field, so ``optim.lr=1e39`` or ``trainer.timeout_s=nan`` is one line naming
the field and the allowed range, not a traceback from the optimizer. A range is declared in one
of two places:

* beside the field, in its dataclass (:mod:`gputrain.config.schema`): ``lr: float = field(default=1e-3, metadata=bounds(gt=0, le=100))``;
* or in :data:`RANGES` below, keyed by the dotted name (``"optim.lr": Range(gt=0, le=100)``).

A new numeric field needs one of them: ``tests/unit/test_config_ranges.py`` fails for a number
without a declared range, and plants a bad value in every field to see it refused.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from gputrain.config.augment_checks import check_augmentation
from gputrain.config.resolve import FUSED_SGD_REFUSAL, fused_sgd_breaks
from gputrain.config.schema import COMPILE_MODES, RunConfig

INT32_MAX = 2**31 - 1
"""Upper bound of counts (steps, epochs, batch sizes): what torch's and the samplers' int32 arithmetic holds."""
SEED_MAX = 2**32 - 1
"""The largest seed every generator we seed (torch, numpy, random) takes."""


@dataclass(frozen=True, kw_only=True)
class Range:
    """The values a number may take: bounds are inclusive (``ge``, ``le``) or exclusive (``gt``, ``lt``)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    example: str = ""
    """Appended to the refusal, e.g. "e.g. 0.2 for an 8:2 split"."""

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self) -> str:
        low, high = (self.ge if self.ge is not None else self.gt), (self.le if self.le is not None else self.lt)
        if high is None or (high >= INT32_MAX and low is not None):  # a count: its upper bound is a footnote
            text = f"must be at least {_num(low)}" if self.gt is None else f"must be above {_num(low)}"
            text += f" and at most {_num(high)}" if high is not None else ""
        elif low is None:
            text = f"must be at most {_num(high)}" if self.lt is None else f"must be below {_num(high)}"
        else:
            text = (f"must be in {'(' if self.gt is not None else '['}{_num(low)}, {_num(high)}"
                    f"{')' if self.lt is not None else ']'}")
        return f"{text}, {self.example}" if self.example else text


def _num(x: float | None) -> str:
    return f"{int(x)}" if x is not None and float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def bounds(**kwargs: Any) -> dict[str, Range]:
    """Field metadata declaring a range: ``field(default=..., metadata=bounds(ge=0, le=1))``."""
    return {"range": Range(**kwargs)}


COUNT = Range(ge=1, le=INT32_MAX)
COUNT_OR_OFF = Range(ge=0, le=INT32_MAX)
"""A count where 0 means off / all / default (documented per field)."""
DEVICE_INDEX = Range(ge=0, le=1023)

RANGES: dict[str, Range] = {
    "data.val_fraction": Range(ge=0, lt=1, example="e.g. 0.2 for an 8:2 split"),
    "data.split_seed": Range(ge=0, le=SEED_MAX),
    "data.image_size": Range(ge=0, le=65536),
    "data.num_classes": COUNT_OR_OFF,
    "data.num_workers": Range(ge=0, le=1024, example="or auto (the cores of the node divided by its processes)"),
    "optim.lr": Range(gt=0, le=100),
    "optim.momentum": Range(ge=0, lt=1),
    "optim.weight_decay": Range(ge=0, le=1),
    "optim.label_smoothing": Range(ge=0, lt=1, example="e.g. 0.1, as torchvision's recipes"),
    "optim.norm_weight_decay": Range(ge=0, le=1, example="e.g. 0.0, as torchvision's recipes"),
    "optim.bias_weight_decay": Range(ge=0, le=1),
    "data.crop_scale": Range(gt=0, le=1, example="e.g. [0.35, 1.0]"),
    "data.hflip": Range(ge=0, le=1, example="0 never flips"),
    "data.random_erase": Range(ge=0, le=1),
    "data.mixup_alpha": Range(ge=0, le=100, example="e.g. 0.2, as torchvision's ResNet-50 v2 recipe; 0 is off"),
    "data.cutmix_alpha": Range(ge=0, le=100, example="e.g. 1.0, as torchvision's ResNet-50 v2 recipe; 0 is off"),
    "data.repeated_augment": Range(ge=1, le=64, example="e.g. 3 as torchvision's --ra-reps; 1 is off"),
    "data.train_crop_size": Range(ge=0, le=65536),
    "data.val_resize_size": Range(ge=0, le=65536),
    "data.val_crop_size": Range(ge=0, le=65536),
    "optim.pretrained_lr_scale": Range(gt=0, le=1000, example="e.g. 0.1 for pretrained layers 10x slower than the head"),
    "optim.reference_batch": COUNT,
    "scheduler.warmup_steps": COUNT_OR_OFF,
    "scheduler.power": Range(gt=0, le=100),
    "scheduler.step_epochs": COUNT,
    "scheduler.gamma": Range(gt=0, le=1),
    "scheduler.min_lr_ratio": Range(ge=0, le=1),
    "parallel.stages": Range(ge=1, le=1024),
    "parallel.micro_batches": COUNT,
    "parallel.stage_memory_gib": Range(gt=0, le=2**20),
    "trainer.devices": Range(ge=1, le=1024),
    "trainer.epochs": COUNT,
    "trainer.batch_size": COUNT,
    "trainer.eval_batch_size": COUNT_OR_OFF,
    "trainer.accumulate_grad_batches": COUNT,
    "trainer.grad_clip_norm": Range(ge=0, le=1e6),
    "trainer.seed": Range(ge=0, le=SEED_MAX),
    "trainer.ema_decay": Range(ge=0, lt=1, example="e.g. 0.99998 as torchvision's ResNet-50 v2 recipe; 0 is off"),
    "trainer.ema_every_n_steps": COUNT,
    "trainer.timeout_s": Range(gt=0, le=10**7),
    "trainer.log_every_n_steps": COUNT_OR_OFF,
    "trainer.checkpoint_every_n_epochs": COUNT_OR_OFF,
    "trainer.checkpoint_every_n_steps": COUNT_OR_OFF,
    "trainer.checkpoint_every_n_minutes": Range(ge=0, le=10**6, example="30 saves every half hour"),
    "trainer.keep_last": Range(ge=2, le=10**6),  # the newest may be the one a crash cut short
    "trainer.eval_every_n_epochs": COUNT_OR_OFF,
    "trainer.dp_device_ids": DEVICE_INDEX,
    "trainer.dp_output_device": DEVICE_INDEX,
    "trainer.max_steps_per_epoch": COUNT_OR_OFF,
    "trainer.pictures": Range(ge=0, le=1024, example="0 draws no pictures"),
    "trainer.predicted_step_s": Range(ge=0, le=10**6, example="0 compares nothing; --strategy auto sets it"),
    "trainer.predicted_peak_bytes": Range(ge=1, le=2**60),
    "launch.nnodes": Range(ge=1, le=65536),
    "launch.max_nodes": Range(ge=0, le=65536),
    "launch.join_timeout_s": Range(ge=1, le=10**6),
    "launch.last_call_s": Range(ge=0, le=10**6),
    "launch.keep_alive_s": Range(ge=1, le=3600),
    "launch.node_rank": Range(ge=0, le=65535),
    "launch.max_restarts": Range(ge=0, le=1000),
}
"""Allowed values of each number, by dotted field name (lists: of each item); None (unset) is not checked."""


def range_of(dotted: str, f: dataclasses.Field[Any]) -> Range | None:
    """The range declared for a field: its metadata first, then :data:`RANGES`."""
    declared = f.metadata.get("range")
    return declared if isinstance(declared, Range) else RANGES.get(dotted)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_fields(obj: Any, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted name, field, value) of every field of ``obj``'s dataclasses, recursively, that holds numbers."""
    out = []
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += numeric_fields(value, f"{name}.")
        elif is_number(value) or (isinstance(value, list) and any(is_number(v) for v in value)):
            out.append((name, f, value))
    return out


def check_numbers(cfg: Any) -> None:
    """Every number of ``cfg`` is finite and in its field's range; the first that is not is one ``ValueError`` line."""
    for name, f, value in numeric_fields(cfg):
        allowed = range_of(name, f) or Range()
        for item in value if isinstance(value, list) else [value]:
            if is_number(item) and not allowed.holds(item):
                shown = f"{name}={value!r}" if not isinstance(value, list) else f"{name}={value!r} ({item!r})"
                need = allowed.describe() if allowed != Range() else "must be a finite number"
                if not math.isfinite(item) and allowed != Range():
                    need = f"must be finite and {need.removeprefix('must be ')}"
                raise ValueError(f"{shown} {need}")


def check_combinations(cfg: RunConfig) -> None:
    """Values that are each fine but not together, and names with a fixed set of choices."""
    t = cfg.trainer
    if isinstance(cfg.data.num_workers, str) and cfg.data.num_workers != "auto":
        raise ValueError(f"data.num_workers={cfg.data.num_workers!r} must be a count of at least 0 or auto "
                         "(the cores of the node divided by its processes)")
    for name, value in (("trainer.channels_last", t.channels_last), ("trainer.cudnn_benchmark", t.cudnn_benchmark),
                        ("optim.fused", cfg.optim.fused), ("trainer.reuse_host_memory", t.reuse_host_memory),
                        ("data.normalize_on_device", cfg.data.normalize_on_device)):
        if isinstance(value, str) and value != "auto":
            raise ValueError(f"{name}={value!r} must be auto, true or false (from Python: 'auto', True or False)")
    if cfg.optim.fused is True and fused_sgd_breaks(cfg, str(t.precision)):
        raise ValueError(FUSED_SGD_REFUSAL)
    if cfg.data.decode_on_device and (cfg.task != "classification" or cfg.data.format != "classfolder"):
        raise ValueError(f"data.decode_on_device=true decodes class-folder images (task classification, data.format="
                         f"classfolder), not task {cfg.task} with data.format={cfg.data.format or '(default)'}; set "
                         "data.decode_on_device=false")
    if t.compile and t.strategy == "dp":
        raise ValueError("trainer.compile=true does not work with strategy dp (nn.DataParallel copies the model to "
                         "each GPU at every step); use --strategy ddp, or trainer.compile=false")
    for field, value, choices in (
            ("trainer.precision", str(t.precision), ("auto", "mixed", "32", "16-mixed", "bf16-mixed", "32-true",
                                                     "fp32", "fp16-mixed")),  # the aliases of docs/precision.md
            ("trainer.accelerator", t.accelerator, ("auto", "cpu", "cuda")),
            ("optim.name", cfg.optim.name.lower(), ("sgd", "adam", "adamw")),
            ("scheduler.name", cfg.scheduler.name.lower(), ("constant", "cosine", "poly", "step"))):
        if value not in choices:  # when the config is made (Trainer(...) too), not when the run first needs it
            raise ValueError(f"{field}={value!r} is unknown; choose {', '.join(choices)}")
    check_augmentation(cfg)
    if t.compile_mode not in COMPILE_MODES:
        raise ValueError(f"trainer.compile_mode={t.compile_mode!r} is unknown; choose {', '.join(COMPILE_MODES)}")
    if t.monitor_mode not in ("min", "max"):
        raise ValueError(f"trainer.monitor_mode={t.monitor_mode!r} is not min or max")
    if t.monitor.startswith("val_ema/") and not t.ema_decay:
        raise ValueError(f"trainer.monitor={t.monitor} reads the EMA's validation, and trainer.ema_decay=0 keeps no "
                         "EMA; set trainer.ema_decay (e.g. 0.9999) or monitor val/...")
    check_launch(cfg)
    if t.overwrite and t.resume == "auto":
        raise ValueError("trainer.overwrite=true would delete the run that trainer.resume=auto continues; choose one")
    check_split_options(cfg)


SPLIT_STRATEGIES = ("model_parallel", "pipeline")


def check_launch(cfg: RunConfig) -> None:
    """The nodes of the job: a node rank among them, and an elastic range only where a model is not split."""
    launch, most = cfg.launch, max(cfg.launch.nnodes, cfg.launch.max_nodes)
    if launch.max_nodes and launch.max_nodes < launch.nnodes:
        raise ValueError(f"--nnodes {launch.nnodes}:{launch.max_nodes}: the most nodes must be at least the fewest")
    if not launch.node_rank < most:
        field = "launch.max_nodes" if launch.max_nodes else "launch.nnodes"
        raise ValueError(f"launch.node_rank={launch.node_rank} must be in [0, {field}={most})")
    if most > launch.nnodes and cfg.trainer.strategy not in ("ddp", "fsdp"):
        raise ValueError(f"--nnodes {launch.nnodes}:{most} lets the job's size change, and strategy "
                         f"{cfg.trainer.strategy} runs on a fixed number of processes (one, or a split of the model); "
                         "train an elastic job with --strategy ddp or fsdp, or give --nnodes one number")


def check_split_options(cfg: RunConfig, stages: int | None = None, strategy: str = "") -> None:
    """The ``parallel.*`` options of model_parallel and pipeline, checked before any process starts.

    ``stages``: the pipeline's process count when known (a rank passes its world size); before the launch it is
    ``trainer.devices x launch.nnodes`` (one stage per process), and model_parallel's comes from its own options.
    The strategy checks the same function again in each rank with what it resolved (``mixed`` precision, say),
    naming itself (``strategy``).
    """
    t, p = cfg.trainer, cfg.parallel
    strategy = strategy or t.strategy
    if strategy not in SPLIT_STRATEGIES:
        return
    if p.partition not in ("measured", "params"):
        raise ValueError(f"parallel.partition={p.partition!r} is unknown; choose measured or params")
    if p.schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"parallel.schedule={p.schedule!r} is unknown; choose gpipe or 1f1b")
    if strategy == "pipeline":
        stages = stages or t.devices * cfg.launch.nnodes
        if str(t.precision) in ("16-mixed", "fp16-mixed"):
            # Named both ways: `mixed` resolves to 16-mixed on a GPU without native bfloat16 before a rank checks.
            raise ValueError("strategy pipeline does not support trainer.precision=16-mixed, which `mixed` also means "
                             "on a GPU without bfloat16 (the loss scaler would skip steps on some stages only); use "
                             "bf16-mixed on a GPU that has it, or 32")
        if p.schedule == "1f1b" and p.micro_batches < stages:
            raise ValueError(f"parallel.schedule=1f1b needs parallel.micro_batches >= the {stages} stages; got "
                             f"{p.micro_batches}: add parallel.micro_batches={stages} (or use parallel.schedule=gpipe)")
    else:
        stages = stages or len(p.stage_devices) or p.stages
    one_process_pipeline = strategy == "pipeline" and stages == 1  # runs the plain model: split points unused
    if p.split_points and not one_process_pipeline and len(p.split_points) != stages - 1:
        raise ValueError(f"parallel.split_points has {len(p.split_points)} names for {stages} stages; give "
                         f"{stages - 1} (the blocks that start stages 2..{stages})")
    check_micro_batches(t.batch_size, p.micro_batches)


def check_micro_batches(batch_size: int, micro_batches: int) -> None:
    """Each step's batch must give every micro-batch at least one sample."""
    if batch_size < micro_batches:
        raise ValueError(f"trainer.batch_size={batch_size} is smaller than parallel.micro_batches={micro_batches}; "
                         "use a batch of at least one sample per micro-batch")


def validate(cfg: RunConfig) -> None:
    """Refuse values no run can use, before anything starts; the error names the dotted field and the allowed range.

    Types are OmegaConf's job (:func:`gputrain.config.load.load_config`); ranges and combinations are checked
    here. Names (strategy, precision, optimizer, model) are checked where they are built, against the registries
    that define them.
    """
    check_numbers(cfg)
    check_combinations(cfg)
