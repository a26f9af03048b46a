"""``gputrain env`` on this machine (CPU-only here; the GPU lines run unchanged where torch sees CUDA)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from gputrain.cli import main
from gputrain.tools.env import ENV_NAMES, ENV_PREFIXES, collect_env, format_env


def test_env_reports_versions_backends_and_devices():
    info = collect_env()
    v = info["versions"]
    assert v["torch"] == torch.__version__ and v["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["backends"]["gloo"] is True  # every torch build this project supports has gloo
    assert len(info["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    for d in info["devices"]:
        assert d["memory_gib"] > 0 and d["name"]
    text = format_env(info)
    assert f"torch        {torch.__version__}" in text
    assert "backends:      gloo" in text
    json.dumps(info)  # plain data only


def test_env_shows_launcher_variables_and_the_layout_they_give(monkeypatch):
    # Every variable `gputrain env` reports goes (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, ... set outside the test).
    for key in list(os.environ):
        if key.startswith(ENV_PREFIXES) or key in ENV_NAMES:
            monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    info = collect_env()
    assert info["environment"] == {"NCCL_DEBUG": "INFO", "SLURM_NTASKS": "4", "SLURM_PROCID": "1"}
    assert "MASTER_ADDR is not set" in info["layout"]["error"]  # the message a real run would stop with
    monkeypatch.setenv("MASTER_ADDR", "node001")
    info = collect_env()
    assert info["layout"] == {"launched": True, "error": "", "rank": 1, "local_rank": 0, "world_size": 4}
    assert "layout:        rank 1 of 4 (local rank 0)" in format_env(info)


def test_topology_from_nvidia_smi_when_it_is_on_path(tmp_path, monkeypatch):
    # This machine has no nvidia-smi; a stand-in executable exercises the reading of its output and the
    # diagnosis "nvidia-smi runs but torch sees no GPU" (a driver/CUDA mismatch on a real box).
    if torch.cuda.is_available():
        pytest.skip("a real GPU is visible: the stand-in would hide it")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '        GPU0    GPU1'\necho 'GPU0     X      NV12'\necho 'GPU1    NV12     X'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    info = collect_env()
    assert info["topology"]["available"] and "NV12" in info["topology"]["matrix"]
    assert "torch sees no GPU" in info["notes"][0]
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    info = collect_env()
    assert not info["topology"]["available"] and "exited 9: NVIDIA-SMI has failed" in info["topology"]["reason"]


def test_env_command_plain_and_json(capsys):
    assert main(["env"]) == 0
    assert "versions:" in capsys.readouterr().out
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["versions"]["torch"] == torch.__version__


@pytest.mark.slow
def test_env_as_a_module_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-m", "gputrain", "env", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["backends"]["gloo"] is True
