"""`python -m tests.rendezvous`: join the gloo group that torchrun's variables describe, agree on
one all-reduce, print the rank and the sum (tests/parallel/test_rank_runs.py)."""

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} sum {int(total)}")
    dist.destroy_process_group()
