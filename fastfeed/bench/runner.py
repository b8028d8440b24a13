"""Shared benchmark runner: a candidate loader against torch's DataLoader, in the same run.

Absolute times do not carry between runs on shared machines, so every figure is a ratio
measured here and now: each round runs torch and the candidate back to back, alternating
which goes first (A B, B A, ...), and the summary is the median, min and max of the
per-round ratios (the method is in benchmarks/README.md).

The candidate is ``fastfeed.DataLoader``. ``FASTFEED_BENCH_CANDIDATE=torch`` (or the hidden
``--candidate torch`` flag) substitutes torch's own DataLoader, named ``torch*``, which checks
the harness itself: every ratio should then be ~1.0x. Any ``module`` or ``module:Class`` works too.

A trial is either a steady state (:func:`run_trial`: one iterator, warm-up, timed and memory
batches) or, in epoch mode (``--epoch-batches N``), whole epochs of one loader (:func:`run_epochs`),
each timed from ``iter(loader)`` to its last batch.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import importlib
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader

CANDIDATE_ENV = "FASTFEED_BENCH_CANDIDATE"
REPO = Path(__file__).resolve().parent.parent.parent  # the checkout, when fastfeed runs from one (git commit)
MB = 1e6

# figure -> (record key, scale to the display unit, display unit, floor). Ratios use the raw
# key, and only where the baseline exceeds the floor: a PSS growth of under 1 MB is noise
# (e.g. torch at nw=0 on 4 KB batches), and a ratio of noise means nothing.
FIGURES = {
    "throughput": ("batches_per_s", 1.0, "batch/s", 0.0),
    "main_cpu_s": ("main_cpu_s", 1.0, "s", 0.0),
    "tree_cpu_s": ("tree_cpu_s", 1.0, "s", 0.0),
    "peak_pss": ("pss_delta_mb", 1.0, "MB", 1.0),
    "peak_pss_abs": ("pss_peak_mb", 1.0, "MB", 0.0),
    "peak_footprint": ("foot_delta_mb", 1.0, "MB", 1.0),
    "ttfb": ("ttfb_s", 1e3, "ms", 0.0),
    "ctor_ttfb": ("ctor_ttfb_s", 1e3, "ms", 0.0),
    "ttfb_hot": ("ttfb_hot_s", 1e3, "ms", 0.0),  # epoch mode only: first batch of epoch 2 and later
    "stall": ("stall_fraction", 100.0, "%", 0.0),  # with a step only: the loop's share spent waiting for input
}
GBPS = ("bytes_per_s", 1e-9, "GB/s", 0.0)


@dataclass(frozen=True)
class Comparison:
    """One question asked of candidate and baseline: the same workload, maybe different kwargs.

    Attributes:
        workload: A ``workloads.Workload``.
        label: Short name, e.g. ``"nw=2"`` or ``"nw=2 vs torch nw=0"``.
        candidate_kwargs: Loader kwargs for the candidate, on top of the workload's.
        baseline_kwargs: Loader kwargs for torch, on top of the workload's.
        warmup: Untimed batches per trial, the first included (at least 1).
        batches: Timed batches per trial.
        mem_batches: Batches per trial iterated, untimed, for the peak PSS.
        bars: Figure -> ``(">=" or "<=", ratio)`` the brief sets for this comparison.
        candidate_tag: Appended to the candidate's printed name (``"process"``: ``fastfeed-process``).
        variants: More candidate sides, run in the same rounds: tag -> candidate kwargs (on top of
            the workload's), or tag -> ``(factory, kwargs)`` for a side whose loader is not the
            candidate class but ``factory(dataset, **kwargs)`` (jpeg.py's DALI side: a pipeline,
            not a ``DataLoader``). Variant ``v`` is summarized against the baseline, under the key
            ``"<workload> <label> <v>"``, and against the candidate, under
            ``"<workload> <label> <v>/<candidate_tag or 'candidate'>"``.
        variant_bars: Variant tag -> bars, as ``bars``, for that variant against the baseline.
        step_s: A synthetic training step of this many seconds after each timed batch (``fastfeed bench
            --step``): throughput is then the loop's, and ``stall`` the share of it spent waiting for input.
        epoch_batches: 0: a trial is one iterator over warm-up, timed and memory batches (steady
            state). N > 0: epoch mode, a trial is whole epochs of N batches of one loader (see
            :func:`run_epochs`); ``warmup`` is then unused (epoch 1 is the warm-up) and ``batches``
            sets the number of timed epochs, :attr:`epochs`.
        prime: Run one untimed priming trial per side before round 0. A script whose comparisons
            share a workload may prime only the first (prefetch.py: 32 comparisons).
    """

    workload: Any
    label: str
    candidate_kwargs: dict
    baseline_kwargs: dict
    warmup: int
    batches: int
    mem_batches: int
    bars: dict = field(default_factory=dict)
    candidate_tag: str = ""
    variants: dict = field(default_factory=dict)
    variant_bars: dict = field(default_factory=dict)
    epoch_batches: int = 0
    prime: bool = True
    step_s: float = 0.0

    @property
    def epochs(self) -> int:
        """Timed epochs per trial in epoch mode (0 in steady state): about ``batches`` timed
        batches, and at least 2, so that the hot time to first batch is a median of two or more."""
        return timed_epochs(self.batches, self.epoch_batches)


def timed_epochs(batches: int, epoch_batches: int) -> int:
    """Timed epochs for ``batches`` timed batches in epochs of ``epoch_batches``: ``ceil``, at least 2."""
    return max(2, math.ceil(batches / epoch_batches)) if epoch_batches > 0 else 0


# --- candidate -----------------------------------------------------------------------------


def resolve_candidate(spec: str | None = None) -> tuple[type, str]:
    """Find the candidate loader class.

    Args:
        spec: ``"torch"``, ``"module"`` or ``"module:Class"``; default: ``$FASTFEED_BENCH_CANDIDATE``,
            else ``fastfeed``.

    Returns:
        The class and the name to print for it (``torch*`` when it is torch's own).
    """
    spec = spec or os.environ.get(CANDIDATE_ENV) or "fastfeed"
    module, _, attr = ("torch.utils.data" if spec == "torch" else spec).partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr or "DataLoader")
    except (ImportError, AttributeError) as exc:
        sys.exit(f"candidate {spec!r} is not importable ({exc!r}); "
                 f"{CANDIDATE_ENV}=torch measures torch against itself")
    return cls, "torch*" if cls is TorchDataLoader else module.split(".")[0]


# --- memory: PSS summed over this process and its descendants ------------------------------


def process_tree(root: int | None = None) -> list[int]:
    """Pids of ``root`` (default: this process) and all its live descendants."""
    # /proc/<pid>/task/*/children needs CONFIG_PROC_CHILDREN, absent on some kernels, so scan ppids.
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited while we scanned
            children.setdefault(ppid, []).append(int(entry.name))
    tree = [root or os.getpid()]
    for pid in tree:  # grows while we walk it: breadth-first over grandchildren too
        tree.extend(children.get(pid, ()))
    return tree


def _pss_anon_shmem_mb(pids: Sequence[int]) -> tuple[float, float]:
    """Summed ``Pss_Anon`` and ``Pss_Shmem`` of ``pids``, in MB, from one read of each smaps_rollup.

    Reading smaps_rollup walks the process's page tables: ~8 ms for a process that maps the
    transport pool (403 MB), so each is read once per sample. Kernels before 5.9 give only the
    total ``Pss``, counted as anonymous.
    """
    anon_kb = shmem_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                fields = dict(line.split()[:2] for line in f if line.startswith(b"Pss"))
        except OSError:
            continue  # a vanished pid counts 0
        if b"Pss_Anon:" in fields:
            anon_kb += int(fields[b"Pss_Anon:"])
            shmem_kb += int(fields.get(b"Pss_Shmem:", 0))
        else:
            anon_kb += int(fields.get(b"Pss:", 0))
    return anon_kb * 1024 / MB, shmem_kb * 1024 / MB


def pss_mb(pids: Sequence[int], anon_only: bool = False) -> float:
    """Summed PSS of anonymous and shared memory of ``pids``, in MB (a vanished pid counts 0).

    File-backed pages (the code of torch and Python) are left out: this VM's proactive reclaim
    (kdamond) evicts and refaults them at random, which moved the sum by ~15 MB from one sample
    to the next, and a loader's buffers are anonymous or shared memory, never file-backed.
    """
    anon, shmem = _pss_anon_shmem_mb(pids)
    return anon if anon_only else anon + shmem


def shmem_mb() -> float:
    """All shared memory on the machine (/proc/meminfo ``Shmem``), in MB.

    PSS only sees shared memory that some process maps. torch's workers hand each batch over as
    a file descriptor in a socket message, and while it waits there nobody maps it, so PSS misses
    torch's in-flight batches. The machine-wide figure counts them (it is only meaningful when
    nothing else on the machine is allocating shared memory).
    """
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"Shmem:"):
                return int(line.split()[1]) * 1024 / MB
    return 0.0


def footprint_mb(pids: Sequence[int]) -> float:
    """Anonymous PSS of ``pids`` plus all shared memory: the memory a loader really holds."""
    return pss_mb(pids, anon_only=True) + shmem_mb()


class PeakPss:
    """Peak of the PSS summed over the process tree, from synchronous and background samples.

    PSS splits shared pages among the processes that map them, so the sum over the tree counts
    forked-but-shared memory and shared-memory batches once, not once per process.
    """

    def __init__(self):
        self.peak_mb, self.peak_procs, self.samples = 0.0, 0, 0
        self.foot_peak_mb = 0.0
        self._lock = threading.Lock()  # the consumer and the background thread both sample

    def sample(self) -> float:
        """Take one sample now; return it in MB."""
        pids = process_tree()
        anon, shmem = _pss_anon_shmem_mb(pids)
        mb, foot = anon + shmem, anon + shmem_mb()  # footprint_mb, without reading smaps twice
        with self._lock:
            self.samples += 1
            self.foot_peak_mb = max(self.foot_peak_mb, foot)
            if mb > self.peak_mb:
                self.peak_mb, self.peak_procs = mb, len(pids)
        return mb

    @contextlib.contextmanager
    def sampling(self, interval: float = 0.01) -> Iterator[None]:
        """Sample in a background thread every ``interval`` seconds while the block runs."""
        stop = threading.Event()

        def loop():
            while not stop.wait(interval):
                self.sample()

        thread = threading.Thread(target=loop, name="bench-pss", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


# --- one trial -----------------------------------------------------------------------------


def touch(batch: Any) -> int:
    """Read one element of every tensor leaf, without copying; return the leaves' total bytes."""
    if isinstance(batch, torch.Tensor):
        if batch.numel():
            # The last element: a buffer filled front to back is complete only when it is.
            batch[(-1,) * batch.dim()].item()
        return batch.nbytes
    if isinstance(batch, Mapping):
        return sum(touch(v) for v in batch.values())
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return sum(touch(v) for v in batch)
    return 0


def _main_cpu_s() -> float:
    # RUSAGE_SELF: every thread of this process (a loader's pin-memory thread is its cost), no workers.
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) so far of this process and its live descendants, with their reaped children.

    From ``/proc/<pid>/stat``, in clock ticks (10 ms): coarse, but worker processes are not
    reaped until their loader ends, so ``getrusage(RUSAGE_CHILDREN)`` cannot see them mid-trial.
    Each process's reaped children count too (``cutime``, ``cstime``): a worker that exits and is
    joined between two readings (epoch mode, ``persistent_workers=False``) moves its CPU from its
    own entry to its parent's, so the difference of two readings keeps it.
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in process_tree():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we read
        total += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime: fields 14-17
    return total / tick


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS.

    glibc keeps freed chunks (a 9.6 MB batch, a trial's dataset) in the heap, where they stay
    resident: the next trial's PSS baseline would include them and its loader would reuse them
    without growing PSS at all, so a trial's figure would depend on the one before it.
    """
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim with


def _wait_for_exit(pids: set[int], timeout: float = 5.0) -> int:
    """Wait until none of ``pids`` is a live descendant; return how many still are."""
    deadline = time.monotonic() + timeout
    while (left := pids & set(process_tree())) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(left)


def run_trial(loader_cls: type, workload: Any, kwargs: dict, warmup: int, batches: int,
              mem_batches: int = 0, step_s: float = 0.0) -> dict:
    """Build a fresh dataset and loader and iterate it in four phases.

    1. ``iter(loader)`` to the first batch: time to first batch.
    2. ``warmup - 1`` more untimed batches, so the timer starts with workers up and queues full.
    3. ``batches`` timed batches: throughput, main-process CPU and the CPU of the whole process tree
       (main process and workers).
    4. ``mem_batches`` more batches, with a PSS sample after each and a thread sampling every ~10 ms.

    Reading smaps_rollup walks a process's page tables (~5 ms for a process that has imported
    torch, on this machine) under its mmap lock, which stalls the loader's own mmap/munmap: run
    alongside the timed phases it cut torch's nw=0 throughput 5x. So phases 1-3 are sampled only
    between phases. In phase 4 the consumer waits for a sample after every batch, so the loader's
    queues fill as they do behind a slow training step: the peak is that worst case, measured
    the same way for both loaders, and the thread catches transients between batches.

    Args:
        loader_cls: A DataLoader-compatible class.
        workload: A ``workloads.Workload``; its dataset is made fresh for this trial.
        kwargs: Loader kwargs (the workload's and the comparison's, merged).
        warmup: Untimed batches, counting the first (at least 1).
        batches: Timed batches (0: no throughput figures).
        mem_batches: Untimed batches iterated for the peak PSS (phase 4).
        step_s: Seconds slept after each timed batch (a training step that leaves the CPUs to the loader, as
            a GPU step does); the record's ``stall_fraction`` is then the timed phase's share spent in ``next``.

    Returns:
        The trial record: times, throughput, main-process and process-tree CPU, PSS figures.
    """
    warmup = max(1, warmup)
    _release_freed_memory()
    before = set(process_tree())
    dataset = workload.make_dataset((warmup + batches + mem_batches) * kwargs.get("batch_size", 1))
    mem = PeakPss()
    loader = it = None
    try:
        pss_base = mem.sample()  # after the dataset exists: its pool is not the loader's memory
        foot_base = mem.foot_peak_mb
        t0 = time.perf_counter()
        loader = loader_cls(dataset, **kwargs)
        t1 = time.perf_counter()
        it = iter(loader)
        touch(next(it))
        t2 = time.perf_counter()
        mem.sample()
        for _ in range(warmup - 1):
            touch(next(it))
        mem.sample()
        tree0 = _tree_cpu_s()  # scanning /proc costs main-process CPU: outside the timed phase
        cpu0, w0 = _main_cpu_s(), time.perf_counter()
        if step_s > 0:
            nbytes, waited = _stepped(it, batches, step_s)
        else:
            nbytes, waited = sum(touch(next(it)) for _ in range(batches)), None
        w1, cpu1 = time.perf_counter(), _main_cpu_s()
        tree1 = _tree_cpu_s()
        mem.sample()
        with mem.sampling():
            for _ in range(mem_batches):
                touch(next(it))
                mem.sample()
    finally:
        # Drop every reference so this trial's workers and buffers cannot pollute the next.
        del it, loader, dataset
        _release_freed_memory()
        leftover = _wait_for_exit(set(process_tree()) - before)
    seconds = w1 - w0
    return dict(
        ctor_s=t1 - t0, ttfb_s=t2 - t1, ctor_ttfb_s=t2 - t0, seconds=seconds,
        batches_per_s=batches / seconds if batches else None,
        bytes_per_s=nbytes / seconds if batches else None, bytes=nbytes,
        main_cpu_s=cpu1 - cpu0 if batches else None,
        tree_cpu_s=tree1 - tree0 if batches else None,
        pss_base_mb=pss_base, pss_peak_mb=mem.peak_mb, pss_delta_mb=mem.peak_mb - pss_base,
        foot_peak_mb=mem.foot_peak_mb, foot_delta_mb=mem.foot_peak_mb - foot_base,
        peak_procs=mem.peak_procs, pss_samples=mem.samples, leftover_procs=leftover,
        ttfb_hot_s=None, stop_s=None,
        stall_fraction=None if waited is None or not seconds else waited / seconds,
    )


def _stepped(it: Iterator, batches: int, step_s: float) -> tuple[int, float]:
    """``batches`` batches, each followed by a step of ``step_s``: (bytes, seconds spent waiting in ``next``)."""
    nbytes, waited = 0, 0.0
    for _ in range(batches):
        t0 = time.perf_counter()
        batch = next(it)
        waited += time.perf_counter() - t0
        nbytes += touch(batch)
        time.sleep(step_s)
    return nbytes, waited


def _next_batch(it: Iterator, epoch: int, index: int, epoch_batches: int) -> Any:
    try:
        return next(it)
    except StopIteration:
        raise RuntimeError(f"epoch {epoch} ended after {index} batches, not {epoch_batches}: "
                           f"epoch mode needs a loader that yields len(dataset) / batch_size batches") from None


def run_epochs(loader_cls: type, workload: Any, kwargs: dict, epoch_batches: int, epochs: int,
               mem_batches: int = 0) -> dict:
    """Build a fresh dataset of exactly ``epoch_batches`` batches and one loader; run whole epochs.

    A training loop's view: ``for epoch ...: for batch in loader``. With torch's default
    ``persistent_workers=False`` (which the comparison's kwargs set, or leave to the loader's
    default) every epoch starts its workers again, and that start is part of the epoch's time.
    Every epoch runs to its natural end: ``epoch_batches`` batches, then ``StopIteration`` (a loader
    that yields more or fewer raises here).

    1. Epoch 1, the warm-up: its time to first batch (``ttfb_s``; ``ctor_ttfb_s`` adds the
       constructor) is recorded, nothing else is timed. After its first batch, ``mem_batches``
       batches each followed by a PSS sample, with a thread sampling every ~10 ms (as phase 4 of
       :func:`run_trial`: queues fill as behind a slow training step); the rest unsampled.
    2. Epochs 2 to ``epochs + 1``, timed: each from the ``iter(loader)`` call to the ``next``
       that raises ``StopIteration`` and the dropping of the iterator, so each epoch's start-up
       and its end-of-epoch shutdown are in it, as in a training loop. Throughput is all their
       batches over the sum of their times; ``ttfb_hot_s`` is the median of their times to first
       batch; ``stop_s`` the median of their ends (from the last batch to the iterator's end);
       main-process and process-tree CPU are summed over the same spans.

    After the last batch of epoch 1, one PSS sample (its workers still up).

    Args:
        loader_cls: A DataLoader-compatible class.
        workload: A ``workloads.Workload``; its dataset is made fresh for this trial.
        kwargs: Loader kwargs (the workload's and the comparison's, merged).
        epoch_batches: Batches per epoch; the dataset has ``epoch_batches * batch_size`` items.
        epochs: Timed epochs, after the warm-up epoch (at least 1).
        mem_batches: Batches of epoch 1 each followed by a PSS sample (at most ``epoch_batches - 1``).

    Returns:
        The trial record, with the keys of :func:`run_trial`'s.
    """
    n = epoch_batches
    _release_freed_memory()
    before = set(process_tree())
    dataset = workload.make_dataset(n * kwargs.get("batch_size", 1))
    mem = PeakPss()
    loader = it = None
    ttfbs, spans, stops = [], [], []
    nbytes, main_cpu, tree_cpu = 0, 0.0, 0.0
    try:
        pss_base = mem.sample()  # after the dataset exists: its pool is not the loader's memory
        foot_base = mem.foot_peak_mb
        t0 = time.perf_counter()
        loader = loader_cls(dataset, **kwargs)
        t1 = time.perf_counter()
        for epoch in range(1, epochs + 2):
            timed = epoch > 1
            if timed:
                tree0 = _tree_cpu_s()  # scanning /proc costs main-process CPU: outside the epoch
                cpu0 = _main_cpu_s()
            start = time.perf_counter()
            it = iter(loader)
            got = touch(_next_batch(it, epoch, 0, n))
            first = time.perf_counter()
            done = 1
            if not timed:
                mem.sample()
                with mem.sampling():
                    for _ in range(min(mem_batches, n - 1)):
                        touch(_next_batch(it, epoch, done, n))
                        done += 1
                        mem.sample()
            while done < n:
                got += touch(_next_batch(it, epoch, done, n))
                done += 1
            if not timed:
                mem.sample()  # the epoch's last batch is out, its workers still up
            s0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                pass
            else:
                raise RuntimeError(f"epoch {epoch} yielded more than {n} batches")
            it = None  # the loader's end-of-epoch shutdown, if it waits for the iterator to go
            end = time.perf_counter()
            ttfbs.append(first - start)
            if timed:
                main_cpu += _main_cpu_s() - cpu0
                tree_cpu += _tree_cpu_s() - tree0
                spans.append(end - start)
                stops.append(end - s0)
                nbytes += got
    finally:
        # Drop every reference so this trial's workers and buffers cannot pollute the next.
        del it, loader, dataset
        _release_freed_memory()
        leftover = _wait_for_exit(set(process_tree()) - before)
    seconds = sum(spans)
    return dict(
        ctor_s=t1 - t0, ttfb_s=ttfbs[0], ctor_ttfb_s=t1 - t0 + ttfbs[0], seconds=seconds,
        batches_per_s=n * epochs / seconds, bytes_per_s=nbytes / seconds, bytes=nbytes,
        main_cpu_s=main_cpu, tree_cpu_s=tree_cpu,
        pss_base_mb=pss_base, pss_peak_mb=mem.peak_mb, pss_delta_mb=mem.peak_mb - pss_base,
        foot_peak_mb=mem.foot_peak_mb, foot_delta_mb=mem.foot_peak_mb - foot_base,
        peak_procs=mem.peak_procs, pss_samples=mem.samples, leftover_procs=leftover,
        ttfb_hot_s=statistics.median(ttfbs[1:]), stop_s=statistics.median(stops),
    )


# --- interleaved rounds --------------------------------------------------------------------


def _kwargs(comp: Comparison, own: dict, mp_context: str | None) -> dict:
    kwargs = {**comp.workload.loader_kwargs, **own}
    # torch rejects a context at nw=0; a side that sets its own (None: thread workers) keeps it.
    if mp_context and kwargs.get("num_workers", 0) > 0 and "multiprocessing_context" not in own:
        kwargs["multiprocessing_context"] = mp_context
    return kwargs


def _tagged(name: str, tag: str) -> str:
    return f"{name}-{tag}" if tag else name


def compare(comp: Comparison, candidate: type, baseline: type = TorchDataLoader, rounds: int = 5,
            mp_context: str | None = None, names: tuple[str, str] = ("candidate", "torch")) -> list[dict]:
    """Run ``rounds`` rounds of baseline and candidate trials (and variants), interleaved.

    Round r runs baseline then candidate when r is even, the reverse when odd, so drift in
    the machine's state (frequency, page cache, neighbours) hits both sides alike. With
    variants, round r runs the sides (baseline, candidate, variants...) rotated left by r, so
    over a multiple of their number of rounds each side runs in each position equally often.
    One untimed priming trial per side first absorbs one-time costs (lazy imports, helper processes),
    unless ``comp.prime`` is false.
    In epoch mode (``comp.epoch_batches > 0``) a trial is :func:`run_epochs`, else :func:`run_trial`.

    Args:
        comp: What to compare.
        candidate: The candidate loader class.
        baseline: The baseline loader class, torch's DataLoader.
        rounds: Number of rounds.
        mp_context: ``multiprocessing_context`` for both loaders when they have workers.
        names: Names of candidate and baseline, stored in the records (the candidate's and the
            variants' with their tags appended).

    Returns:
        One record per trial (``(2 + len(comp.variants)) * rounds``); ``role`` is ``"baseline"``,
        ``"candidate"`` or a variant's tag.
    """
    sides = {
        "baseline": (baseline, _kwargs(comp, comp.baseline_kwargs, mp_context), names[1]),
        "candidate": (candidate, _kwargs(comp, comp.candidate_kwargs, mp_context),
                      _tagged(names[0], comp.candidate_tag)),
    }
    for tag, own in comp.variants.items():
        if SESSION.variants is not None and tag not in SESSION.variants:
            continue
        if tag in sides:
            raise ValueError(f"a variant may not be named {tag!r}")
        factory, own = own if isinstance(own, tuple) else (candidate, own)
        sides[tag] = (factory, _kwargs(comp, own, mp_context), _tagged(names[0], tag))
    for cls, kwargs, _ in sides.values() if comp.prime else ():
        run_trial(cls, comp.workload, kwargs, warmup=1, batches=1)
    n = comp.epoch_batches
    if n > 0:  # one epoch of the warm-up, all timed epochs' batches, the sampled part of epoch 1
        counts = dict(warmup=n, batches=n * comp.epochs, mem_batches=min(comp.mem_batches, n - 1))
    else:
        counts = dict(warmup=comp.warmup, batches=comp.batches, mem_batches=comp.mem_batches)
    records = []
    roles = list(sides)
    bar = _progress(comp, rounds * len(roles))
    for r in range(rounds):
        k = r % len(roles)
        order = roles[k:] + roles[:k]  # two sides: (baseline, candidate), (candidate, baseline), ...
        for position, role in enumerate(order):
            cls, kwargs, name = sides[role]
            rec = dict(workload=comp.workload.name, comparison=comp.label, round=r, position=position,
                       role=role, loader=name, num_workers=kwargs.get("num_workers", 0),
                       **counts, epoch_batches=n, epochs=comp.epochs)
            t0 = time.perf_counter()
            if n > 0:
                rec.update(run_epochs(cls, comp.workload, kwargs, n, comp.epochs, comp.mem_batches))
            else:
                rec.update(run_trial(cls, comp.workload, kwargs, comp.warmup, comp.batches, comp.mem_batches,
                                     comp.step_s or SESSION.step_s))
            rec["wall_s"] = time.perf_counter() - t0  # the whole trial: dataset, sampling, teardown
            records.append(rec)
            if bar is not None:
                bar.set_postfix_str(f"{name} {_shown(comp, rec)}")
                bar.update()
    if bar is not None:
        bar.close()
    return records


@dataclass
class Session:
    """What ``fastfeed bench`` asks of every comparison a suite builds (the scripts leave the defaults).

    Attributes:
        progress: a tqdm bar per comparison on stderr, its postfix the latest trial's loader and figure.
        variants: the variant tags to run (``{"thread", "dali"}``); None runs every one the suite builds.
        step_s: a synthetic training step after each timed batch, for comparisons that set none.
    """

    progress: bool = False
    variants: set | None = None
    step_s: float = 0.0


SESSION = Session()


def progress(total: int, desc: str):
    """A tqdm bar on stderr when the session asks for bars, else None."""
    if not SESSION.progress:
        return None
    from tqdm import tqdm

    # disable=None: a bar on a terminal only; a log gets the figure lines, not a bar's every redraw
    return tqdm(total=total, desc=desc, unit="trial", leave=False, file=sys.stderr, disable=None)


def _progress(comp: Comparison, trials: int):
    return progress(trials, f"{comp.workload.name} {comp.label}")


def _shown(comp: Comparison, rec: dict) -> str:
    """A trial's throughput in the workload's unit, for the progress bar."""
    key, scale, unit, _ = _figures(comp.workload.unit)["throughput"]
    value = rec.get(key)
    return "-" if value is None else f"{fmt(value * scale)} {unit}"


# --- summary and output --------------------------------------------------------------------


def _figures(unit: str) -> dict[str, tuple[str, float, str, float]]:
    return {**FIGURES, "throughput": GBPS} if unit == "GB/s" else FIGURES


def summarize(comp: Comparison, records: list[dict], num: str = "candidate", den: str = "baseline") -> dict:
    """Median, min and max over rounds of the candidate/baseline ratio, for every figure.

    Args:
        comp: The comparison the records belong to.
        records: Its trial records, from :func:`compare`.
        num: Role of the ratio's numerator (``"candidate"`` or a variant's tag).
        den: Role of its denominator (``"baseline"`` or ``"candidate"``).

    Returns:
        Figure -> ``{median, min, max, candidate, baseline, unit}`` (candidate and baseline are
        medians of absolute values in ``unit``, of ``num`` and ``den``), plus ``bar`` and
        ``meets_bar`` where one is set (``comp.bars`` for candidate/baseline, ``comp.variant_bars``
        for a variant/baseline; none against the candidate).
    """
    rounds: dict[int, dict[str, dict]] = {}
    for rec in records:
        rounds.setdefault(rec["round"], {})[rec["role"]] = rec
    bars = {} if den != "baseline" else comp.bars if num == "candidate" else comp.variant_bars.get(num, {})
    out: dict[str, Any] = {}
    for fig, (key, scale, unit, floor) in _figures(comp.workload.unit).items():
        pairs = [(r[num].get(key), r[den].get(key)) for r in rounds.values()
                 if r[num].get(key) is not None and r[den].get(key) is not None]
        ratios = [c / b for c, b in pairs if b > floor]
        stat = dict(median=None, min=None, max=None, candidate=None, baseline=None, unit=unit)
        if pairs:
            stat.update(candidate=statistics.median(c for c, _ in pairs) * scale,
                        baseline=statistics.median(b for _, b in pairs) * scale)
        if ratios:
            stat.update(median=statistics.median(ratios), min=min(ratios), max=max(ratios))
        if fig in bars:
            op, bar = bars[fig]
            stat["bar"] = f"{op}{bar}"
            ok = stat["median"] is not None and (stat["median"] >= bar if op == ">=" else stat["median"] <= bar)
            stat["meets_bar"] = ok
        out[fig] = stat
    return out


def fmt(value: float) -> str:
    """A figure for people: ``31,800`` rather than ``3.18e+04``, ``2.03`` rather than ``2.0312``."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_line(key: str, fig: str, stat: dict, names: tuple[str, str]) -> str:
    """One printed line per figure, e.g. ``transport nw=2  fastfeed/torch throughput  median 7.1x ...``."""
    cand, base = names
    ratio = ("median n/a" if stat["median"] is None else
             f"median {stat['median']:.2f}x (min {stat['min']:.2f}x, max {stat['max']:.2f}x)")
    line = f"{key}  {cand}/{base} {fig}  {ratio}"
    if stat["candidate"] is not None:
        line += f"  {cand} {fmt(stat['candidate'])} {stat['unit']}  {base} {fmt(stat['baseline'])} {stat['unit']}"
    if "bar" in stat:
        line += f"  bar {stat['bar']}x {'ok' if stat['meets_bar'] else 'MISSED'}"
    return line


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def _json_name(obj: Any) -> str:
    """A variant's loader factory in ``params``: its qualified name (a function is not JSON)."""
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{obj.__module__}.{obj.__qualname__}"
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def write_results(script: str, result: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``result`` to ``<out_dir>/<script>-<timestamp>.json`` and its trial records to ``.csv``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{script}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while (out_dir / f"{stem}.json").exists():  # two runs in one second must not overwrite
        n += 1
        stem = f"{script}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    json_path, csv_path = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    json_path.write_text(json.dumps(result, indent=1, default=_json_name) + "\n")
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in result["rounds"] for k in r)))
        writer.writeheader()
        writer.writerows(result["rounds"])
    return json_path, csv_path


