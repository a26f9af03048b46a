"""The argument parser of the ``gputrain`` command; ``gputrain.cli`` holds what each sub-command does.

This module imports no torch (nor anything that does): ``--help``, ``--version`` and usage errors
answer in a fraction of a second. A new sub-command adds its parser here and a ``cmd_*`` function
in ``gputrain.cli`` that imports its tool inside the function.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gputrain.cli.run_flags import add_run_flags
from gputrain.config import builtin_recipes
from gputrain.tools.diagnose import MODE_NAMES

Handler = Callable[[argparse.Namespace, Sequence[str]], int]

DESCRIPTION = """\
gputrain trains vision models (a conv autoencoder, ResNet-18/50, DeepLabv3+, Mask R-CNN) from one YAML
recipe on a CPU, one GPU, several GPUs or several machines, with the same result at every scale."""

EPILOG = f"""\
commands:
  train RECIPE [flags] [key=value ...]   train; each run gets a new folder runs/RECIPE-DATE-TIME
                                         (runs/latest points to the newest)
  eval [RECIPE] --checkpoint PATH        evaluate a checkpoint with the config saved in it; writes eval.json
  export onnx --checkpoint PATH --out F  export a checkpoint to ONNX, checked with onnxruntime
  predict --checkpoint PATH --input IMAGES --out DIR   run a checkpoint on images; writes predictions
  report RUN_DIR                         draw curves.png and samples.png of a run
  replay RUN_DIR/nonfinite               rerun the step a run went NaN/inf on and name the module and samples
  data make KIND --out DIR               write a small sample data set in a real on-disk format
  bench scale RECIPE --devices 1,2       time a recipe over device counts and batch sizes
  bench throughput RECIPE [--json F]     images/s with real and synthetic data, input-bound ratio, FLOPs, memory
  parity RECIPE                          do all ways of running a recipe train the same model?
  doctor RECIPE                          a short dry run on real ranks that reports distributed mistakes
  plan RECIPE [--memory-budget 16GiB]    predict memory per device and step time of every strategy; choose
  env                                    versions, devices and distributed settings of this machine

Commands that run a recipe (train, eval, plan, doctor, parity, bench) take train's flags; one that means
nothing to a command is refused with the reason.

built-in recipes: {', '.join(builtin_recipes())}

example (sample data, 2 processes, export):
  gputrain data make imagefolder --out data/frames
  gputrain train autoencoder --devices 2 --epochs 5
  gputrain export onnx --checkpoint runs/latest/checkpoints/last.pt --out runs/latest/model.onnx

