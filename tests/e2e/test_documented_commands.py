"""Every ``gputrain`` command in README.md and docs/ works as written, run with tiny overrides (issue 28 item 5).

The README's 1F1B command failed for a new user (it needs 2 micro-batches). So each page's shell blocks are
read, and their ``gputrain`` commands run in order, in a sandbox of small sample data, through the command
line's own ``main`` in this process:

* ``train``, ``eval`` and ``predict`` pass every check of the launcher with the documented device and node
  counts (config, strategy options, paths, checkpoint, run folder); the job itself then runs in this process as
  one rank, for one step of each epoch on 32x32 images (a ResNet-18 where the recipe has a ResNet-50:
  :data:`SMALLER_MODEL`), so later commands find the run folders the page expects (``runs/latest``, ``runs/ae``);
* ``data make`` writes into a scratch folder; ``export``, ``report``, ``env`` run as they are;
* ``parity``, ``doctor`` and ``bench`` pass their checks of the recipe and stop before starting their ranks
  (what those do is tested in their own files);
* a command printed with ``$ `` and followed by its output must print that output (documented errors are the
  exact line the user sees).

Commands that cannot run on this machine say why in :data:`SKIPPED` (a GPU, the network, files of the reader).
"""

from __future__ import annotations

import functools
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import gputrain.cli.commands as cli_commands
from gputrain.cli import main as cli_main
from gputrain.tools.make_data import make_dataset

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SKIPPED = {
    "...": "an elided command",
    "COMMAND": "a placeholder",
    "data.download=true": "downloads the data set (tested against a local HTTP server in test_download.py)",
    "model.weights=DEFAULT": "downloads weights (tested against a prepared cache in test_pretrained.py)",
    "model.weights=IMAGENET1K_V1": "downloads weights (tested against a prepared cache in test_pretrained.py)",
    "model.weights=COCO_V1": "downloads weights (tested against a prepared cache in test_pretrained.py)",
    "model.weights=a1_in1k": "downloads timm's weights (tested against a prepared Hugging Face cache in test_timm.py)",
    "/data/resnet50.safetensors": "a file on the reader's machine",
    "wandb_mode=online": "needs a Weights & Biases account",
    "/models/": "a file on the reader's machine",
    "/elsewhere/": "a folder on the reader's machine",
    "/data/ade20k-val-copy": "a folder on the reader's machine",
    "/shared/": "storage shared by the reader's nodes",
    "my_images": "a folder on the reader's machine",
    "photos/": "a folder on the reader's machine",
    "mine.yaml": "a recipe the page shows only in part",
    "my_recipe.yaml": "a recipe of the reader's",
    "tiny-ae.yaml": "a recipe of the reader's (with their own model code)",
    "toy-classifier.yaml": "a recipe of the reader's (with their own model code)",
    "--accelerator cuda": "needs a GPU",
    "/data/imagenet": "ImageNet on the reader's machine",
}
"""Commands containing these words are not run, for the reason given."""

BEFORE = {
    "docs/cli.md": ["train autoencoder --out runs/ae"],
    "docs/config.md": ["train autoencoder --out runs/ae"],
    "docs/evaluation.md": ["train autoencoder --out runs/ae", "train cifar10-resnet18 --out runs/cifar",
                           "train ade20k-deeplabv3plus --out runs/ade data.num_classes=8",
                           "train coco-maskrcnn --out runs/coco"],
    "docs/export.md": ["train autoencoder --out runs/ae", "train cifar10-resnet18 --out runs/cifar"],
    "docs/index.md": [],
    "docs/predict.md": ["train ade20k-deeplabv3plus data.num_classes=8"],
    "docs/report.md": ["train autoencoder"],
}
"""The runs a page takes as made (on other pages) before its own commands."""

COMMANDS = ("train", "eval", "data", "bench", "export", "predict", "report", "replay", "parity", "doctor", "plan", "env",
            "COMMAND")
IMAGE_SIZE = {"autoencoder": 40, "coco-maskrcnn": 0}
"""Side of the images a run trains on (the conv autoencoder pools by 20; Mask R-CNN keeps the sample's 64)."""
MASK_RCNN_TINY = ["model.kwargs.min_size=64", "model.kwargs.max_size=64",
                  # As in test_recipes.py: 16 sampled RoIs per image instead of 512, RPN proposals for 64 px
                  # images instead of 800 px ones, and at most 10 detections per image (the samples hold at most
                  # 4 objects) instead of 100 whose masks each evaluation pastes and encodes: a quarter of the time.
                  "model.kwargs.box_batch_size_per_image=16", "model.kwargs.box_detections_per_img=10",
                  "model.kwargs.rpn_pre_nms_top_n_train=300", "model.kwargs.rpn_post_nms_top_n_train=100",
                  "model.kwargs.rpn_pre_nms_top_n_test=300", "model.kwargs.rpn_post_nms_top_n_test=100"]
