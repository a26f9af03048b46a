"""The ``gputrain`` command: parse, build, run. One function per sub-command; the work lives elsewhere."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from gputrain.config import builtin_recipes, load_config
from gputrain.launch import LaunchSpec, run_torchrun

# Flags that are shorthands for config fields; everything else is a dotted key=value override.
TRAIN_FLAGS = {
    "devices": "trainer.devices", "strategy": "trainer.strategy", "accelerator": "trainer.accelerator",
    "precision": "trainer.precision", "epochs": "trainer.epochs", "batch_size": "trainer.batch_size",
    "seed": "trainer.seed", "out": "trainer.out", "resume": "trainer.resume", "data_root": "data.root",
    "nnodes": "launch.nnodes", "node_rank": "launch.node_rank", "rdzv_endpoint": "launch.rdzv_endpoint",
    "max_restarts": "launch.max_restarts",
}


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help=f"built-in recipe ({', '.join(builtin_recipes())}) or a YAML file")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. optim.lr=0.01 trainer.loggers=[csv]")
    p.add_argument("--devices", type=int, help="processes on this node (ddp); GPUs are one per process")
    p.add_argument("--strategy", choices=["single", "ddp", "dp"])
    p.add_argument("--accelerator", choices=["auto", "cpu", "cuda"])
    p.add_argument("--precision", choices=["32", "16-mixed", "bf16-mixed"])
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="per device; the global batch is printed at start")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", help="run folder (config.yaml, metrics.jsonl, checkpoints/, summary.json)")
    p.add_argument("--resume", help="auto (OUT/checkpoints/last.pt if present) or a checkpoint path")
    p.add_argument("--data-root", help="dataset folder (data.root)")
    p.add_argument("--nnodes", type=int, help="nodes in the job (torchrun rendezvous)")
    p.add_argument("--node-rank", type=int)
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous for multi-node jobs")
    p.add_argument("--max-restarts", type=int, help="torchrun elastic restarts")


def _overrides(args: argparse.Namespace) -> list[str]:
    flags = [f"{key}={getattr(args, name)}" for name, key in TRAIN_FLAGS.items()
             if getattr(args, name, None) is not None]
    return flags + list(args.overrides)


def _launch_or_run(args: argparse.Namespace, argv: Sequence[str], run) -> int:  # noqa: ANN001
    cfg = load_config(args.recipe, _overrides(args))
    nproc = 1 if cfg.trainer.strategy == "dp" else cfg.trainer.devices
    spec = LaunchSpec(nproc_per_node=nproc, nnodes=cfg.launch.nnodes, node_rank=cfg.launch.node_rank,
                      rdzv_endpoint=cfg.launch.rdzv_endpoint, rdzv_id=cfg.launch.rdzv_id,
                      max_restarts=cfg.launch.max_restarts)
    if spec.needs_launch:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        try:
            run_torchrun(spec, "gputrain", argv)  # the workers run this same command line and join
        except ChildFailedError as err:
            failed = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(err.failures.items()))
            print(f"gputrain: {failed} failed; the workers' own errors are printed above", file=sys.stderr)
            return 1
        return 0
    run(cfg, args)
    return 0


def cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.train import train_from_config

    return _launch_or_run(args, argv, lambda cfg, _: train_from_config(cfg))


def cmd_eval(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.evaluate import evaluate_from_config

    return _launch_or_run(args, argv, lambda cfg, a: evaluate_from_config(cfg, a.checkpoint))


def cmd_data_make(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.make_data import make_dataset

    print(make_dataset(args.kind, args.out, size=args.size, count=args.count, seed=args.seed))
    return 0


def cmd_bench_scale(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.scale import scale_bench

    scale_bench(args.recipe, devices=args.devices, batch_sizes=args.batch_size, out=args.out,
                overrides=list(args.overrides), accelerator=args.accelerator, epochs=args.epochs)
    return 0


def cmd_export_onnx(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gputrain.tools.export import export_onnx

    export_onnx(args.checkpoint, args.out, input_shape=args.input_shape, opset=args.opset)
    return 0


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gputrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a recipe on 1 process or many")
    _add_run_flags(train)
    train.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="evaluate a checkpoint exactly, on any device count")
    _add_run_flags(ev)
    ev.add_argument("--checkpoint", required=True)
    ev.set_defaults(func=cmd_eval)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    make = data.add_parser("make", help="write a small learnable sample set in a real on-disk format")
    make.add_argument("kind", choices=["imagefolder", "classfolder", "cifar10", "ade20k", "coco"])
    make.add_argument("--out", required=True)
    make.add_argument("--count", type=int, default=0, help="number of images (0: the kind's default)")
    make.add_argument("--size", type=int, default=0, help="image side in pixels (0: the kind's default)")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=cmd_data_make)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    scale = bench.add_parser("scale", help="time a recipe over device counts and batch sizes")
    scale.add_argument("recipe")
    scale.add_argument("overrides", nargs="*")
    scale.add_argument("--devices", type=_int_list, default=[1, 2], help="e.g. 1,2")
    scale.add_argument("--batch-size", type=_int_list, default=[64, 128], help="per device, e.g. 64,128")
    scale.add_argument("--epochs", type=int, default=2)
    scale.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    scale.add_argument("--out", default="runs/scale")
    scale.set_defaults(func=cmd_bench_scale)

    export = sub.add_parser("export", help="export models").add_subparsers(dest="export_command", required=True)
    onnx = export.add_parser("onnx", help="export a checkpoint to ONNX and check it with onnxruntime")
    onnx.add_argument("--checkpoint", required=True)
    onnx.add_argument("--out", required=True)
    onnx.add_argument("--input-shape", type=_int_list, default=None, help="e.g. 1,3,80,80 (default: from the data)")
    onnx.add_argument("--opset", type=int, default=18)
    onnx.set_defaults(func=cmd_export_onnx)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        # Recipes name user code as package.module:function; find it in the working directory as
        # `python -m gputrain` (what torchrun workers run) does, so 1 and N processes behave alike.
        sys.path.insert(0, os.getcwd())
    parser = build_parser()
    # Dotted overrides may come after flags; argparse cannot mix a nargs="*" positional with
    # flags under sub-commands, so collect leftovers of the form key=value ourselves.
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if x.startswith("-") or "=" not in x]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        if not hasattr(args, "overrides"):
            parser.error(f"{args.command} takes no key=value overrides: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args, argv)
    except (ValueError, FileNotFoundError) as err:
        # Bad input: our messages name the file or field and say how to fix it; a traceback
        # would bury that line. GPUTRAIN_DEBUG=1 shows it anyway.
        if os.environ.get("GPUTRAIN_DEBUG"):
            raise
        print(f"gputrain: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
