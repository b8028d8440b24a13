"""Checkpoint/resume runs: a reference run, a run stopped at a state, and its continuation.

`build(config)` makes a loader from a named configuration, the same in every process.
A run records, per epoch, each batch with the "training loop's" own random draws taken
right after it (torch, random, numpy), so a resumed run must also give the user's random
stream back as it was.
"""

import random
import sys

import numpy as np
import torch
import torch.utils.data as tud

import _candidate
import _datasets as ds
from _compare import copy_batch, seed_all

SEED = 1234
OTHER_SEED = 999  # the new process starts from another global seed: the state must restore it
EPOCHS = 3
FORK = dict(multiprocessing_context="fork")


def _config(name):
    kind, rest = name.split(":")
    opts = dict(o.split("=") for o in rest.split(",")) if rest else {}
    nw = int(opts.get("nw", 0))
    kwargs = dict(batch_size=int(opts.get("bs", 4)))
    if nw:
        kwargs.update(num_workers=nw, **FORK)
    if opts.get("persistent"):
        kwargs["persistent_workers"] = True
    sampler = None
    if kind == "map":
        dataset = ds.AugmentedDataset(23)
        if opts.get("shuffle"):
            kwargs["shuffle"] = True
        if opts.get("generator"):
            kwargs["generator"] = torch.Generator().manual_seed(7)
    elif kind == "distributed":
        dataset = ds.AugmentedDataset(23)
        sampler = kwargs["sampler"] = tud.DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True)
    elif kind == "iterable":
        dataset = ds.ShardedIterable(23)
    elif kind == "uneven":
        dataset = ds.UnevenIterable(23)
    elif kind == "stateful":
        dataset = ds.StatefulIterable(23)
    else:
        raise ValueError(name)
    return dataset, kwargs, sampler


def build(name):
    """(loader, sampler to call set_epoch on or None) for configuration `name`."""
    dataset, kwargs, sampler = _config(name)
    return _candidate.DataLoader(dataset, **kwargs), sampler


def user_draws():
    return (torch.rand(2), random.random(), np.random.rand())


def epoch(loader, sampler, number, limit=None):
    """One epoch's [(batch, user draws)], stopping after `limit` batches (None: all)."""
    if sampler is not None:
        sampler.set_epoch(number)
    out = []
    it = iter(loader)
    for batch in it:
        out.append((copy_batch(batch), user_draws()))
        if limit is not None and len(out) == limit:
            break
    return out, it


def reference(name):
    seed_all(SEED)
    loader, sampler = build(name)
    return [epoch(loader, sampler, e)[0] for e in range(EPOCHS)]


def stopped(name, at_epoch, k):
    """Run to batch k of epoch at_epoch (k None: to its end), then return (batches seen, state)."""
    seed_all(SEED)
    loader, sampler = build(name)
    seen = [epoch(loader, sampler, e)[0] for e in range(at_epoch)]
    last, it = epoch(loader, sampler, at_epoch, k)
    seen.append(last)
    state = loader.state_dict()
    del it, loader
    return seen, state


def resumed(name, at_epoch, mid_epoch, state):
    """In a fresh process: load `state` and run the rest of at_epoch (if mid_epoch) and later epochs."""
    seed_all(OTHER_SEED)
    loader, sampler = build(name)
    loader.load_state_dict(state)
    first = at_epoch if mid_epoch else at_epoch + 1
    return [epoch(loader, sampler, e)[0] for e in range(first, EPOCHS)]


if __name__ == "__main__":
    name, at_epoch, mid_epoch, state_path, out_path = sys.argv[1:]
    state = torch.load(state_path, weights_only=True)
    torch.save(resumed(name, int(at_epoch), mid_epoch == "1", state), out_path)
