"""What each speed option buys: training images/s of one recipe on synthetic data, option by option.

Variants (each a short ``gputrain train`` run with ``data.synthetic=true``, the model's speed without its input):

  * ``off``: every option off (``trainer.precision=32``, no channels-last, no cuDNN autotuner, unfused optimizer);
  * ``auto``: the defaults (on a GPU: bf16, channels-last, cudnn.benchmark, fused optimizer);
  * ``auto+compile``: the defaults with ``trainer.compile=true`` (compile time reported apart);
  * and, with ``--each``, ``auto`` minus one option at a time, to see what that option is worth.

Variants run in rotated order over ``--reps`` rounds (no variant always first); images/s is the median of
the epochs after the first, and each variant's ratio to ``off`` is the median of per-round ratios.

    python benchmarks/fast_path.py imagefolder-resnet50 --data-root data/classes --epochs 3 --reps 3 \\
        trainer.batch_size=256 data.image_size=224 --json fast_path.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from pathlib import Path

from gputrain.tools.bench.throughput import _run, steady

OFF = ["trainer.precision=32", "trainer.channels_last=false", "trainer.cudnn_benchmark=false", "optim.fused=false"]
WITHOUT = {"bf16": "trainer.precision=32", "channels_last": "trainer.channels_last=false",
           "cudnn_benchmark": "trainer.cudnn_benchmark=false", "fused": "optim.fused=false"}


def variants(each: bool) -> dict[str, list[str]]:
    out = {"off": OFF, "auto": [], "auto+compile": ["trainer.compile=true"]}
    if each:
        out |= {f"auto-{name}": [override] for name, override in WITHOUT.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every variant (trainer.batch_size=256)")
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--each", action="store_true", help="also run the defaults minus one option at a time")
    parser.add_argument("--json")
    args = parser.parse_intermixed_args()
    runs = variants(args.each)
    names = list(runs)
    ips: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    compile_s: list[float] = []
    summary: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]
            this: dict[str, float] = {}
            for name in order:
                out = Path(tmp) / f"{rep}-{name}"
                overrides = [f"data.root={args.data_root}", *args.overrides, *runs[name]]
                summary, epochs = _run(args.recipe, out, overrides, epochs=args.epochs, synthetic=True)
                this[name] = steady(epochs, "train/images_per_s")[0] or 0.0
                ips[name].append(this[name])
                if name == "auto+compile" and summary.get("first_step_s") is not None and this[name]:
                    compile_s.append(summary["first_step_s"] - summary["batch_size_per_device"] / this[name])
                print(f"round {rep + 1} {name}: {this[name]:,.1f} images/s ({summary['precision']}, "
                      f"fast={summary.get('fast')})", flush=True)
            for name in names:
                ratios[name].append(this[name] / this["off"] if this["off"] else 0.0)
    result = {
        "date": datetime.date.today().isoformat(), "recipe": args.recipe, "overrides": args.overrides,
        "device": summary.get("device"), "reps": args.reps,
        "images_per_s": {n: statistics.median(v) for n, v in ips.items()},
        "ratio_to_off": {n: statistics.median(v) for n, v in ratios.items()},
        "compile_s": statistics.median(compile_s) if compile_s else None,
    }
    print("\n| variant | images/s (median) | x off (median of per-round ratios) |\n|---|---|---|")
    for name in names:
        print(f"| {name} | {result['images_per_s'][name]:,.1f} | {result['ratio_to_off'][name]:.2f} |")
    print(f"compile time (first step - a steady step): {result['compile_s']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
