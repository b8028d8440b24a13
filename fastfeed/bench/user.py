"""The user's own dataset as a ``fastfeed bench`` workload: ``module:attr``.

``attr`` is a map-style Dataset, a DataLoader (its dataset and its arguments are used: batch size,
collate function, worker count...), or a callable with no arguments returning either. A trial needs more
samples than a small dataset has, so a short dataset is read round and round (sample ``i`` is
``dataset[i % len(dataset)]``); what is measured is still the user's ``__getitem__`` and collate.
"""

from __future__ import annotations

import importlib
import os
import sys

from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.dataloader import default_collate

from . import runner, workloads

DEFAULTS = dict(rounds=5, warmup=3, batches=30, mem_batches=3)
QUICK = dict(rounds=2, warmup=2, batches=8, mem_batches=2)
KEPT = ("batch_size", "collate_fn", "pin_memory", "drop_last", "persistent_workers", "timeout", "worker_init_fn")


class Cycled(Dataset):
    """``dataset`` read round and round, ``length`` samples long (module-level, so spawned workers unpickle it)."""

    def __init__(self, dataset, length: int):
        self.dataset, self.length = dataset, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.dataset[index % len(self.dataset)]


def load(spec: str):
    """``module:attr`` -> ``(name, dataset, loader kwargs, the loader's num_workers or None)``.

    Raises:
        ValueError: ``spec`` is not ``module:attr``, or names neither a Dataset nor a DataLoader.
        ImportError / AttributeError: the module or attribute does not exist (with what was looked for).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r}: a dataset is given as module:attr (e.g. mydata:make_dataset), or name a "
                         f"standard workload: {', '.join(_standard())}")  # fmt: skip
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m does: the user's module is in the working directory
    module = importlib.import_module(module_name)
    obj = getattr(module, attr)
    if callable(obj) and not isinstance(obj, (Dataset, TorchDataLoader)):
        obj = obj()
    kwargs, nw = {}, None
    if isinstance(obj, TorchDataLoader):
        kwargs = {k: getattr(obj, k) for k in KEPT if getattr(obj, k, None) is not None}
        if kwargs.get("collate_fn") is default_collate:
            del kwargs["collate_fn"]
        if not obj.num_workers:
            kwargs.pop("persistent_workers", None)
        nw, obj = obj.num_workers, obj.dataset
    if isinstance(obj, IterableDataset) or not isinstance(obj, Dataset) or not hasattr(obj, "__len__"):
        raise ValueError(f"{spec} gives {type(obj).__name__}: fastfeed bench measures a map-style Dataset (with "
                         "__len__ and __getitem__), or a DataLoader over one")  # fmt: skip
    if len(obj) == 0:
        raise ValueError(f"{spec}: the dataset is empty")
    return attr, obj, kwargs, nw


def _standard() -> tuple:
    from .standard import STANDARD

    return STANDARD


def comparisons(spec: str, *, num_workers: list | None, batch_size: int, threads: bool, step_s: float,
                counts: dict) -> list[runner.Comparison]:
    """One comparison per worker count: fastfeed (processes, and threads when asked) against torch."""
    name, dataset, kwargs, loader_nw = load(spec)
    kwargs.setdefault("batch_size", batch_size)

    def make(n: int):
        return dataset if len(dataset) >= n else Cycled(dataset, n)

    wl = workloads.Workload(name=name, make_dataset=make, loader_kwargs=kwargs, unit="batch/s",
                            describe=dict(source=spec, samples=len(dataset), batch_size=kwargs["batch_size"],
                                          dataset=type(dataset).__qualname__))  # fmt: skip
    out = []
    for nw in num_workers or ([loader_nw] if loader_nw is not None else [0, 2]):
        if nw == "auto":
            from ..tuning.offline import rank_cpus

            base = rank_cpus()  # torch has no "auto": it runs at the count a user would pick, the CPUs
            cand, label = {"num_workers": "auto"}, f"nw=auto vs torch nw={base}"
            base_kw = {"num_workers": base}
        else:
            cand = base_kw = {"num_workers": nw}
            label = f"nw={nw}"
        variants = {}
        if threads and nw != 0:
            variants["thread"] = {**cand, "worker_type": "thread", "multiprocessing_context": None}
        out.append(runner.Comparison(wl, label, cand, base_kw, counts["warmup"], counts["batches"],
                                     counts["mem_batches"], candidate_tag="process" if variants else "",
                                     variants=variants, step_s=step_s))  # fmt: skip
    return out
