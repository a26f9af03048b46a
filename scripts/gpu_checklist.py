"""The GPU checklist's verdicts and its one table; ``scripts/gpu_check.sh`` calls this after each check.

Each check leaves one JSON file in ``OUT/checks/`` (its figures and its verdict), so the figures come back
from a lent machine even when the next check runs out of time, and ``table`` can merge the ``OUT`` folders
of several commands (a 30-minute lease is run as several commands of at most 10 minutes):

    python scripts/gpu_checklist.py recipe NAME RUN_FOLDER --exit-code N --log LOG --setting TEXT --out OUT
    python scripts/gpu_checklist.py images NAME BENCH_FOLDER --exit-code N --log LOG --setting TEXT --out OUT
    python scripts/gpu_checklist.py plan NAME RUN_FOLDER --exit-code N --log LOG --setting TEXT --out OUT
    python scripts/gpu_checklist.py plans PLAN_JSON      # each one-device plan: LABEL<tab>the values that train it
    python scripts/gpu_checklist.py tests JUNIT_XML --exit-code N --log LOG --out OUT
    python scripts/gpu_checklist.py mark NAME {pass,skipped,fail} --why TEXT --setting TEXT --out OUT
    python scripts/gpu_checklist.py table OUT [OUT ...]   # the markdown table; exit 1 when a check failed

A check fails when its command exited non-zero (exit 3 is a diverged run: NaN/inf), when any loss its run
logged is not finite (written as ``null`` in metrics.jsonl), or, for the CUDA tests, when a test failed or
none ran; a plan's check, when its predicted peak memory or (on a GPU) step time is off (gpu_checklist_plan.py). A 16-mixed run's row also says how many steps the loss scaler skipped and the scale it ended with. Only the standard library is used: this runs wherever the runs' files are, with or without torch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpu_checklist_plan import check_plan, one_device_plans

DIVERGED = 3
"""gputrain's exit code for a run that produced NaN/inf (gputrain.errors.EXIT_DIVERGED)."""


def read_metrics(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def losses_finite(records: list[dict[str, Any]]) -> bool:
    """Every logged loss is a finite number; gputrain writes a NaN or inf as null."""
    return all(isinstance(v, (int, float)) and math.isfinite(v)
               for r in records for k, v in r.items() if k.endswith("loss"))


def skipped_steps(records: list[dict[str, Any]]) -> tuple[int, float] | None:
    """16-mixed: how many steps the loss scaler skipped, and its last scale; None for other precisions."""
    scales = [r["train/loss_scale"] for r in records if isinstance(r.get("train/loss_scale"), (int, float))]
    if not scales:
        return None
    return int(sum(r.get("train/skipped_steps") or 0 for r in records)), scales[-1]


def steady_images_per_s(records: list[dict[str, Any]]) -> float | None:
    """Training images/s over the epochs after the first (which pays for start-up and the cuDNN autotuner)."""
    epochs = [r for r in records if "time/train_s" in r]
    steady = epochs[1:] or epochs
    seconds = sum(r["time/train_s"] for r in steady)
    return sum(r["train/samples"] for r in steady) / seconds if seconds > 0 else None


def error_line(log: Path | None) -> str:
    """The last ``error`` line of a command's log: why it failed, in its own words."""
    if log is None or not log.is_file():
        return ""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if "error" in line.lower()]
    return lines[-1] if lines else ""


def failed_command(exit_code: int, log: Path | None) -> str:
    kind = " (diverged: NaN/inf)" if exit_code == DIVERGED else ""
    why = error_line(log)
    return f"exit {exit_code}{kind}" + (f": {why}" if why else "")


def check_run(name: str, runs: list[Path], exit_code: int, log: Path | None, setting: str) -> dict[str, Any]:
    """One training command (a recipe, or bench throughput's real and synthetic runs): did it end finite?"""
    records = [read_metrics(run) for run in runs]
    finite = all(losses_finite(r) for r in records) and exit_code != DIVERGED
    problems = []
    if exit_code != 0:
        problems.append(failed_command(exit_code, log))
    elif not all(records):
        problems.append("no metrics.jsonl: the run did not train")
    if not finite and exit_code != DIVERGED:
        problems.append("a logged loss is NaN/inf")
    return {"name": name, "setting": setting, "loss": ("finite" if finite else "NaN/inf") if any(records) else "",
            "verdict": "fail" if problems else "pass", "why": "; ".join(problems)}


