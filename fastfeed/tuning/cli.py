"""``fastfeed tune``: tune a dataset's loader from the shell, and look after the tuning cache.

fastfeed tune module:attr [--step module:fn | --step-ms MS] [--batch-size N] [--budget S] [--max-workers N]
                          [--tolerance F] [--worker-types process,thread] [--remote MAX] [--memory-budget MB]
                          [--out config.json] [--json]
fastfeed tune --show       list the tuning cache
fastfeed tune --clear      empty it

``attr`` is a Dataset, a DataLoader, or a callable with no arguments returning either; a
DataLoader's own arguments (batch size, collate function, sampling, device stage) become the
base setting, so what is tuned is the loader the training script builds.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import os
import sys
import time

from torch.utils.data import (
    DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler, default_collate, default_convert,
)  # fmt: skip
from tqdm import tqdm

from .._workers import WORKER_TYPES
from .cache import Cache, fingerprint, key_of


class TargetError(Exception):
    """A ``module:attr`` that names nothing usable; the message says why."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``tune`` to the ``fastfeed`` command's subparsers."""
    p = subparsers.add_parser(
        "tune",
        help="measure num_workers / prefetch_factor / worker_type for a dataset and save the best",
        description="Measure loader settings for a dataset, print what was tried, and optionally save the "
        "choice as a config: DataLoader(ds, **fastfeed.load_config(PATH)).",
    )
    p.add_argument("target", nargs="?", help="module:attr naming a Dataset, a DataLoader, or a no-argument callable "
                   "returning one (the module is imported from the current directory, like python -m)")  # fmt: skip
    step = p.add_mutually_exclusive_group()
    step.add_argument("--step", metavar="MODULE:FN", help="call FN(batch) as the training step for each batch")
    step.add_argument("--step-ms", type=_positive(float), metavar="MS", help="a synthetic step of MS ms per batch")
    p.add_argument("--batch-size", type=_positive(int), metavar="N",
                   help="samples per batch (overrides a DataLoader target's)")  # fmt: skip
    p.add_argument("--budget", type=_positive(float), default=60.0, metavar="S", help="seconds to spend (default 60)")
    p.add_argument("--max-workers", type=_positive(int), metavar="N",
                   help="most workers to try (default: twice this rank's CPUs)")  # fmt: skip
    p.add_argument("--tolerance", type=float, default=0.03, metavar="F",
                   help="take the cheapest setting within this fraction of the best (default 0.03)")  # fmt: skip
    p.add_argument("--worker-types", type=_worker_types, metavar="LIST",
                   help="comma-separated worker types to try (default: process, or a DataLoader target's)")  # fmt: skip
    p.add_argument("--remote", type=_positive(int), default=0, metavar="MAX",
                   help="then add up to MAX Ray actors beside the best local workers, searching their count "
                   "(needs pip install 'fastfeed[ray]' and a running Ray cluster)")  # fmt: skip
    p.add_argument("--memory-budget", type=_positive(float), metavar="MB",
                   help="memory a setting may use, batches and workers (default: half the available memory); "
                   "each worker's cost is predicted from the first trial, copy-on-read growth included")  # fmt: skip
    p.add_argument("--out", metavar="PATH", help="save the choice as a config file fastfeed.load_config reads")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--show", action="store_true", help="list the tuning cache and exit")
    cache.add_argument("--clear", action="store_true", help="empty the tuning cache and exit")
    p.set_defaults(run=functools.partial(run, p))
    return p


def run(parser: argparse.ArgumentParser, args) -> int:
    """Run ``fastfeed tune`` with parsed ``args``; usage errors exit with status 2 through ``parser``."""
    if args.show or args.clear:
        if args.target:
            parser.error("--show and --clear take no target")
        return _show(Cache()) if args.show else _clear(Cache())
    if not args.target:
        parser.error("name what to tune as module:attr (or pass --show / --clear)")
    try:
        dataset, base, worker_type = load_target(args.target)
        step = _import(args.step) if args.step else None
    except TargetError as e:
        parser.error(str(e))
    if args.step and not callable(step):
        parser.error(f"--step {args.step} is of type {type(step).__name__}, not a function of the batch")
    if args.step_ms:
        step = args.step_ms / 1000
    if args.batch_size is not None:
        if "batch_sampler" in base:
            parser.error(f"{args.target}'s batch_sampler makes the batches; --batch-size cannot change them")
        base["batch_size"] = args.batch_size
    worker_types = args.worker_types or (worker_type,)
    return _tune(args, dataset, base, step, worker_types)


