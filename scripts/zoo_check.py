"""The slow tier of issue 40: every torchvision model gputrain accepts builds for a task's data and trains one step.

    .venv/bin/python scripts/zoo_check.py                     # all three kinds, one markdown table
    .venv/bin/python scripts/zoo_check.py --kind detection    # one kind
    .venv/bin/python scripts/zoo_check.py -k efficientnet     # names containing this

Each model is built as a task builds it (``build_configured_model``: the data's classes, the kwargs derived from the
input size), at the smallest input it takes here: classification at 32 px (a larger side where its weights state a
floor, MaxViT at 224), detection and segmentation at 64 px. One SGD step on 2 random images, then the loss must be
finite and some weight must have moved. A refusal counts as passed when it is the one-line refusal of the input
floor. Exit 1 when any model failed. Not part of ``make test``: every model costs about 1 to 60 s here.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from gputrain.config import ModelConfig
from gputrain.models import build_configured_model
from gputrain.models.zoo import KIND_MODULES, UNSUPPORTED, _min_size, names
from gputrain.tasks.segmentation import SegmentationTask


def _side(name: str, kind: str) -> int:
    if kind != "classification":
        return 64
    if name.startswith("maxvit_"):
        return 224  # 7x7 partitions at each of 4 scales
    if name.startswith("vit_h_14"):
        return 28  # a multiple of its 14 px patch
    if name.startswith(("vit_", "swin_")):
        return 32
    return max(32, *_min_size(name))


def _step(name: str, kind: str) -> tuple[int, float]:
    side = _side(name, kind)
    torch.manual_seed(0)
    extra = {"min_size": side, "max_size": side} if kind == "detection" and not name.startswith("ssd") else {}
    cfg = ModelConfig(name=name, kwargs=extra)
    model = build_configured_model(cfg, "", kind=kind, num_classes=3, input_size=(side, side))
    images = torch.rand(2, 3, side, side)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    start = time.perf_counter()
    if kind == "classification":
        loss = torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 2]))
    elif kind == "detection":
        box = torch.tensor([[4.0, 4.0, side / 2, side / 2]])
        targets = [{"boxes": box, "labels": torch.tensor([1]),
                    "masks": torch.zeros(1, side, side, dtype=torch.uint8)} for _ in range(2)]
        loss = sum(model(list(images), targets).values())
    else:
        loss = SegmentationTask(3).loss(model(images), torch.randint(0, 3, (2, side, side)))
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    if not torch.isfinite(loss):
        raise RuntimeError(f"loss {float(loss)}")
    if all(torch.equal(a, p) for a, p in zip(before, [p for p in model.parameters() if p.requires_grad], strict=True)):
        raise RuntimeError("no weight moved")
    return side, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=sorted(KIND_MODULES), action="append")
    parser.add_argument("-k", default="", help="only names containing this text")
    args = parser.parse_args()
    torch.set_num_threads(2)
    failed = 0
    print("| kind | name | input | params | step s | result |\n|---|---|---|---|---|---|", flush=True)
    for kind in args.kind or list(KIND_MODULES):
        for name in names(kind):
            if args.k not in name:
                continue
            if name in UNSUPPORTED:
                print(f"| {kind} | {name} | - | - | - | refused: {UNSUPPORTED[name].split(';')[0]} |", flush=True)
                continue
            try:
                side, seconds = _step(name, kind)
                params = sum(p.numel() for p in build_configured_model(
                    ModelConfig(name=name), "", kind=kind, num_classes=3, input_size=(side, side)).parameters())
                print(f"| {kind} | {name} | {side} | {params / 1e6:.1f} M | {seconds:.1f} | trains |", flush=True)
            except Exception as err:  # noqa: BLE001 - every failure is a row, and the script goes on
                failed += 1
                print(f"| {kind} | {name} | - | - | - | FAILED: {type(err).__name__}: {str(err).splitlines()[0]} |",
                      flush=True)
                traceback.print_exc(file=sys.stderr)
    print(f"\n{failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