`gputrain COMMAND --help` lists a command's flags. Documentation: docs/index.md in the source tree;
exit codes and what each command writes where: docs/cli.md."""


MINIMUM = {"devices": 1, "epochs": 1, "batch_size": 1, "nnodes": 1, "node_rank": 0, "max_restarts": 0,
           "count": 1, "size": 1, "opset": 7}
"""Smallest value of each numeric flag; config fields have their ranges in gputrain.config.checks."""


def check_flags(args: argparse.Namespace) -> None:
    """Numbers no run can use, refused before anything starts, naming the flag."""
    if isinstance(getattr(args, "nnodes", None), str):
        from gputrain.cli.run_flags import nodes

        nodes(args.nnodes)
    for name, low in MINIMUM.items():
        values = getattr(args, name, None)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, int) and value < low:  # --nnodes MIN:MAX is checked by its own type
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least {low}")


COMMON_FLAGS = {"data_root": "data.root", "accelerator": "trainer.accelerator"}
"""Flags of export onnx and predict, by the config field each sets (the commands that run a recipe take all of
train's: :mod:`gputrain.cli.run_flags`); :func:`common_overrides` turns them into overrides."""


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """The flags in :data:`COMMON_FLAGS`, defined once for every command that runs a recipe."""
    p.add_argument("--data-root", help="dataset folder (data.root)")
    p.add_argument("--accelerator", choices=["auto", "cpu", "cuda"], help="where to run (trainer.accelerator)")


def common_overrides(args: argparse.Namespace) -> list[str]:
    """``data.root='...'``-style overrides for the common flags given (YAML-quoted: any path survives)."""
    given = [(key, getattr(args, name, None)) for name, key in COMMON_FLAGS.items()]
    return [f"{key}='{str(value).replace(chr(39), chr(39) * 2)}'" for key, value in given if value is not None]


class _Version(argparse.Action):
    """``--version``: the versions of torch and torchvision from their metadata, without importing them."""

    def __init__(self, option_strings: Sequence[str], version: str, dest: str = argparse.SUPPRESS,
                 help: str = "print versions and exit") -> None:  # noqa: A002 (argparse's name)
        super().__init__(option_strings=option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)
        self.version = version

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        def of(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "not installed"

        print(f"gputrain {self.version} (torch {of('torch')}, torchvision {of('torchvision')})")  # stdout, as argparse's
        parser.exit()


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,2") from None


def build_parser(description: str, epilog: str, version: str, eval_hidden: Sequence[str],
                 handlers: Mapping[str, Handler]) -> argparse.ArgumentParser:
    """The whole command line; ``handlers`` maps sub-command names to the functions that run them."""
    raw: dict[str, Any] = {"formatter_class": argparse.RawDescriptionHelpFormatter}
    parser = argparse.ArgumentParser(prog="gputrain", description=description, epilog=epilog, **raw)
    parser.add_argument("--version", action=_Version, version=version)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    recipes = ", ".join(builtin_recipes())
    train = sub.add_parser("train", help="train a recipe on 1 process or many",
                           description="Train a recipe. Each run writes config.yaml, metrics.jsonl, checkpoints/ and "
                                       "summary.json into its run folder.")
    train.add_argument("recipe", help=f"built-in recipe ({recipes}) or a YAML file")
    train.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. optim.lr=0.01 'trainer.loggers=[csv]'")
    add_run_flags(train, "train")
    train.set_defaults(func=handlers["train"])

    ev = sub.add_parser("eval", help="evaluate a checkpoint exactly, on any device count",
                        description="Evaluate a checkpoint with the task, model and data settings saved in it "
                                    "(flags and overrides win). Writes eval.json.")
    ev.add_argument("recipe", nargs="?", default=None,
                    help="optional: a recipe for how to run (batch size, strategy); the checkpoint says what it is")
    ev.add_argument("--checkpoint", required=True, help="a checkpoint file, e.g. runs/ae/checkpoints/last.pt")
    ev.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.eval_batch_size=64")
    ev.add_argument("--out", help="folder for eval.json (default: RUN/eval beside the checkpoint's run)")
    ev.add_argument("--weights", choices=["model", "ema"], default="model",
                    help="ema: the moving average of the weights (runs with trainer.ema_decay)")
    ev.add_argument("--overwrite", action="store_const", const=True, default=None,
                    help="replace an eval.json already in --out")
    add_run_flags(ev, "eval", own=("out", "overwrite"), hidden=eval_hidden)
    ev.set_defaults(func=handlers["eval"])

    data = sub.add_parser("data", help="sample data sets").add_subparsers(dest="data_command", required=True)
    make = data.add_parser("make", help="write a small learnable sample set in a real on-disk format")
    make.add_argument("kind", choices=["imagefolder", "classfolder", "cifar10", "ade20k", "coco"])
    make.add_argument("--out", required=True, help="a new or empty folder")
    make.add_argument("--count", type=int, default=None, help="number of images (default: the kind's)")
    make.add_argument("--size", type=int, default=None, help="image side in pixels (default: the kind's)")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=handlers["data make"])

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    scale = bench.add_parser("scale", help="time a recipe over device counts and batch sizes")
    scale.add_argument("recipe")
    scale.add_argument("overrides", nargs="*")
    scale.add_argument("--devices", type=_int_list, default=[1, 2], help="e.g. 1,2")
    scale.add_argument("--batch-size", type=_int_list, default=[64, 128], help="per device, e.g. 64,128")
    scale.add_argument("--epochs", type=int, default=2)
    scale.add_argument("--accelerator", choices=["auto", "cpu", "cuda"], help="where to run (trainer.accelerator)")
    scale.add_argument("--out", default=None, help="folder for scale.json/md/png (default: a new runs/scale-DATE-TIME)")
    scale.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    add_run_flags(scale, "bench scale", own=("devices", "batch_size", "epochs", "accelerator", "out", "overwrite"))
    scale.set_defaults(func=handlers["bench scale"])

    tput = bench.add_parser("throughput", help="training images/s with real and synthetic data, FLOPs, memory")
    tput.add_argument("recipe")
    tput.add_argument("overrides", nargs="*")
    tput.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is not timed")
    tput.add_argument("--json", default=None, help="also write the result to this JSON file")
    tput.add_argument("--out", default=None, help="folder for the two runs (default: a new runs/throughput-DATE-TIME)")
    tput.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    add_run_flags(tput, "bench throughput", own=("epochs", "out", "overwrite"))
    tput.set_defaults(func=handlers["bench throughput"])

    export = sub.add_parser("export", help="export models").add_subparsers(dest="export_command", required=True)
    onnx = export.add_parser("onnx", help="export a checkpoint to ONNX and check it with onnxruntime")
    onnx.add_argument("recipe", nargs="?", default=None,
                      help="optional: the recipe, for a checkpoint without a saved config (one of another model "
                           "is ignored, with a line saying so)")
    onnx.add_argument("overrides", nargs="*", help="dotted overrides of the checkpoint's saved config")
    onnx.add_argument("--checkpoint", required=True)
    onnx.add_argument("--out", required=True, help="the .onnx file to write")
    onnx.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    onnx.add_argument("--input-shape", type=_int_list, default=None, help="e.g. 1,3,80,80 (default: from the data)")
    onnx.add_argument("--opset", type=int, default=18)
    onnx.add_argument("--weights", choices=["model", "ema"], default="model",
                      help="ema: the moving average of the weights (runs with trainer.ema_decay)")
    add_common_flags(onnx)
    onnx.set_defaults(func=handlers["export onnx"])

    pred = sub.add_parser("predict", help="run a checkpoint on image files and write its predictions",
                          description="Predict with a checkpoint's own config and evaluation preprocessing; every "
                                      "image once across processes; rank 0 writes into --out (docs/predict.md).")
    pred.add_argument("overrides", nargs="*", help="dotted overrides of the checkpoint's saved config")
    pred.add_argument("--checkpoint", required=True, help="a checkpoint file, e.g. runs/latest/checkpoints/last.pt")
    pred.add_argument("--input", nargs="+", required=True, help="image files and/or folders of images")
    pred.add_argument("--out", required=True, help="folder for the predictions (a non-empty one needs --overwrite)")
    pred.add_argument("--overwrite", action="store_true", help="replace predictions already in --out")
    pred.add_argument("--weights", choices=["model", "ema"], default="model",
                      help="ema: the moving average of the weights (runs with trainer.ema_decay)")
    pred.add_argument("--annotations", default="", help="detection: the COCO json whose image and category ids to use")
    pred.add_argument("--devices", type=int, help="processes on this node")
    pred.add_argument("--accelerator", choices=["auto", "cpu", "cuda"])
    pred.add_argument("--precision", choices=["auto", "mixed", "32", "16-mixed", "bf16-mixed"])
    pred.add_argument("--batch-size", type=int, help="images per process per forward")
    pred.set_defaults(func=handlers["predict"])

    report = sub.add_parser("report", help="draw curves.png and samples.png of a run folder",
                            description="Write curves.png (loss and metric per epoch, from metrics.jsonl) and "
                                        "samples.png (validation predictions of checkpoints/last.pt) into RUN_DIR.")
    report.add_argument("run_dir", help="a run folder, e.g. runs/latest")
    report.add_argument("--samples", type=int, default=8, help="validation images in samples.png (0: none)")
    report.set_defaults(func=handlers["report"])

    replay = sub.add_parser("replay", help="rerun the step a run went NaN/inf on, from its nonfinite/ folder",
                            description="Rerun, in this process, the training step a run went NaN/inf on, from the "
                                        "nonfinite/ folder it wrote (the state before the step and each rank's "
                                        "micro-batches), and print the report: the first module, the rank, the "
                                        "samples, whether float32 removes it, and the fix (docs/precision.md).")
    replay.add_argument("bundle", help="RUN_DIR/nonfinite (or the run folder)")
    replay.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu",
                        help="where to replay (default cpu: any machine)")
    replay.set_defaults(func=handlers["replay"])

    _add_tools(sub, handlers)
    return parser


