"""``gputrain env``: what this machine offers a distributed run, in one screen (or ``--json``).

Versions (Python, torch, torchvision, CUDA, cuDNN, NCCL), devices and their memory, the GPU
interconnect as ``nvidia-smi topo -m`` prints it, the distributed environment variables a
launcher set, and the process-group backends this torch build has. Nothing here starts a process
group or allocates on a device beyond what ``torch.cuda.mem_get_info`` needs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
             "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
"""Variables shown by exact name."""
ENV_PREFIXES = ("SLURM_", "TORCHELASTIC_", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_FR_", "GLOO_")
"""Variables shown by prefix (a SLURM job sets dozens; all of them can matter)."""
BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _cudnn_version(code: int) -> str:
    """cuDNN's integer version as text: 9.x encodes major*10000 + minor*100 + patch, 8.x major*1000 + ..."""
    if code >= 90000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _versions() -> dict[str, str | None]:
    try:
        import torchvision

        vision: str | None = torchvision.__version__
    except ImportError:
        vision = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl: str | None = None
    if dist.is_available() and dist.is_nccl_available():
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):  # a build that names NCCL but cannot load it
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": vision,
        "cuda": torch.version.cuda,
        "cudnn": _cudnn_version(cudnn) if cudnn else None,
        "nccl": nccl,
    }


def _devices() -> list[dict[str, Any]]:
    out = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        try:
            free, total = torch.cuda.mem_get_info(i)
        except RuntimeError:  # a device in exclusive mode held by another process
            free, total = None, props.total_memory
        out.append({
            "index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(total / 2**30, 2), "free_gib": None if free is None else round(free / 2**30, 2),
            "multiprocessors": props.multi_processor_count,
        })
    return out


def _cpu() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"machine": platform.machine(), "cores": os.cpu_count(), "cores_usable": usable,
            "torch_threads": torch.get_num_threads(), "mps": bool(getattr(torch.backends, "mps", None)
                                                                  and torch.backends.mps.is_available())}


def _topology() -> dict[str, Any]:
    """``nvidia-smi topo -m`` (NVLink, PCIe switches, NUMA affinity), or why it is absent."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"available": False, "reason": "nvidia-smi not found on PATH", "matrix": None}
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"available": False, "reason": f"nvidia-smi topo -m failed: {err}", "matrix": None}
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()[:1]
        return {"available": False, "reason": f"nvidia-smi topo -m exited {done.returncode}: "
                + (reason[0] if reason else ""), "matrix": None}
    return {"available": True, "reason": "", "matrix": done.stdout.rstrip()}


def _environment(environ: dict[str, str]) -> dict[str, str]:
    return {k: environ[k] for k in sorted(environ) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}


def _layout() -> dict[str, Any]:
    """How ``gputrain`` would place this process (rank, world size) from the environment."""
    from gputrain.dist import launched_env

    try:
        layout = launched_env()
    except ValueError as err:  # SLURM without MASTER_ADDR: the same message a run would end with
        return {"launched": False, "error": str(err)}
    if layout is None:
        return {"launched": False, "error": ""}
    return {"launched": True, "error": "", **layout}


def collect_env() -> dict[str, Any]:
    """Everything ``gputrain env`` reports, as plain JSON-able data."""
    backends = {name: bool(dist.is_available() and getattr(dist, f"is_{name}_available", lambda: False)())
                for name in BACKENDS}
    devices = _devices()
    topology = _topology()
    notes = []
    if topology["available"] and not devices:
        notes.append(f"nvidia-smi runs but torch sees no GPU: this torch was built for CUDA {torch.version.cuda}; "
                     "check the driver version (nvidia-smi) against it, and CUDA_VISIBLE_DEVICES")
    return {
        "versions": _versions(), "platform": platform.platform(), "executable": sys.executable,
        "cpu": _cpu(), "cuda_available": torch.cuda.is_available(), "devices": devices, "topology": topology,
        "backends": {"distributed": dist.is_available(), **backends}, "environment": _environment(dict(os.environ)),
        "layout": _layout(), "notes": notes,
    }


def format_env(info: dict[str, Any]) -> str:
    """The plain-text report: one fact a line, sections in a fixed order."""
    v, cpu = info["versions"], info["cpu"]
    lines = ["versions:"]
    lines += [f"  {k:<12} {val if val is not None else '-'}" for k, val in v.items()]
    lines += [f"platform:      {info['platform']}", f"python:        {info['executable']}",
              f"cpu:           {cpu['cores_usable']} usable of {cpu['cores']} cores ({cpu['machine']}), "
              f"torch threads {cpu['torch_threads']}{', MPS available' if cpu['mps'] else ''}"]
    if info["devices"]:
        lines.append(f"cuda devices:  {len(info['devices'])}")
        for d in info["devices"]:
            free = f", {d['free_gib']} GiB free" if d["free_gib"] is not None else ""
            lines.append(f"  cuda:{d['index']}  {d['name']}  {d['memory_gib']} GiB{free}  "
                         f"capability {d['capability']}  {d['multiprocessors']} SMs")
    else:
        lines.append("cuda devices:  none (torch.cuda.is_available() is False): gputrain runs on CPU with gloo")
    topo = info["topology"]
    lines.append("topology (nvidia-smi topo -m):" if topo["available"] else f"topology:      {topo['reason']}")
    if topo["available"]:
        lines += ["  " + row for row in topo["matrix"].splitlines()]
    b = info["backends"]
    have = [name for name in BACKENDS if b[name]]
    if "nccl" in have and not info["devices"]:
        have[have.index("nccl")] = "nccl (built in; needs CUDA devices, none visible)"
    lines.append(f"backends:      {', '.join(have) or 'none'}" + ("" if b["distributed"] else
                                                                   " (torch.distributed is not available)"))
    env = info["environment"]
    lines.append("environment:" if env else "environment:   no distributed variables set")
    lines += [f"  {k}={val}" for k, val in env.items()]
    lay = info["layout"]
    if lay["error"]:
        lines.append(f"layout:        cannot join: {lay['error']}")
    elif lay["launched"]:
        lines.append(f"layout:        rank {lay['rank']} of {lay['world_size']} (local rank {lay['local_rank']})")
    else:
        lines.append("layout:        a single process (no RANK/WORLD_SIZE or multi-task SLURM variables)")
    lines += [f"note:          {n}" for n in info["notes"]]
    return "\n".join(lines)


def cmd_env(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    info = collect_env()
    print(json.dumps(info, indent=2) if args.json else format_env(info))
    return 0
