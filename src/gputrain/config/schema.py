"""The run configuration's dataclasses: every field, its default and what it means (the single source of defaults).

``config.yaml`` and every checkpoint hold a :class:`RunConfig`; :mod:`gputrain.config.load` fills one from a
recipe and ``key=value`` overrides, :mod:`gputrain.config.checks` refuses values no run can use, and
:mod:`gputrain.config.resolve` decides every ``auto`` once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gputrain.config.data import DataConfig

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The values ``trainer.compile_mode`` takes (torch.compile's modes)."""


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to build: a built-in name, or ``package.module:function`` for your own."""

    name: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the model's builder."""
    weights: str = ""
    """Pretrained weights to start from: a torchvision weights name for the model (``DEFAULT``, ``IMAGENET1K_V2``,
    ``COCO_V1``; DeepLabv3+ takes its ResNet backbone's), a local state_dict file, or an http(s) URL. Fetched once per
    node into the torch hub cache; tensors that do not fit (the new head) keep their initialisation (docs/fine-tuning.md)."""
    freeze: list[str] = field(default_factory=list)
    """Blocks whose parameters do not train and whose BatchNorm is frozen: dotted module names (``layer1``,
    ``backbone.body.layer2``) or ``backbone`` (a classifier without one: every block but the head)."""
    frozen_batchnorm: bool = False
    """Every BatchNorm becomes ``FrozenBatchNorm2d`` (fixed statistics), as torchvision's detection references do."""


@dataclass(kw_only=True)
class OptimConfig:
    """The optimizer; ``lr`` is for the global batch the recipe states (no silent rescaling)."""

    name: str = "adam"
    """sgd, adam or adamw."""
    lr: float = 1e-3
    momentum: float = 0.9
    """SGD momentum (ignored by Adam)."""
    weight_decay: float = 0.0
    nesterov: bool = False
    fused: bool | str = "auto"
    """Fused optimizer kernels (one kernel for all parameters): auto (on when the parameters are on a GPU), true or
    false."""
    pretrained_lr_scale: float = 1.0
    """Learning-rate multiplier for the tensors ``model.weights`` loaded (the new head keeps ``lr``): 0.1 trains the
    pretrained layers 10x slower."""
    scale_lr: str = "none"
    """Rescale ``lr`` for the actual global batch: none, linear (lr x G/reference) or sqrt (lr x sqrt(G/reference))."""
    reference_batch: int = 256
    """The global batch ``lr`` was tuned for; used only when ``scale_lr`` is linear or sqrt."""
    label_smoothing: float = 0.0
    """Classification: cross-entropy's label smoothing (torch's ``label_smoothing``)."""
    norm_weight_decay: float | None = None
    """Weight decay of normalisation layers' weights (BatchNorm, LayerNorm, GroupNorm, ...); None: weight_decay."""
    bias_weight_decay: float | None = None
    """Weight decay of every parameter named ``bias``, norms' too (the reference's ``--bias-weight-decay``); None:
    weight_decay."""


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule, stepped once per optimizer step."""

    name: str = "constant"
    """constant, cosine, poly or step."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    power: float = 0.9
    """Exponent of the poly schedule (DeepLab's)."""
    step_epochs: int = 30
    """Epochs between decays of the step schedule."""
    gamma: float = 0.1
    """Decay factor of the step schedule."""
    min_lr_ratio: float = 0.0
    """Floor of cosine and poly, as a fraction of ``lr``."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Options of the strategies that split the model (model_parallel, pipeline, fsdp)."""

    stages: int = 2
    """Stages of model_parallel (one process); pipeline uses one stage per process (``--devices``)."""
    stage_devices: list[str] = field(default_factory=list)
    """Devices of model_parallel's stages, e.g. [cuda:0, cuda:1]; empty: one visible GPU per stage, or cpu."""
    micro_batches: int = 1
    """Micro-batches each step's batch is cut into and pipelined through the stages."""
    split_points: list[str] = field(default_factory=list)
    """Names of the top-level blocks that start stages 2..K (e.g. [layer3]); empty: chosen by ``partition``."""
    partition: str = "measured"
    """How split points are chosen when none are given: measured (per-block time and memory) or params."""
    schedule: str = "gpipe"
    """Pipeline schedule of strategy pipeline: gpipe or 1f1b."""
    stage_memory_gib: list[float] = field(default_factory=list)
    """Memory cap per stage for the partitioner, in GiB; empty: no cap on CPU, the device's memory on GPUs."""
    reshard_after_forward: bool = True
    """fsdp: free gathered parameters after forward (less memory, one more all-gather in backward)."""
    sharded_checkpoint: bool = False
    """Write model and optimizer as a torch.distributed.checkpoint folder (each rank its shards) beside each
    checkpoint file, instead of gathering them on rank 0; loads on any process count."""