def _tune(args, dataset, base: dict, step, worker_types) -> int:
    import fastfeed  # the public fastfeed.tune, at call time: the command runs what users call

    start = time.monotonic()
    bar = tqdm(total=args.budget, desc="tuning", file=sys.stderr, dynamic_ncols=True,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}")  # fmt: skip

    def on_trial(trial, best):
        # One line per trial stays on screen; the bar itself tracks the time spent against the budget.
        figure = f"skipped: {trial.skipped}" if trial.skipped else f"{trial.median:,.1f} batches/s"
        bar.write(f"  {str(trial.setting):<22} {figure}", file=sys.stderr)
        if best is not None:
            bar.set_postfix_str(f"best {best.setting} {best.median:,.1f} batches/s", refresh=False)
        bar.update(min(time.monotonic() - start, bar.total) - bar.n)

    try:
        # Looked up on the package at call time, where tests can stand in for it.
        result = fastfeed.tune(dataset, step=step, budget_s=args.budget, max_workers=args.max_workers,
                               tolerance=args.tolerance, worker_types=tuple(worker_types), on_trial=on_trial,
                               **({"remote": args.remote} if args.remote else {}),
                               **({"memory_budget": int(args.memory_budget * 2**20)} if args.memory_budget else {}),
                               **base)  # fmt: skip
    except (ImportError, RuntimeError) as e:
        if not args.remote:
            raise
        print(f"fastfeed tune --remote: {e}", file=sys.stderr)  # no Ray, or no cluster: said before any trial
        return 1
    finally:
        bar.close()
    print(json.dumps(result.as_dict()) if args.json else str(result))
    _remember(dataset, base, result)
    if args.out:
        result.save(args.out)
        # With --json, stdout is for the JSON alone.
        print(f"saved to {args.out}: DataLoader(dataset, **fastfeed.load_config({args.out!r}))",
              file=sys.stderr if args.json else sys.stdout)  # fmt: skip
    return 0


def _remember(dataset, base: dict, result) -> None:
    """Save the result in the tuning cache, where ``DataLoader(num_workers="auto", prefetch_factor="auto")``
    with the same dataset, batch size, collate function and worker type finds it (the same search space)."""
    from .auto import AUTO

    if result.remote:
        # num_workers="auto" searches local workers only: a choice with Ray actors is not its answer.
        print("not cached for num_workers='auto' (a choice with Ray actors); use the config (--out)", file=sys.stderr)
        return
    batch_size = None if "batch_sampler" in base else base.get("batch_size", 1)
    fp = fingerprint(dataset, batch_size=batch_size, collate_fn=base.get("collate_fn"),
                     worker_type=result.worker_type, space={"num_workers": AUTO, "prefetch_factor": AUTO})  # fmt: skip
    cache = Cache()
    cache.put(key_of(fp), result, fp)
    print(f"cached in {cache.path} for DataLoader(..., num_workers='auto', prefetch_factor='auto')", file=sys.stderr)


def load_target(spec: str) -> tuple:
    """What ``module:attr`` names, as ``(dataset, base loader kwargs, worker type)``.

    Raises:
        TargetError: the spec is malformed, or names nothing importable, or no Dataset/DataLoader.
    """
    obj = _import(spec)
    if not _is_target(obj):
        if not callable(obj):
            raise TargetError(f"{spec} is of type {type(obj).__name__}, not a Dataset, a DataLoader or a callable")
        _check_no_arguments(spec, obj)
        made = obj()
        if not _is_target(made):
            raise TargetError(
                f"{spec}() returned an object of type {type(made).__name__}, not a Dataset or a DataLoader"
            )
        obj = made
    if isinstance(obj, DataLoader):
        return obj.dataset, _loader_kwargs(obj), getattr(obj, "worker_type", "process")
    return obj, {}, "process"


