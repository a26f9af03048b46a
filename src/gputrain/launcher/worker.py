"""A rank started by :func:`gputrain.launcher.direct.run_function`: ``python -m gputrain.launcher.worker FOLDER``.

It sets up the interpreter as ``multiprocessing``'s spawn would (the caller's ``sys.path``, its main module), unpickles
the function and arguments the launcher wrote, runs them under torch's ``record`` (a failure goes to
the rank's error file, as every gputrain rank's does) and pickles the result for the launcher.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path


def main(folder: Path) -> None:
    from multiprocessing import spawn

    from gputrain.launcher.worker_errors import worker_record

    spawn.prepare(pickle.loads((folder / "prepare.pkl").read_bytes()))  # the caller's sys.path and main module
    fn, args = pickle.loads((folder / "call.pkl").read_bytes())
    result = worker_record(fn, usage=())(*args)
    partial = folder / f".result{os.environ['RANK']}.pkl"
    partial.write_bytes(pickle.dumps(result))
    partial.replace(folder / f"result{os.environ['RANK']}.pkl")  # whole or absent


if __name__ == "__main__":
    main(Path(sys.argv[1]))