def check_recipe(name: str, run: Path, exit_code: int, log: Path | None, setting: str) -> dict[str, Any]:
    result = check_run(name, [run], exit_code, log, setting)
    replayed = run / "nonfinite" / "report.txt"
    if exit_code == DIVERGED and replayed.is_file():  # the run replayed its failing step: its report is the why
        result["why"] = (f"exit {exit_code} (diverged: NaN/inf); {replayed.read_text().strip()} "
                         f"(gputrain replay {replayed.parent})")
    summary_path = run / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        result["setting"] = (f"{setting}; precision={summary['precision']} batch={summary['batch_size_per_device']} "
                             f"epochs={summary['epochs']} device={summary['device']}")
        result["peak_memory_bytes"] = summary["peak_memory_bytes"]
        last = summary["final"].get("train/loss")
        if result["loss"] == "finite" and last is not None:
            result["loss"] = f"finite, last {last:.3g}"
    elif result["verdict"] == "pass":
        result |= {"verdict": "fail", "why": "no summary.json: the run did not finish"}
    skipped = skipped_steps(read_metrics(run))
    if skipped:  # 16-mixed: steps the loss scaler skipped, and the scale it ended with
        result["loss"] = (result["loss"] + f"; {skipped[0]} step(s) skipped, scale {skipped[1]:g}").lstrip("; ")
    result["images_per_s"] = steady_images_per_s(read_metrics(run))
    return result


def check_images(name: str, bench: Path, exit_code: int, log: Path | None, setting: str) -> dict[str, Any]:
    """``gputrain bench throughput``'s folder: throughput.json, and the runs real/ and synthetic/."""
    result = check_run(name, [bench / "real", bench / "synthetic"], exit_code, log, setting)
    figures = bench / "throughput.json"
    if figures.is_file():
        t = json.loads(figures.read_text())
        result |= {"setting": f"{setting}; precision={t['precision']} batch={t['batch_size']} device={t['device']}",
                   "images_per_s": t["train_images_per_s"], "synthetic_images_per_s": t["synthetic_train_images_per_s"],
                   "input_bound_ratio": t["input_bound_ratio"], "peak_memory_bytes": t["peak_memory_bytes"],
                   "cautions": t.get("cautions", [])}
    elif result["verdict"] == "pass":
        result |= {"verdict": "fail", "why": "no throughput.json: the benchmark did not finish"}
    return result


def check_tests(junit: Path, exit_code: int, log: Path | None) -> dict[str, Any]:
    """pytest -m cuda on a GPU: every test passed, and at least one ran (all skipped means no GPU was seen)."""
    result = {"name": "CUDA tests", "setting": "pytest -m cuda tests"}
    if not junit.is_file():
        return result | {"verdict": "fail", "why": f"no test report; {failed_command(exit_code, log)}"}
    cases = ET.parse(junit).getroot().iter("testcase")
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        kind = ("failed" if case.find("failure") is not None or case.find("error") is not None
                else "skipped" if case.find("skipped") is not None else "passed")
        outcomes[kind].append(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}")
    counts = ", ".join(f"{len(v)} {k}" for k, v in outcomes.items() if v) or "no tests"
    result["counts"] = {k: len(v) for k, v in outcomes.items()}
    if outcomes["failed"]:
        return result | {"verdict": "fail", "why": f"{counts}: {', '.join(outcomes['failed'])}"}
    if not outcomes["passed"]:  # conftest skips every cuda test where torch sees no GPU: not a pass
        return result | {"verdict": "fail", "why": f"{counts}: no CUDA test ran (does torch see the GPU?)"}
    if exit_code != 0:
        return result | {"verdict": "fail", "why": f"{counts}; {failed_command(exit_code, log)}"}
    return result | {"verdict": "pass", "why": counts}


def write(out: Path, result: dict[str, Any]) -> None:
    folder = out / "checks"
    folder.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", result["name"]).strip("_")
    result["time"] = time.time()
    (folder / f"{slug}.json").write_text(json.dumps(result, indent=2, allow_nan=False, default=str) + "\n")


