"""What a multi-node run prints when torchrun's rendezvous fails on this node."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from gputrain.errors import EXIT_FAILED
from gputrain.launcher import ranks as launch
from gputrain.launcher.spec import LaunchSpec


def test_a_lost_rendezvous_ends_in_one_line_naming_the_node_and_endpoint(monkeypatch, capsys):
    """When the node hosting the rendezvous store ends or fails first, torchrun's agent on another node raises
    RendezvousConnectionError to the top (seen for real in tests/e2e/test_multinode.py on a loaded machine, where it
    is a race). The agent's error is stood in for here, so the outcome does not depend on the race. Planted fault:
    the error not caught (the agent's traceback reaches the user)."""

    def lost_store(spec, module, module_args):
        raise RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")

    monkeypatch.setattr(launch, "run_torchrun", lost_store)
    spec = LaunchSpec(nproc_per_node=1, nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29500")
    assert launch.run_command(spec, "gputrain", ["train", "autoencoder"]) == EXIT_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gputrain: error: node 1 lost the rendezvous at 127.0.0.1:29500 ")
    assert "RendezvousConnectionError: The connection to the C10d store has failed" in lines[0]