"""Mask R-CNN resizes every image to its own bounds (512 in the recipe), whatever the files' size; the rest shrink
its heads to the sample's few small objects (eval and predict read them from the checkpoint's saved config)."""
RESNET18 = ("model.name=resnet18", "model.kwargs.cifar_stem=false")  # with ResNet-50's stem (8x8 maps into layer1)
SMALLER_MODEL = {"imagefolder-resnet50": RESNET18, "resnet50-model-parallel": RESNET18,
                 "ade20k-deeplabv3plus": ("model.kwargs.backbone=resnet18",),
                 "coco-maskrcnn": ("model.kwargs.backbone=resnet18",)}
"""A ResNet-18 for a recipe's ResNet-50 (the model; for DeepLabv3+ and Mask R-CNN the backbone, as docs/recipes.md
runs them on a CPU), unless the command names its own: the same code paths for every flag, strategy and tool, with
under half the layers, which is what costs here: a plan counts every layer on fake tensors for a dozen plans (a
ResNet-50's took a minute), the exporter traces every one. The recipes' own models train in test_gpu_check.py."""
TRAIN_TINY = ("trainer.max_steps_per_epoch=1", "trainer.progress_bar=false", "trainer.pictures=0",
              "data.num_workers=0")


@dataclass(frozen=True)
class Documented:
    where: str
    argv: tuple[str, ...]
    output: tuple[str, ...]
    """What the page shows the command printing (after a ``$ `` prompt), or nothing."""


@functools.cache  # read once: several tests and checks read every page
def _commands(page: Path) -> list[Documented]:
    lines, found, in_block, i = page.read_text().splitlines(), [], False, 0
    while i < len(lines):
        text = lines[i].strip()
        if text.startswith("```"):
            in_block = not in_block
        elif in_block and (text.startswith("gputrain ") or text.startswith("$ gputrain ")):
            start, command = i, text.removeprefix("$ ")
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            output = []
            while text.startswith("$ ") and i + 1 < len(lines) and lines[i + 1].strip() \
                    and not lines[i + 1].startswith(("$ ", "```")):
                i += 1
                output.append(lines[i].strip())
            argv = tuple(shlex.split(command, comments=True)[1:])
            if argv[-1:] == ("&",):  # started in the background, as a page does for a second node
                argv = argv[:-1]
            if argv and (argv[0] in COMMANDS or argv[0].startswith("-")):  # not output such as "gputrain parity: ..."
                found.append(Documented(f"{page.relative_to(ROOT)}:{start + 1}", argv, tuple(output)))
        i += 1
    return found


def _skip_reason(command: Documented) -> str:
    text = " ".join(command.argv)
    return next((why for word, why in SKIPPED.items() if word in text), "")


def _shown_before(command: Documented) -> str:
    """Where an earlier page shows the same ``plan`` command, which runs it there (a plan writes nothing a page's
    later commands read, and a split model's takes tens of seconds of this suite). Other commands make run folders
    that their page goes on with, so they run wherever they are shown."""
    if command.argv[:1] != ("plan",):
        return ""
    first = next(c for page in PAGES for c in _commands(page) if c.argv == command.argv and c.output == command.output)
    return first.where if first.where.split(":")[0] != command.where.split(":")[0] else ""


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("documented") / "data"
    for kind, out, count, size in (("imagefolder", "frames", 16, 40), ("classfolder", "classes", 24, 32),
                                   ("cifar10", "cifar10", 12, 0), ("ade20k", "ade20k", 10, 32),
                                   ("coco", "coco", 10, 64)):
        make_dataset(kind, data / out, count=count, size=size)
    return data


class _Recorded(Exception):
    """A tool that starts ranks of its own stops here, after the command line's checks."""


def _recorded(*args, **kwargs):
    return 0


