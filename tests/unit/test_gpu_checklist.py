"""The GPU checklist's verdicts (``scripts/gpu_checklist.py``), on the files real runs and real pytest runs write.

A finished run passes and its row gives its loss, images/s and peak memory; a run whose metrics.jsonl holds a
NaN loss (written as ``null``), or that ended with exit 3, fails and its row names the recipe; the CUDA tests
fail when one fails or when none ran (every one skipped: torch saw no GPU). ``tests/e2e/test_gpu_check.py``
runs the whole ``scripts/gpu_check.sh`` on a CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from autoencoder_runs import _train

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checklist.py"


def _checklist(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def _row(table: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(f"| {name} |"))


def test_a_finished_run_passes_and_a_nan_loss_fails_the_checklist_naming_the_recipe(tmp_path):
    """Planted fault (make mutants): a loss written as null (NaN) counted as finite."""
    run = tmp_path / "run"
    _train(str(run), "single", 1, batch_size=16)
    out = tmp_path / "out"
    assert _checklist("recipe", "autoencoder", run, "--out", out, "--setting", "64 images").returncode == 0
    done = _checklist("table", out)
    assert done.returncode == 0, done.stdout
    row = _row(done.stdout, "autoencoder")
    summary = json.loads((run / "summary.json").read_text())
    assert f"finite, last {summary['final']['train/loss']:.3g}" in row and row.endswith("| pass |")
    assert "64 images; precision=32 batch=16 epochs=2 device=cpu" in row
    assert f"| {summary['peak_memory_bytes'] / 2**30:.1f} |" in row
    assert "1 check(s): 1 passed, 0 failed, 0 skipped" in done.stdout

    # The same run with the last logged loss made NaN, as gputrain writes it (null), recorded as another recipe.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    records[-1]["train/loss"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _checklist("recipe", "cifar10-resnet18", run, "--out", out)
    done = _checklist("table", out)
    assert done.returncode == 1
    assert "| NaN/inf |" in _row(done.stdout, "cifar10-resnet18")
    assert "**FAIL**: a logged loss is NaN/inf" in _row(done.stdout, "cifar10-resnet18")
    assert _row(done.stdout, "autoencoder").endswith("| pass |")
    assert "2 check(s): 1 passed, 1 failed, 0 skipped" in done.stdout


def test_a_run_that_exits_non_zero_fails_with_its_error_line_and_a_rerun_replaces_its_row(tmp_path):
    run = tmp_path / "run"
    _train(str(run), "single", 1, batch_size=16)
    log = tmp_path / "log"
    log.write_text("epoch 1: train/loss=4.9e+07\ngputrain: error: the weights became NaN/inf at epoch 2 step 8\n")
    first, second = tmp_path / "first", tmp_path / "second"
    _checklist("recipe", "coco-maskrcnn", run, "--out", first, "--exit-code", 3, "--log", log)
    _checklist("mark", "CUDA tests", "skipped", "--why", "no GPU", "--out", first)
    done = _checklist("table", first)
    assert done.returncode == 1
    assert ("| NaN/inf |" in _row(done.stdout, "coco-maskrcnn") and "**FAIL**: exit 3 (diverged: NaN/inf): gputrain: "
            "error: the weights became NaN/inf at epoch 2 step 8 |" in _row(done.stdout, "coco-maskrcnn"))
    assert _row(done.stdout, "CUDA tests").endswith("| skipped: no GPU |")
    # A partial rerun in another command's folder: the table of both keeps the newest row of each check.
    _checklist("recipe", "coco-maskrcnn", run, "--out", second)
    done = _checklist("table", first, second)
    assert done.returncode == 0 and _row(done.stdout, "coco-maskrcnn").endswith("| pass |")
    assert _checklist("table", tmp_path / "nothing").returncode == 1  # no check at all is not a pass
    # A run that replayed its failing step (issue 41): the row is the replay's report, and where its bundle is.
    (run / "nonfinite").mkdir()
    (run / "nonfinite" / "report.txt").write_text("replay of step 3 (epoch 1) at precision 16-mixed: the first "
                                                  "non-finite value is in aspp (ASPP): its output became inf\n")
    _checklist("recipe", "ade20k-deeplabv3plus 16-mixed", run, "--out", first, "--exit-code", 3, "--log", log)
    row = _row(_checklist("table", first).stdout, "ade20k-deeplabv3plus 16-mixed")
    assert ("**FAIL**: exit 3 (diverged: NaN/inf); replay of step 3 (epoch 1) at precision 16-mixed: the first "
            f"non-finite value is in aspp (ASPP): its output became inf (gputrain replay {run / 'nonfinite'}) |") in row


def _pytest_report(folder: Path, body: str) -> tuple[Path, int]:
    folder.mkdir()
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_gpu.py").write_text("import pytest\n\n" + body)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
                           str(folder / "report.xml"), str(folder)], cwd=folder, capture_output=True, timeout=120)
    return folder / "report.xml", done.returncode


def test_the_cuda_tests_fail_when_one_fails_or_none_ran(tmp_path):
    """Planted fault (make mutants): every CUDA test skipped (torch saw no GPU) counted as a pass."""
    skip = "@pytest.mark.skip(reason='needs 2 GPUs')\ndef test_two():\n    pass\n"
    cases = {
        "passed": ("def test_one():\n    pass\n\n" + skip, "| pass: 1 passed, 1 skipped |"),
        "failed": ("def test_one():\n    assert False\n\n" + skip,
                   "| **FAIL**: 1 failed, 1 skipped: test_gpu::test_one |"),
        "none_ran": (skip, "| **FAIL**: 1 skipped: no CUDA test ran (does torch see the GPU?) |"),
    }
    for case, (body, result) in cases.items():
        report, code = _pytest_report(tmp_path / case, body)
        out = tmp_path / f"out_{case}"
        _checklist("tests", report, "--exit-code", code, "--out", out)
        done = _checklist("table", out)
        assert done.returncode == (0 if case == "passed" else 1), case
        assert _row(done.stdout, "CUDA tests").endswith(result), done.stdout


def test_a_16_mixed_run_says_how_many_steps_the_loss_scaler_skipped(tmp_path):
    """A 16-mixed run logs train/loss_scale, and train/skipped_steps once a step was skipped: the row sums them."""
    run = tmp_path / "run"
    _train(str(run), "single", 1, batch_size=16)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "lr" in r]
    assert len(steps) >= 2
    for i, r in enumerate(steps):
        r |= {"train/loss_scale": 65536.0 / 2 ** min(i + 1, 2), "train/skipped_steps": 1.0 if i < 2 else 0.0}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    _checklist("recipe", "ade20k-deeplabv3plus 16-mixed", run, "--out", out)
    row = _row(_checklist("table", out).stdout, "ade20k-deeplabv3plus 16-mixed")
    assert "; 2 step(s) skipped, scale 16384 |" in row and row.endswith("| pass |")


def _planned_run(folder: Path, device: str, *, predicted: int, peak: int, step_s: float | None,
                 compute_s: float, waited: float = 0.0) -> Path:
    """The files a plan's run writes (metrics.jsonl, summary.json with its pace, memory.json), with planted figures:
    batches of 32, 8 loader workers, ``waited``: the share of each step spent waiting for data."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train/loss": 0.5}) + "\n")
    pace = {"steps": 20, "step_s": compute_s, "compute_s": compute_s, "data_wait_share": waited, "num_workers": 8,
            "reader_images_per_s": 190.0}
    if step_s is not None:
        pace |= {"predicted_step_s": step_s, "step_prediction_off": round(step_s / compute_s - 1, 4)}
    (folder / "summary.json").write_text(json.dumps({"device": device, "pace": pace, "batch_size_per_device": 32}))
    rank = {"rank": 0, "peak_bytes": peak, "how": "torch.cuda.max_memory_allocated", "predicted_bytes": predicted,
            "prediction_off": round(predicted / peak - 1, 4)}
    (folder / "memory.json").write_text(json.dumps({"ranks": [rank]}))
    return folder


