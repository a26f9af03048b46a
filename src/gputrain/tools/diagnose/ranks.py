"""Run a body on N real ranks and get every rank's outcome back, even when a rank crashes or hangs.

``gputrain doctor`` and ``gputrain parity`` run user code on purpose to find what breaks it, so
they cannot use :func:`gputrain.launch_all`, which returns only when every rank succeeds.
Here each rank writes its result (or its error) to a file, and the parent reads all of them:

* A Python error (including a collective timeout) is caught on its rank; the rank's last collective
  comes from PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE``; it records gloo collectives in
  torch 2.14, and NCCL's with ``TORCH_NCCL_TRACE_BUFFER_SIZE``).
* A rank killed by a signal (gloo aborts the process on a collective of mismatched size) leaves a
  ``faulthandler`` stack, from which the collective it was in is read, and its stderr (captured in a file per
  rank by the launcher, :func:`gputrain.launcher.direct.run_function`).
* A rank that fails first asks its peers still running for their stacks (SIGUSR2, which
  ``faulthandler`` answers even inside a blocking C call), then stops them: a peer stuck in a
  collective, or in a dataset, is named with where it was, without waiting for its own timeout.
* A rank stuck while no rank fails is stopped by a ``faulthandler`` watchdog that dumps its stack.

``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (gloo's collective-mismatch checker) is not used: in torch 2.14.1
building ``DistributedDataParallel`` over its wrapped process group crashes the process (SIGSEGV in
DDP's logger). ``INFO`` is set instead, so that DDP's own errors name unused parameters.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gputrain.dist import init_distributed, teardown
from gputrain.tools.diagnose.outcome import RECORDS_DIR, RankOutcome, open_records, read_records

STOP_PEERS = "_stop_peers"
"""A body that returns a dict with this key set has failed in a way its peers may wait on: they are stopped."""

RANK_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
"""Defaults for the workers (a value the user set wins): the flight recorder on, for gloo and NCCL."""


@contextmanager
def _environment(defaults: dict[str, str], values: dict[str, str]) -> Iterator[None]:
    """``values`` set, ``defaults`` set where the user has not; all restored afterwards."""
    saved = {k: os.environ.get(k) for k in {**defaults, **values}}
    os.environ.update({k: v for k, v in defaults.items() if k not in os.environ})
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def flight_recorder_last() -> str:
    """This process's last recorded collective, from PyTorch's flight recorder ('' when none)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]  # private, in 2.14.1

        entries = json.loads(_dump_fr_trace_json(True, False)).get("entries", [])
    except Exception:  # noqa: BLE001 (no recorder in this build, or no process group yet)
        return ""
    if not entries:
        return ""
    e = entries[-1]
    name = str(e.get("profiling_name", "?")).split(":")[-1]
    return f"{name} #{e.get('collective_seq_id', '?')} (sizes {e.get('input_sizes')}, {e.get('state', '?')})"


def _outside_torch(frames: list[tuple[str, str, str]]) -> str:
    """The innermost frame not in torch or the standard library: where user or gputrain code called in."""
    for filename, line, func in frames:
        if "site-packages/torch" not in filename and "/lib/python3" not in filename:
            return f"{_short(filename)}:{line} in {func}"
    return ""


def _short(filename: str) -> str:
    parts = Path(filename).parts
    return "/".join(parts[-3:]) if len(parts) > 3 else filename


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:400]}"


def named_timeout(err: BaseException, timeout_s: float) -> str:
    """A rank's error line; a collective that waited out the process group's timeout is named as a timeout."""
    line = one_line(err)
    if isinstance(err, TimeoutError) or "timed out" in line.lower() or "timeout" in line.lower():
        return (f"timed out after {timeout_s:.0f} s waiting for another rank ({line[:200]}); a rank that slow is "
                f"usually a busy machine: raise --timeout (now {timeout_s:.0f} s)")
    return line


BETWEEN_MODES = 10
"""Times the collective timeout a rank waits for the others to finish the previous job (a parity mode)."""


