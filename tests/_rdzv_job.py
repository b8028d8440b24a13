"""A few batches of torch's DataLoader on a rank of a job, which first says the rendezvous it runs under (its id and
its store's port): the doctor's launch tests read that line of each rank."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

# One write(2) of the whole line: the ranks share the launcher's stdout, and print() writes the text and its newline
# apart, so two ranks' lines could run together ("... port 53021rank 1 ...") and one would not be read.
os.write(1, f"rank {os.environ['RANK']} rendezvous {os.environ['TORCHELASTIC_RUN_ID']} "
            f"port {os.environ['MASTER_PORT']}\n".encode())  # fmt: skip
for _ in DataLoader(torch.arange(64), batch_size=4):
    pass
