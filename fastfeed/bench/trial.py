"""One trial: a fresh dataset and loader, iterated and timed.

A trial is either a steady state (:func:`run_trial`: one iterator, warm-up, timed and memory batches) or
whole epochs of one loader (:func:`run_epochs`), each timed from ``iter(loader)`` to its last batch. The
record it returns holds the raw figures; ``summary`` turns the records of both sides into ratios.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .accounting import PeakPss, main_cpu_s, process_tree, release_freed_memory, tree_cpu_s, wait_for_exit


def drop_page_cache(paths) -> None:
    """Drop each file's pages from the page cache, so that the next epoch reads them from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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
    release_freed_memory()
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
        tree0 = tree_cpu_s()  # scanning /proc costs main-process CPU: outside the timed phase
        cpu0, w0 = main_cpu_s(), time.perf_counter()
        if step_s > 0:
            nbytes, waited = _stepped(it, batches, step_s)
        else:
            nbytes, waited = sum(touch(next(it)) for _ in range(batches)), None
        w1, cpu1 = time.perf_counter(), main_cpu_s()
        tree1 = tree_cpu_s()
        mem.sample()
        with mem.sampling():
            for _ in range(mem_batches):
                touch(next(it))
                mem.sample()
    finally:
        # Drop every reference so this trial's workers and buffers cannot pollute the next.
        del it, loader, dataset
        release_freed_memory()
        leftover = wait_for_exit(set(process_tree()) - before)
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
    release_freed_memory()
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
                tree0 = tree_cpu_s()  # scanning /proc costs main-process CPU: outside the epoch
                cpu0 = main_cpu_s()
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
                main_cpu += main_cpu_s() - cpu0
                tree_cpu += tree_cpu_s() - tree0
                spans.append(end - start)
                stops.append(end - s0)
                nbytes += got
    finally:
        # Drop every reference so this trial's workers and buffers cannot pollute the next.
        del it, loader, dataset
        release_freed_memory()
        leftover = wait_for_exit(set(process_tree()) - before)
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
