"""The tests' 2-rank launches: ranks forked from the preloaded server (``run_ranks``) vs fresh interpreters
(``run_ranks(..., fresh=True)``, gputrain's launcher), on a body that only joins the group and all-reduces once.

So the time is what a launch costs a test, not the test's work. Rounds interleave the two (fresh, forked); the
forked side's server starts before the first round and is not timed (one per pytest worker in the suite). Figure
per round: the wall time of one ``run_ranks`` call (CPU is not compared: forked ranks are the server's children,
which this process's resource usage does not count). Medians over rounds, and the median of per-round ratios.

    python benchmarks/rank_launch.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from multiproc import run_ranks  # noqa: E402  (tests/, put on the path above)
from rank_bodies import all_reduce_once  # noqa: E402


def timed(fresh: bool) -> float:
    """Wall seconds of one launch of 2 ranks."""
    start = time.perf_counter()
    assert run_ranks(all_reduce_once, fresh=fresh) == [3.0, 3.0]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(all_reduce_once)  # starts the fork server (once per pytest worker in the suite)
    rows = []
    for k in range(args.rounds):
        fresh, forked = timed(True), timed(False)
        rows.append({"fresh_s": fresh, "forked_s": forked})
        print(f"round {k + 1}: fresh {fresh:.2f} s, forked {forked:.2f} s", flush=True)
    result = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    result["forked_over_fresh_wall"] = statistics.median(r["forked_s"] / r["fresh_s"] for r in rows)
    result |= {"rounds": args.rounds, "date": datetime.date.today().isoformat(), "machine": platform.node(),
               "cores": os.cpu_count()}
    print(f"median of {args.rounds} rounds: fresh {result['fresh_s']:.2f} s, forked {result['forked_s']:.2f} s; "
          f"forked/fresh {result['forked_over_fresh_wall']:.2f} (median of per-round ratios)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