@dataclass(kw_only=True)
class TrainerConfig:
    """How to run: strategy, devices, precision, loop length and outputs."""

    strategy: str = "ddp"
    """single, ddp, dp, model_parallel, pipeline or fsdp."""
    accelerator: str = "auto"
    """auto, cpu or cuda."""
    devices: int = 1
    """Processes per node for ddp (one per GPU); GPUs of one process for dp use ``dp_device_ids``."""
    precision: str = "auto"
    """auto (bf16-mixed on a GPU with bfloat16, else 32), mixed (bf16-mixed on a GPU with bfloat16, 16-mixed on
    other GPUs, 32 on a CPU), 32, 16-mixed or bf16-mixed."""
    epochs: int = 10
    batch_size: int = 32
    """Per device (per process). The global batch is batch_size x world size x accumulation."""
    eval_batch_size: int = 0
    """Per device during evaluation; 0 means ``batch_size``."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step; gradients are not all-reduced between them."""
    grad_clip_norm: float = 0.0
    """Clip the global gradient norm to this; 0 disables."""
    seed: int = 0
    drop_last: bool = False
    """Drop the epoch's last, short global batch; by default it is trained as it comes (no sample twice)."""
    out: str = ""
    """Run folder; empty: a new dated folder under runs/, with runs/latest pointing to it."""
    overwrite: bool = False
    """Clear a non-empty ``out`` before training; without it (or ``resume``) a non-empty folder is refused."""
    resume: str = ""
    """``auto`` (the newest valid checkpoint in out/checkpoints), a checkpoint path, or empty."""
    timeout_s: float = 600.0
    """Collective timeout: a rank waiting longer than this for its peers fails, naming the step."""
    log_every_n_steps: int = 10
    enable_checkpointing: bool = True
    """Write checkpoints at all; off only for throwaway runs and overhead benchmarks."""
    checkpoint_every_n_epochs: int = 1
    """Write ``epoch_NNNN.pt`` every n epochs; ``last.pt`` is written every epoch. 0 writes only last.pt."""
    checkpoint_every_n_steps: int = 0
    """Also checkpoint mid-epoch every n optimizer steps (exact resume from the middle of an epoch); 0: off."""
    checkpoint_every_n_minutes: float = 0.0
    """Also checkpoint mid-epoch when this many minutes passed since the last save, at a step the ranks agree on."""
    keep_last: int = 3
    """Numbered checkpoints (epoch_/step_) kept besides last.pt and best.pt; at least 2, the newest may be mid-write."""
    monitor: str = ""
    """Metric that picks ``best.pt`` (e.g. val/loss, val/accuracy); empty: no best.pt."""
    monitor_mode: str = "min"
    """min or max: whether a smaller or larger ``monitor`` is better."""
    eval_every_n_epochs: int = 1
    loggers: list[str] = field(default_factory=lambda: ["csv"])
    """Any of csv, tensorboard, wandb (metrics.jsonl is always written)."""
    wandb_project: str = "gputrain"
    wandb_mode: str = "offline"
    """offline needs no network; ``online`` needs an API key."""
    progress_bar: bool = True
    sync_batchnorm: bool = False
    """Synchronise BatchNorm statistics across ranks (torch's SyncBatchNorm on CUDA, ours on CPU)."""
    fp32_modules: list[str] = field(default_factory=list)
    """Modules that run outside autocast, in float32, under 16-mixed or bf16-mixed: qualified names (decoder.aspp)
    or class names (LayerNorm; _BatchNorm for every BatchNorm). The usual fix for a region that overflows float16."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights (parameters and BatchNorm statistics), validated as
    ``val_ema/...`` and saved in checkpoints; 0: off. The reference's ResNet-50 v2 recipe uses 0.99998."""
    ema_every_n_steps: int = 32
    """Optimizer steps between EMA updates (the reference's ``--model-ema-steps``)."""
    ema_adjust: bool = True
    """Scale ``1 - ema_decay`` by global batch x ema_every_n_steps / epochs, as torchvision's reference does; false
    applies ema_decay per update as given (timm's convention)."""
    find_unused_parameters: bool = False
    dp_device_ids: list[int] | None = None
    """GPUs for strategy dp; None means all visible."""
    dp_output_device: int | None = None
    """GPU where dp gathers outputs; None means dp_device_ids[0]."""
    max_steps_per_epoch: int = 0
    """Stop each epoch after this many optimizer steps (smoke tests, parity); 0 means the whole epoch."""
    async_checkpoint: bool = True
    """Write checkpoints in a background thread, the step only copying the state (on a GPU, into pinned memory
    without waiting); false writes them in the step. Sharded checkpoints use torch.distributed.checkpoint's own
    background save. The default follows the benchmarks (docs/checkpoints.md#saves-in-the-background)."""
    channels_last: bool | str = "auto"
    """Channels-last memory format for the model and its image batches: auto (on CUDA for fixed-shape images, not
    detection), true or false (docs/performance.md)."""
    compile: bool = False
    """``torch.compile`` the model (per stage for model_parallel and pipeline, per sharded block for fsdp); the first
    steps pay the compile time, printed apart from step time. Off by default: it pays back on long GPU runs only."""
    compile_mode: str = "default"
    """torch.compile mode: default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs."""
    cudnn_benchmark: bool | str = "auto"
    """Let cuDNN time its convolution algorithms on the first batches: auto (on CUDA for fixed-shape images), true
    or false."""
    reuse_host_memory: bool | str = "auto"
    """Keep the host memory freed tensors return for the next step instead of giving it back to the OS (glibc's
    allocator, 1.5-26 % shorter CPU epochs in the benchmarks; the process keeps its peak memory): auto (on with glibc), true or false."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward instead of keeping them (torch.utils.checkpoint over the
    blocks of the model's chain): less memory for about one more forward; the same weights and BatchNorm buffers."""
    measure_memory: bool = False
    """Measure each rank's memory over the first two optimizer steps into ``memory.json`` (max_memory_allocated on
    a GPU; torch's MemTracker on a CPU, which slows those two steps): what ``gputrain plan`` predicts, measured."""
    predicted_step_s: float = 0.0
    """The plan's step time for this run in seconds (0: none), set by ``--strategy auto``: the pace of the first
    steps is set against it, with one line when they are more than 20 % apart (docs/plan.md)."""
    predicted_peak_bytes: list[int] = field(default_factory=list)
    """The plan's peak memory of each device, set by ``--strategy auto``: with ``trainer.measure_memory`` each rank's
    measure in memory.json is set against it, with one line when one is more than 20 % apart."""
    pictures: int = 8
    """Validation images drawn in samples.png at the end of training (and sent to TensorBoard/W&B at each
    evaluation); curves.png is written beside it. 0 writes neither picture (docs/report.md)."""


@dataclass(kw_only=True)
class LaunchConfig:
    """Multi-node arguments, passed through to torchrun's rendezvous."""

    nnodes: int = 1  # the fewest nodes of an elastic job (--nnodes MIN:MAX), whose most are max_nodes (0: nnodes)
    max_nodes: int = 0
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = "gputrain"
    max_restarts: int = 0
    join_timeout_s: int = 600  # waiting for nnodes nodes, then one line (torchrun's join_timeout)
    last_call_s: int = 30  # waiting for more nodes once nnodes have joined (torchrun's last_call_timeout)
    keep_alive_s: int = 5  # each agent's heartbeat; a node silent for 3 is gone (torchrun's keep_alive_interval)

    @property
    def elastic(self) -> bool:
        """Whether nodes may join or leave the running job (``--nnodes MIN:MAX``): each change restarts the workers."""
        return self.max_nodes > self.nnodes


@dataclass(kw_only=True)
class RunConfig:
    """Everything one training run needs; saved as ``config.yaml`` in the run folder."""

    task: str = "autoencoder"
    """A built-in task (autoencoder, classification, segmentation, detection) or ``package.module:function``."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