def load(folders: list[Path]) -> list[dict[str, Any]]:
    """Every check in ``folders``, in the order they ran; a check run again (a partial rerun) keeps its newest."""
    newest: dict[str, dict[str, Any]] = {}
    for path in (p for folder in folders for p in sorted((folder / "checks").glob("*.json"))):
        check = json.loads(path.read_text())
        if check["name"] not in newest or check["time"] >= newest[check["name"]]["time"]:
            newest[check["name"]] = check
    return sorted(newest.values(), key=lambda c: c["time"])


def table(checks: list[dict[str, Any]]) -> str:
    def number(value: Any, fmt: str) -> str:
        return "" if value is None else format(value, fmt)

    rows = ["| check | setting | loss | images/s | peak GiB | result |", "|---|---|---|---:|---:|---|"]
    for c in checks:
        images = number(c.get("images_per_s"), ",.1f")
        if c.get("synthetic_images_per_s") is not None:
            images += f" real / {c['synthetic_images_per_s']:,.1f} synthetic"
        peak = c.get("peak_memory_bytes")
        result = {"pass": "pass", "skipped": "skipped"}.get(c.get("verdict", ""), "**FAIL**")
        why = c.get("why", "")
        # 500: a replay's report (issue 41) whole, with its fix; the whole line is in the JSON anyway
        result += f": {why[:500]}{'...' if len(why) > 500 else ''}" if why else ""
        cells = [c["name"], c.get("setting", ""), c.get("loss", ""), images,
                 number(peak and peak / 2**30, ".1f"), result]
        rows.append("| " + " | ".join(str(cell).replace("|", "/") for cell in cells) + " |")
    verdicts = [c.get("verdict") for c in checks]
    failed = len(checks) - verdicts.count("pass") - verdicts.count("skipped")
    rows.append(f"\n{len(checks)} check(s): {verdicts.count('pass')} passed, {failed} failed, "
                f"{verdicts.count('skipped')} skipped")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for kind in ("recipe", "images", "plan"):
        p = sub.add_parser(kind)
        p.add_argument("name")
        p.add_argument("folder", type=Path)
    p = sub.add_parser("tests")
    p.add_argument("junit", type=Path)
    sub.choices["plan"].add_argument("--plan-json", type=Path, help="the gputrain plan --json the run's plan is of")
    p = sub.add_parser("mark")
    p.add_argument("name")
    p.add_argument("verdict", choices=("pass", "skipped", "fail"))
    p.add_argument("--why", required=True)
    for p in sub.choices.values():
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--setting", default="")
        p.add_argument("--exit-code", type=int, default=0)
        p.add_argument("--log", type=Path)
    p = sub.add_parser("table")
    p.add_argument("folders", type=Path, nargs="+")
    p = sub.add_parser("plans")
    p.add_argument("plan_json", type=Path)
    args = parser.parse_args(argv)

    if args.command == "plans":
        try:
            print("\n".join(one_device_plans(args.plan_json)))
        except (OSError, ValueError, KeyError) as err:
            print(f"gpu_checklist.py: {args.plan_json} is not a gputrain plan --json file ({type(err).__name__}: {err});"
                  " run gputrain plan RECIPE --json FILE first", file=sys.stderr)
            return 2
        return 0
    if args.command == "table":
        checks = load(args.folders)
        print(table(checks))
        return 0 if checks and all(c.get("verdict") in ("pass", "skipped") for c in checks) else 1
    if args.command == "recipe":
        result = check_recipe(args.name, args.folder, args.exit_code, args.log, args.setting)
    elif args.command == "plan":
        result = check_plan(check_run(args.name, [args.folder], args.exit_code, args.log, args.setting), args.folder,
                            args.plan_json)
    elif args.command == "images":
        result = check_images(args.name, args.folder, args.exit_code, args.log, args.setting)
    elif args.command == "tests":
        result = check_tests(args.junit, args.exit_code, args.log)
    else:
        result = {"name": args.name, "setting": args.setting, "verdict": args.verdict, "why": args.why}
    write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