def _import(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"{spec!r}: expected module:attr, e.g. mypkg.data:train_set")
    # Like `python -m`: modules in the current directory are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(f"cannot import {module_name}: {e}") from None
    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise TargetError(f"{spec}: {module_name} has no attribute {attr!r}") from None
    return obj


def _check_no_arguments(spec: str, fn) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: calling it will tell
        return
    try:
        signature.bind()
    except TypeError:
        raise TargetError(f"{spec} needs arguments {signature}; name a Dataset, a DataLoader, or a callable "
                          "that takes none") from None  # fmt: skip


def _is_target(obj) -> bool:
    # Like torch, accept any object indexable with a length (a list of samples is a dataset).
    if isinstance(obj, (DataLoader, Dataset)):
        return True
    return hasattr(type(obj), "__getitem__") and hasattr(type(obj), "__len__") and not isinstance(obj, (str, bytes))


def _loader_kwargs(loader: DataLoader) -> dict:
    """The arguments ``loader`` was built with, bar the ones tuning chooses (or that depend on them)."""
    kw: dict = {}
    if loader.batch_size is None and loader.batch_sampler is not None:
        kw["batch_sampler"] = loader.batch_sampler  # the user's own: it fixes batch size, order and drop_last
    else:
        kw["batch_size"] = loader.batch_size
        if loader.drop_last:
            kw["drop_last"] = True
        sampler = loader.sampler
        if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
            kw["shuffle"] = True
            if sampler.generator is not None:
                kw["generator"] = sampler.generator
        elif type(sampler) is not SequentialSampler and not isinstance(loader.dataset, IterableDataset):
            # The user's sampler (or a RandomSampler with replacement or num_samples, which
            # shuffle=True would not reproduce); an IterableDataset's is torch's own placeholder.
            kw["sampler"] = sampler
    if loader.collate_fn not in (default_collate, default_convert):
        kw["collate_fn"] = loader.collate_fn
    for name, default in (("pin_memory", False), ("timeout", 0), ("worker_init_fn", None), ("in_order", True)):
        value = getattr(loader, name, default)  # in_order: torch >= 2.6 only
        if value != default:
            kw[name] = value
    if hasattr(loader, "numa"):  # a fastfeed.DataLoader
        if loader.numa != "auto":
            kw["numa"] = loader.numa
        stage = loader._ff_stage
        if stage is not None:
            kw.update(device=stage.device, device_transform=stage.transform, device_prefetch=stage.ahead)
    return kw


def _show(cache: Cache) -> int:
    entries = cache.entries()
    if not entries:
        print(f"tuning cache {cache.path}: empty")
        return 0
    print(f"tuning cache {cache.path}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    print(f"{'key':<16}  {'dataset':<32} {'batch':>5}  {'choice':<22} {'batches/s':>10}  saved")
    for key, entry in sorted(entries.items(), key=lambda kv: str(kv[1].get("saved", ""))):
        fp, result = entry.get("fingerprint", {}), entry.get("result", {})
        kw = entry.get("loader_kwargs", {})
        pf = kw.get("prefetch_factor")
        choice = f"nw={kw.get('num_workers')} pf={'-' if pf is None else pf} {kw.get('worker_type')}"
        batch = fp.get("batch_size")
        throughput = result.get("throughput")
        figure = f"{throughput:,.1f}" if isinstance(throughput, (int, float)) else "?"
        print(f"{key:<16}  {fp.get('dataset_type', '?'):<32} {'-' if batch is None else batch:>5}  {choice:<22} "
              f"{figure:>10}  {entry.get('saved', '?')}")  # fmt: skip
    return 0


def _clear(cache: Cache) -> int:
    removed = cache.clear()
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.path}")
    return 0


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _worker_types(text: str) -> tuple:
    types = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in types if t not in WORKER_TYPES]
    if not types or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: use a comma-separated list of {', '.join(WORKER_TYPES)}")
    return types
