"""A few batches of torch's DataLoader on a rank of a job, which first says the rendezvous it runs under (its id and
its store's port): the doctor's launch tests read that line of each rank."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

print(f"rank {os.environ['RANK']} rendezvous {os.environ['TORCHELASTIC_RUN_ID']} port {os.environ['MASTER_PORT']}",
      flush=True)  # fmt: skip
for _ in DataLoader(torch.arange(64), batch_size=4):
    pass
