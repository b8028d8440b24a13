"""Random-number-generator and dataset states, for ``DataLoader.state_dict()``.

Snapshots are taken often (workers take one after every task), so ``snapshot`` only
copies the states; ``to_plain`` turns one into plain Python and tensors (what
``torch.save`` and ``torch.load(weights_only=True)`` accept) when it is asked for.
"""

from __future__ import annotations

import copy
import random
import sys

import torch


def is_stateful_dataset(dataset) -> bool:
    """An IterableDataset whose position we save and restore through its own methods."""
    return isinstance(dataset, torch.utils.data.IterableDataset) and all(
        callable(getattr(dataset, name, None)) for name in ("state_dict", "load_state_dict")
    )


def _numpy():
    return sys.modules.get("numpy")  # numpy's RNG matters only where numpy was imported


def snapshot() -> tuple:
    """The process's global RNG states (torch, random, numpy), copied cheaply."""
    np = _numpy()
    return torch.get_rng_state(), random.getstate(), None if np is None else np.random.get_state()


def rngs_to_plain(snap: tuple) -> dict:
    torch_state, py_state, np_state = snap
    plain = {"torch": torch_state, "random": py_state, "numpy": None}
    if np_state is not None:
        name, keys, pos, has_gauss, gauss = np_state
        plain["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return plain


def restore_rngs(plain: dict) -> None:
    """Set the global RNGs to a state made by ``rngs_to_plain``."""
    torch.set_rng_state(plain["torch"])
    random.setstate(plain["random"])
    np = _numpy()
    if plain["numpy"] is not None:
        if np is None:
            import numpy as np
        name, keys, pos, has_gauss, gauss = plain["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def main_rngs(generator) -> dict:
    """The main process's RNG states: global ones plus the loader's generator."""
    plain = rngs_to_plain(snapshot())
    plain["generator"] = None if generator is None else generator.get_state()
    return plain


def restore_main_rngs(plain: dict, generator) -> None:
    restore_rngs(plain)
    if generator is not None and plain["generator"] is not None:
        generator.set_state(plain["generator"])


def sampler_rngs(generator) -> dict:
    """What a sampler draws from: the global torch RNG and the loader's generator."""
    return {"torch": torch.get_rng_state(), "generator": None if generator is None else generator.get_state()}


def restore_sampler_rngs(plain: dict, generator) -> None:
    torch.set_rng_state(plain["torch"])
    if generator is not None and plain["generator"] is not None:
        generator.set_state(plain["generator"])


def dataset_state(dataset):
    """A stateful dataset's state, copied so that later changes to the dataset do not alter it."""
    return copy.deepcopy(dataset.state_dict())
