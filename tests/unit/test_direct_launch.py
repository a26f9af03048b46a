"""The direct launcher gives each rank the environment torchrun would, variable for variable."""

from __future__ import annotations

from gputrain.launcher.direct import rank_env


def test_each_rank_gets_every_variable_torchrun_sets():
    """Workers record their failure with torch's ``record`` into TORCHELASTIC_ERROR_FILE, which the launcher reads to
    report it; the rendezvous is the launcher's store (TORCHELASTIC_USE_AGENT_STORE). Planted fault: no error file."""
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    env = rank_env(base, rank=1, world_size=3, port=29512, run_id="gputrain-1a2b3c4d", error_file="/tmp/e/rank1.json")
    assert env == base | {
        "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0", "ROLE_RANK": "1", "ROLE_NAME": "default",
        "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "ROLE_WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "gputrain-1a2b3c4d",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/tmp/e/rank1.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    assert base == {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}  # the launcher's own environment is left as it was
    # A user's own choice for NCCL's error handling is kept, as torchrun keeps it.
    assert rank_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, rank=0, world_size=1, port=1, run_id="r",
                    error_file="e")["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