def _add_tools(sub: Any, handlers: Mapping[str, Handler]) -> None:
    """parity, doctor and env: the diagnostic tools."""
    p = sub.add_parser("parity", help="train a few steps in several modes and compare losses and weights")
    p.add_argument("recipe", help="built-in recipe or a YAML file (its task may name package.module:function)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.sync_batchnorm=true")
    p.add_argument("--modes", type=lambda s: [x for x in s.split(",") if x], default=list(PARITY_MODES),
                   help=f"comma-separated, from {','.join(PARITY_MODES)} (default: all)")
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step (default: "
                                                                   "trainer.batch_size); even")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per epoch")
    p.add_argument("--epochs", type=int, default=2, help="epochs (2 crosses an epoch boundary)")
    p.add_argument("--tol", type=float, default=1e-5, help="largest allowed |loss| and |weight| difference")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait (a hung mode fails)")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="float64 (default) compares the arithmetic without rounding noise; float32 as trained")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    add_run_flags(p, "parity", own=("epochs",))
    p.set_defaults(func=handlers["parity"])

    p = sub.add_parser("doctor", help="dry-run a recipe on real ranks and report distributed mistakes")
    p.add_argument("recipe", help="built-in recipe or a YAML file (its task may name package.module:function)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.batch_size=8")
    p.add_argument("--devices", type=int, default=None, help="ranks of the dry run (default: the recipe's, at least 2)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per epoch; the dry run has 2 epochs")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait before the run is "
                                                               "declared hung")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    add_run_flags(p, "doctor", own=("devices",))
    p.set_defaults(func=handlers["doctor"])

    p = sub.add_parser("plan", help="predict memory per device and step time of every way to run a recipe, and choose",
                       description="Predict, before the run, the peak memory of each device and the step time of "
                                   "single, ddp, fsdp, pipeline (gpipe, 1f1b) and model_parallel for the recipe as "
                                   "configured, and choose the fastest that fits (docs/plan.md).")
    p.add_argument("recipe", help="built-in recipe or a YAML file")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.image_size=1024")
    p.add_argument("--devices", type=int, default=None, help="devices per node (default: the recipe's trainer.devices)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (ddp and fsdp plans only)")
    p.add_argument("--memory-budget", default="", help="bytes per device: 12GiB, 800MB, 1e9 is not; default: the "
                                                       "GPU's free memory, or the available RAM on a CPU")
    p.add_argument("--json", default="", metavar="FILE", help="also write the plans as JSON")
    add_run_flags(p, "plan", own=("devices", "nnodes", "memory_budget"))
    p.set_defaults(func=handlers["plan"])

    p = sub.add_parser("env", help="versions, devices, topology, distributed variables and backends")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=handlers["env"])


PARITY_MODES = MODE_NAMES
"""The modes of ``gputrain parity``: one per registered strategy, and gradient accumulation."""