def _tiny(argv: tuple[str, ...], scratch: Path) -> list[str]:
    """The documented command with the overrides that make it tiny (dotted overrides win over flags)."""
    argv = list(argv)
    if argv[:1] == ["train"]:
        epochs = [] if "--epochs" in argv or any(a.startswith("trainer.epochs=") for a in argv) else ["trainer.epochs=1"]
        size = IMAGE_SIZE.get(argv[1], 0 if argv[1].endswith(".yaml") else 32)  # a saved config keeps its own
        small = [f"data.image_size={size}"] if size else MASK_RCNN_TINY if argv[1] == "coco-maskrcnn" else []
        return [*argv, *TRAIN_TINY, *epochs, *small, *_smaller_model(argv)]
    if argv[:1] == ["plan"]:  # a real plan, at a size a CPU times in seconds
        size = IMAGE_SIZE.get(argv[1], 32)
        return [*argv, *([f"data.image_size={size}"] if size else []), *_smaller_model(argv)]
    if argv[:2] == ["data", "make"]:
        out = argv.index("--out") + 1
        argv[out] = str(scratch / argv[out])  # the sandbox has its sample data already
        return [*argv, "--count", "12", "--size", "32"]
    return argv


def _smaller_model(argv: list[str]) -> list[str]:
    overrides = SMALLER_MODEL.get(argv[1], ())
    named = any(a.startswith(o.partition("=")[0] + "=") for o in overrides for a in argv)  # the command's own model
    return [] if named else list(overrides)


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli_main(argv)
    except SystemExit as exit_:  # --help, --version and usage errors leave through argparse
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _as_one_process(cfg, worker_argv, run):
    """The launcher's hand-over: after every check of the real device and node counts, the job as one rank."""
    cfg.trainer.devices, cfg.launch.nnodes, cfg.launch.node_rank = 1, 1, 0
    run(cfg)
    return 0


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_documented_command_runs_as_written(page, sample_data, tmp_path, monkeypatch, capsys):
    commands = _commands(page)
    if not commands:
        pytest.skip(f"{page.name} shows no gputrain command")
    sandbox = tmp_path / "sandbox"
    shutil.copytree(sample_data, sandbox / "data")
    monkeypatch.chdir(sandbox)
    monkeypatch.setattr(cli_commands, "_launch_or_run", _as_one_process)
    monkeypatch.setattr("gputrain.tools.diagnose.parity.cmd_parity", _recorded)
    monkeypatch.setattr("gputrain.tools.diagnose.doctor.cmd_doctor", _recorded)
    monkeypatch.setattr("gputrain.tools.bench.scale.scale_bench", _recorded)
    monkeypatch.setattr("gputrain.tools.bench.throughput.run_bench_throughput", _recorded)
    name = str(page.relative_to(ROOT))
    for setup in BEFORE.get(name, []):
        code, _, err = _run(_tiny(tuple(shlex.split(setup)), tmp_path), capsys)
        assert code == 0, f"{name} expects `gputrain {setup}` to have run: {err[-1500:]}"
    failures = []
    for i, command in enumerate(commands):
        if _skip_reason(command) or _shown_before(command):
            continue
        # A command shown with its output runs as printed; the others with the overrides that make them tiny.
        argv = list(command.argv) if command.output else _tiny(command.argv, tmp_path / "scratch" / str(i))
        code, out, err = _run(argv, capsys)
        shown = f"{command.where}: gputrain {shlex.join(command.argv)}"
        errors = [line for line in err.splitlines() if line.startswith("gputrain: error:")]
        if command.output:
            printed = [line.strip() for line in (out + err).splitlines()]
            missing = [line for line in command.output if line not in printed]
            if missing:
                failures.append(f"{shown}\n    printed {printed[-3:]}\n    documented {missing}")
        elif code != 0:
            failures.append(f"{shown}\n    exit {code}: {(errors or err.splitlines() or [''])[-1]}")
        assert "Traceback" not in err, f"{shown}\n{err[-3000:]}"
    assert not failures, "documented commands that do not work as written:\n" + "\n".join(failures)


def test_the_pages_show_commands_and_the_skips_are_few():
    """The reader of this test sees what is not run, and the list cannot swallow a page."""
    commands = [c for page in PAGES for c in _commands(page)]
    skipped = [c for c in commands if _skip_reason(c)]
    assert len(commands) > 100 and len(skipped) < len(commands) // 4, [c.where for c in skipped]
    assert sum(c.where.startswith("README.md") for c in commands) >= 14  # the README's whole tour is read
    plans = [c for c in commands if c.argv[:1] == ("plan",)]
    assert {c.argv for c in plans if not _shown_before(c)} == {c.argv for c in plans}  # each plan runs on one page