def run_script(script: str, comparisons: list[Comparison], args: argparse.Namespace,
               figures: Sequence[str] = tuple(FIGURES), quiet: bool = False,
               baseline: tuple[type, str] = (TorchDataLoader, "torch")) -> dict:
    """Run every comparison, print one line per figure, write JSON and CSV.

    Args:
        script: Name of the script, used for the output files.
        comparisons: What to measure.
        args: Parsed common flags (see :func:`parse_args`).
        figures: Figures to print (the JSON holds all of them).
        quiet: Print nothing but the output paths (the demo prints its own table).
        baseline: The baseline class and its name (torch's DataLoader, unless a script asks
            another question: overhead.py --stats compares fastfeed with its stats off).

    Returns:
        The result: ``workload``, ``params``, ``rounds`` (trial records) and ``summary``
        (``"<workload> <label>"`` -> figure -> stats; see :class:`Comparison` for variants' keys).
    """
    candidate, cand_name = resolve_candidate(args.candidate)
    base_cls, base_name = baseline
    names = (cand_name, base_name)
    if args.mp_context in ("spawn", "forkserver"):
        # Start these helpers now, so that they are not charged to the first trial.
        from multiprocessing import forkserver, resource_tracker
        resource_tracker.ensure_running()
        if args.mp_context == "forkserver":
            forkserver.ensure_running()
    say = (lambda *a: None) if quiet else print
    say(f"# candidate {cand_name} = {candidate.__module__}.{candidate.__qualname__}, baseline {base_name}; "
        f"{args.rounds} rounds, {os.cpu_count()} CPUs, torch {torch.__version__}")
    records, summary, pairs = [], {}, {}
    load_start = os.getloadavg()
    for comp in comparisons:
        recs = compare(comp, candidate, base_cls, args.rounds, args.mp_context, names)
        key = f"{comp.workload.name} {comp.label}"
        records += recs
        cand = _tagged(cand_name, comp.candidate_tag)
        ratios = [(key, "candidate", "baseline", (cand, base_name))]  # summary key, num, den, names
        for tag in comp.variants:
            if SESSION.variants is not None and tag not in SESSION.variants:
                continue
            ratios += [(f"{key} {tag}", tag, "baseline", (_tagged(cand_name, tag), base_name)),
                       (f"{key} {tag}/{comp.candidate_tag or 'candidate'}", tag, "candidate",
                        (_tagged(cand_name, tag), cand))]
        for skey, num, den, pair in ratios:
            summary[skey] = summarize(comp, recs, num, den)
            pairs[skey] = dict(comparison=comp.label, num=pair[0], den=pair[1],
                               num_workers=_count(comp.candidate_kwargs.get("num_workers")))
            for fig in figures:
                say(format_line(key, fig, summary[skey][fig], pair))
    result = dict(
        workload={c.workload.name: dict(c.workload.describe, unit=c.workload.unit) for c in comparisons},
        params=dict(
            script=script, argv=sys.argv[1:], quick=args.quick, rounds=args.rounds, mp_context=args.mp_context,
            candidate=cand_name, candidate_class=f"{candidate.__module__}.{candidate.__qualname__}",
            baseline_class=f"{base_cls.__module__}.{base_cls.__qualname__}",
            comparisons=[dict(asdict(c), workload=c.workload.name, epochs=c.epochs) for c in comparisons],
            python=platform.python_version(), torch=torch.__version__, numpy=np.__version__,
            cpus=os.cpu_count(), torch_threads=torch.get_num_threads(), machine=platform.platform(), git=_git_commit(),
            # Other load on the machine skews everything, torch at nw=0 most (its intra-op threads spin).
            loadavg_start=load_start, loadavg_end=os.getloadavg(),
            time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        ),
        rounds=records,
        summary=summary,
        pairs=pairs,  # summary key -> the comparison, the loaders of its ratio (numerator/denominator), nw
    )
    paths = write_results(script, result, args.out)
    print("# wrote " + ", ".join(str(p) for p in paths))
    return result


