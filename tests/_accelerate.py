"""Run under torchrun (2 ranks, CPU, gloo) by tests/test_accelerate.py: the same loaders through Accelerate,
built from torch's DataLoader and from fastfeed's. Each rank saves what it saw to OUT/PHASE-rankR.pt.

    python -m torch.distributed.run --standalone --nproc_per_node 2 _accelerate.py compare|save|load OUT
"""

import os
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed

import fastfeed

N, BATCH, RESUME_AFTER = 37, 4, 3


class Numbers(torch.utils.data.Dataset):
    """Index, and a draw from the worker's torch RNG: batches match only if workers are seeded alike."""

    def __init__(self, random=True):
        self.random = random

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i]), torch.rand(2) if self.random else torch.zeros(2)


class Stream(torch.utils.data.IterableDataset):
    """0..N-1, split between workers as torch's docs do."""

    def __len__(self):
        return N

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, N, step):
            yield torch.tensor([i]), torch.rand(2)


# name: (Accelerate's dataloader settings, dataset, loader arguments, fastfeed-only arguments)
SCENARIOS = {
    "shard": ({}, Numbers, dict(shuffle=True, num_workers=2), dict(numa="off")),
    "split": ({"split_batches": True}, Numbers, dict(shuffle=True, num_workers=0), {}),
    "iterable": ({"dispatch_batches": False}, Stream, dict(num_workers=2), {}),
    "dispatch": ({"dispatch_batches": True}, Numbers, dict(shuffle=True, num_workers=2), {}),
    "threads": ({}, lambda: Numbers(random=False), dict(shuffle=True, num_workers=2), dict(worker_type="thread")),
}
# name: (Accelerate's dataloader settings, loader arguments)
RESUMES = {
    "skip": ({"use_seedable_sampler": True}, {}),  # save_state / load_state, then skip_first_batches
    "stateful": ({"use_stateful_dataloader": True}, {}),  # the loader's state_dict() saved by save_state
    "stateful-nw0": ({"use_stateful_dataloader": True}, dict(num_workers=0)),
}


def prepared(source, settings, dataset, args, ours):
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**settings))
    set_seed(0)
    if source == "torch":
        loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, **args)
    else:
        loader = fastfeed.DataLoader(dataset(), batch_size=BATCH, **args, **ours)
    return accelerator, accelerator.prepare(loader)


def kept(dl):
    base = dl.base_dataloader
    return {"isinstance": isinstance(dl, fastfeed.DataLoader), "base": f"{type(base).__module__}.{type(base).__name__}",
            "worker_type": getattr(base, "worker_type", None), "numa": getattr(base, "numa", None)}


def flat(batch):
    return [t.clone() for t in batch]


def compare():
    seen = {}
    for name, (settings, dataset, args, ours) in SCENARIOS.items():
        for source in ("torch", "fastfeed"):
            _, dl = prepared(source, settings, dataset, args, ours)
            epochs = [[flat(b) for b in dl] for _ in range(2)]
            seen[name, source] = {"epochs": epochs, "len": len(dl), **kept(dl)}
    return seen


def resume(phase, out):
    seen = {}
    for name, (settings, args) in RESUMES.items():
        for source in ("torch", "fastfeed"):
            accelerator, dl = prepared(source, settings, Numbers, dict(dict(shuffle=True, num_workers=2), **args), {})
            where = os.path.join(out, f"state-{name}-{source}")
            after = []
            if phase == "save":
                for epoch in range(2):
                    dl.set_epoch(epoch)
                    for i, batch in enumerate(dl):
                        if epoch or i >= RESUME_AFTER:
                            after.append(flat(batch))
                        if epoch == 0 and i == RESUME_AFTER - 1:  # RESUME_AFTER batches seen
                            accelerator.save_state(where)
            else:
                accelerator.load_state(where)
                stateful = settings.get("use_stateful_dataloader")
                rest = dl if stateful else accelerator.skip_first_batches(dl, RESUME_AFTER)
                after += [flat(b) for b in rest]
                dl.set_epoch(1)
                after += [flat(b) for b in dl]
                seen[name, source, "skipped"] = kept(rest)
            seen[name, source] = {"after": after, **kept(dl)}
    return seen


if __name__ == "__main__":
    phase, out = sys.argv[1], sys.argv[2]
    seen = compare() if phase == "compare" else resume(phase, out)
    torch.save(seen, os.path.join(out, f"{phase}-rank{os.environ['RANK']}.pt"))
    # Accelerate's own ending: the process group's gloo threads end before the interpreter does. Left to exit, a
    # rank beside other work aborted in torch's teardown ("terminate called without an active exception", SIGABRT).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
