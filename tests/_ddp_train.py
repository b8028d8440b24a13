"""A plain DDP training script (torch's DataLoader, DistributedSampler, gloo on CPU) for the multi-rank doctor.

Run as torchrun runs it (one process per rank). Its knobs make each of the doctor's job scenarios:

- ``--sample-ms`` of CPU per sample in the workers, and ``--slow-rank R --slow-ms M`` for rank R's instead: one
  rank's input is slow (input/workers), or every rank's (all input-bound alike); ``--io``: samples wait instead;
- ``--compute-ms`` of CPU per step in the loop (compute-bound);
- ``--params`` gradients all-reduced per step by DDP (sync-bound with tens of millions).

Compute and sample costs spin the CPU rather than sleep: the doctor counts a CPU-backend rank's sleep inside a
step as waiting for the other ranks, and a sleeping "compute" is no compute.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < end:
        x += 1


class Model(torch.nn.Module):
    """``params`` weights whose gradient costs one pass over them: the step's compute stays small beside their
    all-reduce even at tens of millions."""

    def __init__(self, params: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(params))

    def forward(self, x):
        return x.sum() * 1e-9 + self.w.sum()


class Samples(Dataset):
    def __init__(self, n: int, ms: float, io: bool) -> None:
        self.n, self.ms, self.cost = n, ms, (lambda ms: time.sleep(ms / 1e3)) if io else spin

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.cost(self.ms)
        return torch.full((16,), float(i))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--sample-ms", type=float, default=0.1)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--slow-ms", type=float, default=10.0)
    p.add_argument("--io", action="store_true", help="samples wait (sleep, as reads do) instead of spinning")
    p.add_argument("--compute-ms", type=float, default=1.0)
    p.add_argument("--params", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--fail-rank", type=int, default=None, help="this rank raises at its 5th batch")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ms = args.slow_ms if rank == args.slow_rank else args.sample_ms
    data = Samples(args.samples, ms, args.io)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data), num_workers=args.workers)
    # Gradients kept between steps and used as DDP's buckets: no 4-byte-per-parameter allocation or copy per step.
    model = DDP(Model(args.params), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    try:
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                if rank == args.fail_rank and i == 4:
                    raise RuntimeError(f"rank {rank} failed on purpose")
                opt.zero_grad(set_to_none=False)
                model(batch).backward()
                spin(args.compute_ms)
                opt.step()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