def wait_for_every_rank(timeout_s: float) -> None:
    """A barrier between two jobs of the same ranks that waits ``BETWEEN_MODES`` times the collective timeout: a
    group of its own, made on the first call (every rank makes it, before the first job), with that timeout."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if "group" not in _PATIENT:
        timeout = datetime.timedelta(seconds=BETWEEN_MODES * timeout_s)
        _PATIENT["group"] = dist.new_group(backend=dist.get_backend(), timeout=timeout)
    dist.barrier(group=_PATIENT["group"])


_PATIENT: dict[str, Any] = {}


def _rank_main(body: Callable[..., Any], args: tuple[Any, ...], accelerator: str, timeout_s: float, watchdog_s: float,
               folder: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    base = Path(folder)
    os.environ[RECORDS_DIR] = folder
    open_records()
    fault = open(base / f"fault{rank}.txt", "w")  # noqa: SIM115 (open for the process's lifetime)
    faulthandler.enable(file=fault)
    faulthandler.register(signal.SIGUSR2, file=fault, all_threads=False)  # a failed peer asks for our stack
    (base / f"pid{rank}.txt").write_text(str(os.getpid()))
    # A rank stuck outside any collective (a dataset that blocks) never times out: dump its stack and exit.
    faulthandler.dump_traceback_later(watchdog_s, exit=True, file=fault)
    record: dict[str, Any]
    try:
        info = init_distributed(accelerator, timeout_s=timeout_s)
        record = {"ok": True, "value": body(info, *args)}
    except BaseException as err:  # noqa: BLE001 (reported, not hidden: the parent prints it)
        frames = [(f.filename, str(f.lineno), f.name) for f in reversed(traceback.extract_tb(err.__traceback__))]
        record = {"ok": False, "error": one_line(err), "last_collective": flight_recorder_last(),
                  "where": _outside_torch(frames)}
    finally:
        faulthandler.cancel_dump_traceback_later()
    partial = base / f".result{rank}.pt"
    torch.save(record, partial)
    partial.replace(base / f"result{rank}.pt")  # whole or absent, even if this rank is stopped now
    (base / f"pid{rank}.txt").unlink(missing_ok=True)
    stop = not record["ok"] or (isinstance(record["value"], dict) and record["value"].get(STOP_PEERS))
    if stop:
        _stop_peers(base, rank)
        # Exit without tearing down a process group that may be broken.
        fault.flush()
        os._exit(0 if record["ok"] else 1)
    teardown()


def _stop_peers(base: Path, rank: int) -> None:
    """Dump the stacks of the other ranks still running (SIGUSR2), then end them (SIGKILL).

    Only our own workers: a rank's pid file exists from its start until it has written its result,
    and the pid must still be a rank of the launcher (python -m gputrain.launcher.worker).
    """
    deadline = time.monotonic() + 3.0  # peers that failed the same way finish on their own
    while time.monotonic() < deadline and any(base.glob("pid*.txt")):  # our own is removed already
        time.sleep(0.1)
    peers = []
    for pid_file in base.glob("pid*.txt"):
        peer = int(pid_file.stem[3:])
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if Path("/proc").is_dir() else b"gputrain.launcher.worker"
        except (OSError, ValueError):
            continue
        if peer != rank and b"gputrain.launcher.worker" in cmdline and not (base / f"result{peer}.pt").exists():
            peers.append((peer, pid))
    for peer, pid in peers:
        (base / f"stopped{peer}.txt").write_text(str(rank))
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR2)
    if peers:
        time.sleep(1.0)  # faulthandler writes from its signal handler at once; leave it a moment
    for _, pid in peers:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _from_fault_file(path: Path) -> tuple[str, str]:
    """(collective, where) from a faulthandler dump of the main thread, most recent call first."""
    if not path.is_file():
        return "", ""
    text = path.read_text(errors="replace")
    blocks = text.split("\n\n")
    main = next((b for b in blocks if "most recent call first" in b and "_rank_main" in b), text)
    frames = [(m["file"], m["line"], m["func"]) for m in _FRAME.finditer(main)]
    collective = next((func for file, _, func in frames if file.endswith("distributed_c10d.py")), "")
    return collective, _outside_torch(frames)


def _log_tail(logs: Path, rank: int) -> list[str]:
    found = sorted(logs.glob(f"**/{rank}/stderr.log"))
    if not found:
        return []
    lines = found[-1].read_text(errors="replace").splitlines()
    keep = [ln.strip() for ln in lines if re.search(r"error|what\(\)|enforce|mismatch|timed out|Fatal", ln, re.I)]
    return keep[-4:]


def run_on_ranks(body: Callable[..., Any], *args: Any, devices: int = 2, accelerator: str = "cpu",
                 timeout_s: float = 60.0, watchdog_s: float = 0.0, env: dict[str, str] | None = None
                 ) -> list[RankOutcome]:
    """``body(dist_info, *args)`` on ``devices`` ranks of this node; an outcome per rank, by rank, never raising.

    ``body`` must be a module-level function (workers are spawned). Collectives time out after
    ``timeout_s``; a rank still running after ``watchdog_s`` (default 3 x timeout + 2 min) dumps its
    stack and exits; ``env`` adds variables for the workers.
    """
    from gputrain.launcher.direct import run_function

    folder = Path(tempfile.mkdtemp(prefix="gputrain-ranks-"))
    died: dict[int, str] = {}
    # DETAIL would crash DDP (see above): INFO, whatever the user's shell says.
    with _environment(RANK_ENV, {"TORCH_DISTRIBUTED_DEBUG": "INFO", **(env or {})}):
        _, failures = run_function(devices, _rank_main, (body, args, accelerator, timeout_s,
                                                         watchdog_s or 3 * timeout_s + 120, str(folder)),
                                   logs=folder / "logs", stdout_too=True)
    for rank, failure in failures.items():
        code = failure.exitcode
        died[rank] = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.Signals._value2member_map_
                      else f"exited with code {code}")
    outcomes = []
    for rank in range(devices):
        result = folder / f"result{rank}.pt"
        tail = _log_tail(folder / "logs", rank)
        records = read_records(folder / f"records{rank}.jsonl")
        if result.is_file():
            rec = torch.load(result, weights_only=True)
            outcomes.append(RankOutcome(rank=rank, ok=rec["ok"], value=rec.get("value"), error=rec.get("error", ""),
                                        last_collective=rec.get("last_collective", ""), where=rec.get("where", ""),
                                        log_tail=[] if rec["ok"] else tail, records=records))
            continue
        collective, where = _from_fault_file(folder / f"fault{rank}.txt")
        stopper = folder / f"stopped{rank}.txt"
        reason = (f"was still running when rank {stopper.read_text()} failed; stopped" if stopper.is_file()
                  else died.get(rank, "ended without a result"))
        outcomes.append(RankOutcome(rank=rank, ok=False, error=f"rank {rank} {reason}",
                                    last_collective=f"{collective} (from its stack)" if collective else "",
                                    where=where, log_tail=tail, records=records))
    if all(o.ok for o in outcomes):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        for o in outcomes:
            o.logs = str(folder / "logs")
    return outcomes