def parse_args(doc: str, argv: Sequence[str] | None, defaults: dict, quick: dict,
               extra: Any = None) -> argparse.Namespace:
    """Parse the flags every script shares; unset ones come from ``quick`` or ``defaults``.

    Args:
        doc: The script's docstring, shown by ``--help``.
        argv: Arguments (default ``sys.argv[1:]``).
        defaults: Values of rounds, warmup, batches, mem_batches, num_workers for a full run, and
            epoch_batches (a list; 0 is steady state) for a script that takes ``--epoch-batches``.
        quick: Values that ``--quick`` overrides.
        extra: Optional callable adding script-specific flags to the parser.

    Returns:
        The parsed arguments.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few rounds and batches (what the tests run)")
    p.add_argument("--rounds", type=int, help=f"rounds of interleaved trials (default {defaults.get('rounds')})")
    p.add_argument("--warmup", type=int, help="untimed batches per trial, the first included")
    p.add_argument("--batches", type=int, help="timed batches per trial")
    p.add_argument("--mem-batches", type=int, help="untimed batches per trial, each followed by a PSS sample")
    p.add_argument("--num-workers", type=int, nargs="+", help="worker counts to measure")
    if "epoch_batches" in defaults:  # only scripts whose question has epochs take it
        p.add_argument("--epoch-batches", type=int, nargs="+", metavar="N",
                       help="epoch mode: a trial runs whole epochs of N batches of one loader, each timed "
                            "from iter() to its last batch (start-up included); 0: one steady-state "
                            f"iterator (default {' '.join(map(str, defaults['epoch_batches']))})")
    p.add_argument("--mp-context", choices=("fork", "spawn", "forkserver"),
                   help="multiprocessing_context for both loaders (default: the loaders' own)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for JSON and CSV")
    p.add_argument("--candidate", help=argparse.SUPPRESS)  # e.g. "torch"; see module docstring
    if extra:
        extra(p)
    args = p.parse_args(argv)
    if any(n < 0 for n in getattr(args, "epoch_batches", None) or ()):
        p.error("--epoch-batches: N >= 1 for epochs of N batches, 0 for the steady state")
    preset = {**defaults, **quick} if args.quick else defaults
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def _count(num_workers) -> int | None:
    """A comparison's worker count for plots, or None when it has none to plot (``"auto"``)."""
    return num_workers if isinstance(num_workers, int) else None