def test_a_plans_check_holds_memory_to_10_percent_and_a_gpus_step_time_to_20(tmp_path):
    """The plan part's verdicts on a GPU's figures: memory 8 % and step 15 % off pass, memory 12 % or step 25 % off
    fail and say which; a CPU's step time is shown, not judged; a run not handed the predictions fails."""
    gib = 2**30
    cases = {"close": ("cuda:0", 108 * gib // 100, 100 * gib // 100, 0.115, 0.1),
             "memory off": ("cuda:0", 112 * gib // 100, gib, 0.1, 0.1),
             "step off": ("cuda:0", gib, gib, 0.125, 0.1),
             "cpu step off": ("cpu", gib, gib, 0.2, 0.1)}
    out = tmp_path / "out"
    for name, (device, predicted, peak, step_s, compute_s) in cases.items():
        run = _planned_run(tmp_path / name, device, predicted=predicted, peak=peak, step_s=step_s, compute_s=compute_s)
        assert _checklist("plan", name, run, "--out", out).returncode == 0
    run = tmp_path / "not handed"
    _planned_run(run, "cuda:0", predicted=gib, peak=gib, step_s=None, compute_s=0.1)
    facts = json.loads((run / "memory.json").read_text())
    del facts["ranks"][0]["predicted_bytes"]
    (run / "memory.json").write_text(json.dumps(facts))
    _checklist("plan", "not handed", run, "--out", out)
    table = _checklist("table", out).stdout
    assert _row(table, "close").endswith("| pass: memory predicted 1.08 GiB, measured 1.00 GiB by "
                                         "torch.cuda.max_memory_allocated (+8.0%); step predicted 115.0 ms, computed "
                                         "100.0 ms (+15%) |")
    assert "| **FAIL**: memory off by more than 10%; memory predicted 1.12 GiB" in _row(table, "memory off")
    assert "| **FAIL**: step time off by more than 20%; " in _row(table, "step off")
    assert _row(table, "cpu step off").endswith("computed 100.0 ms (+100%); time not judged on a CPU |")
    assert "| **FAIL**: no memory.json with the plan's prediction" in _row(table, "not handed")
    assert "5 check(s): 2 passed, 3 failed, 0 skipped" in table


def test_a_plans_check_fails_when_the_loader_did_not_do_what_the_plan_said(tmp_path):
    """Its input line: 8 workers of 200 images/s give 1,600; a step of 32 images in 0.1 s takes 320/s, so the loader
    keeps up: a GPU run that waited 40 % of its steps fails, one that waited 2 % passes; a plan that said it would
    hold the steps up (a 10 ms step takes 3,200/s) fails when the run waited under 5 %, not at 14 %."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"input": {"images_per_s_per_worker": 200.0, "images_per_s_in_process": 180.0,
                                          "workers": 8, "images_per_s": 1600.0, "keeps_up": True}}))
    out = tmp_path / "out"
    for name, step_s, waited in (("waited", 0.1, 0.4), ("kept up", 0.1, 0.02), ("said it would not", 0.01, 0.02),
                                 ("at the border", 0.01, 0.14)):
        run = _planned_run(tmp_path / name, "cuda:0", predicted=2**30, peak=2**30, step_s=step_s, compute_s=step_s,
                           waited=waited)
        _checklist("plan", name, run, "--out", out, "--plan-json", plan)
    table = _checklist("table", out).stdout
    assert "| **FAIL**: the input prediction was wrong; " in _row(table, "waited")
    assert _row(table, "waited").endswith("input: predicted to keep up (200 images/s a worker; the run's readers 190), "
                                          "the steps waited 40% of their time with 8 worker(s) |")
    assert _row(table, "kept up").startswith("| kept up |") and "| pass: " in _row(table, "kept up")
    assert "| **FAIL**: the input prediction was wrong; " in _row(table, "said it would not")
    assert "input: predicted to hold the steps up" in _row(table, "said it would not")
    # Between 5 % and 20 % of the step waiting, neither prediction is refuted (the plan's border lies there).
    assert "| pass: " in _row(table, "at the border") and "hold the steps up" in _row(table, "at the border")


def test_plans_of_a_file_that_is_not_a_plan_is_one_line_naming_it(tmp_path):
    for path, why in ((tmp_path / "missing.json", "FileNotFoundError"), (tmp_path / "other.json", "KeyError: 'plans'")):
        if path.name == "other.json":
            path.write_text('{"ranks": []}')
        done = _checklist("plans", path)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.splitlines() == [done.stderr.strip()] and f"{path} is not a gputrain plan --json file" in \
            done.stderr and why in done.stderr
