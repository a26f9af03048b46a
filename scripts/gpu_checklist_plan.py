"""The GPU checklist's ``plan`` verdict (``scripts/gpu_check.sh plan``): a plan of ``gputrain plan --json``, trained
with its own predictions, set against what its run measured. Standard library only, as ``gpu_checklist.py``.

The run was handed the plan's overrides and ``predictions`` (``trainer.predicted_step_s``,
``trainer.predicted_peak_bytes``) with ``trainer.measure_memory=true``, so its ``memory.json`` holds each rank's
peak beside the prediction and its ``pace`` record (``summary.json``) the step's compute time beside the predicted
one, with the data wait of its first steps. The verdict holds the prediction to issue 42's bounds; the input
pipeline's prediction (does the loader keep up?) is set against the measured wait too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MEMORY_OFF = 0.10
"""A plan's peak memory within this share of the run's measure."""
STEP_OFF = 0.20
"""On a GPU, a plan's step time within this share of the run's compute time (a CPU's is shown, not judged: a shared
machine's cores are not the plan's to count on)."""
WAIT_SHARE = 0.2
"""A run whose steps waited more than this share of their time for data did not keep up (the run's own line says
so at the same share: gputrain.engine.callbacks.pace)."""
KEPT_UP_SHARE = 0.05
"""A run whose steps waited less than this share kept up. Between the two neither prediction is refuted: the plan's
own border (reads in the training process at a tenth of the step, workers giving just what it takes) lies there."""


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_plan(result: dict[str, Any], run: Path, plan_json: Path | None = None) -> dict[str, Any]:
    """``result`` (the run's own check: did it end finite?) with the plan's figures against the run's; ``plan_json``
    adds its input prediction."""
    if result["verdict"] != "pass":
        return result
    memory, summary = run / "memory.json", run / "summary.json"
    ranks = json.loads(memory.read_text())["ranks"] if memory.is_file() else []
    if not ranks or not summary.is_file() or "predicted_bytes" not in ranks[0]:
        return result | {"verdict": "fail", "why": "no memory.json with the plan's prediction: the run was not handed "
                                                   "it (trainer.predicted_peak_bytes, trainer.measure_memory=true)"}
    worst = max(ranks, key=lambda r: abs(r["prediction_off"]))
    facts = json.loads(summary.read_text())
    pace, gpu = facts.get("pace") or {}, facts["device"].startswith("cuda")
    step_off = pace.get("step_prediction_off")
    if pace.get("step_s") and facts.get("batch_size_per_device"):  # the first steps', waits included
        result["images_per_s"] = facts["batch_size_per_device"] / pace["step_s"]
    result |= {"peak_memory_bytes": worst["peak_bytes"], "predicted_bytes": worst["predicted_bytes"],
               "memory_off": worst["prediction_off"], "memory_how": worst["how"],
               "predicted_step_s": pace.get("predicted_step_s"), "compute_s": pace.get("compute_s"),
               "step_off": step_off, "data_wait_share": pace.get("data_wait_share"),
               "setting": f"{result['setting']}; device={facts['device']}"}
    said = [f"memory predicted {_size(worst['predicted_bytes'])}, measured {_size(worst['peak_bytes'])} by "
            f"{worst['how']} ({worst['prediction_off']:+.1%})"]
    problems = []
    if abs(worst["prediction_off"]) > MEMORY_OFF:
        problems.append(f"memory off by more than {MEMORY_OFF:.0%}")
    if step_off is None:  # a failure on a GPU, where the time is judged
        said.append("step time not compared (the pace record has no prediction: too few steps?)")
        problems += ["no step time compared"] if gpu else []
    else:
        said.append(f"step predicted {pace['predicted_step_s'] * 1e3:.1f} ms, computed {pace['compute_s'] * 1e3:.1f} ms "
                    f"({step_off:+.0%})")
        if not gpu:
            said.append("time not judged on a CPU")
        elif abs(step_off) > STEP_OFF:
            problems.append(f"step time off by more than {STEP_OFF:.0%}")
    planned = json.loads(plan_json.read_text()).get("input") if plan_json and plan_json.is_file() else None
    if planned and step_off is not None and "data_wait_share" in pace:
        keeps_up = _keeps_up(planned, facts["batch_size_per_device"] / pace["predicted_step_s"])
        result |= {"input_keeps_up_predicted": keeps_up, "input_per_worker_predicted": planned["images_per_s_per_worker"],
                   "input_per_reader_measured": pace.get("reader_images_per_s")}
        rate = (f"{planned['images_per_s_per_worker']:.0f} images/s a worker" if planned["workers"] else
                f"{planned['images_per_s_in_process']:.0f} images/s in the training process")
        said.append(f"input: predicted to {'keep up' if keeps_up else 'hold the steps up'} ({rate}; the run's readers "
                    f"{pace.get('reader_images_per_s') or 0:.0f}), the steps waited {pace['data_wait_share']:.0%} "
                    f"of their time with {pace['num_workers']} worker(s)")
        waited = pace["data_wait_share"]
        refuted = waited > WAIT_SHARE if keeps_up else waited < KEPT_UP_SHARE
        if gpu and planned["workers"] == pace["num_workers"] and refuted:
            problems.append("the input prediction was wrong")
    return result | {"verdict": "fail" if problems else "pass", "why": "; ".join(problems + said)}


def _keeps_up(planned: dict[str, Any], needed: float) -> bool:
    """The plan's rule (``gputrain.tools.plan.input.input_plan``, restated: this script reads JSON with the standard
    library alone, on any machine) for this plan's images/s: the workers give at least what the step
    takes; without workers the reads, in series with each step, take a tenth of it or less."""
    if planned["workers"]:
        return bool(planned["images_per_s"] >= needed)
    return bool(planned["images_per_s_in_process"] >= 10 * needed)


def one_device_plans(plan_json: Path) -> list[str]:
    """``LABEL<tab>VALUES`` for each plan of ``gputrain plan --json`` that one device trains and that fits: the
    config values that train it and hand it its predictions."""
    lines = []
    for plan in json.loads(plan_json.read_text())["plans"]:
        if plan["devices"] == 1 and plan["fits"]:
            lines.append(f"{plan['label']}\t{' '.join(plan['overrides'] + plan['predictions'])}")
    return lines
