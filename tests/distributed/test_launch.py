import torch
import torch.distributed as dist

from multiproc import run_ranks


def _sum_ranks(info):
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    return info.rank, info.world_size, float(t)


def test_two_real_processes_see_each_other():
    results = run_ranks(_sum_ranks)
    assert results == [(0, 2, 3.0), (1, 2, 3.0)]
