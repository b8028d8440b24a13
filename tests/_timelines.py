"""Recorded fake timelines for the doctor's verdict: any machine's (a GPU's too), built from a few numbers."""

from __future__ import annotations

from fastfeed.doctor.timeline import EpochRecord, LoaderRecord, Timeline, WorkerRecord


def make(waits, steps, *, num_workers=2, worker_s=None, worker_cpu=None, samples=None, epochs=1, cpus=2,
         gpu=False, h2d=None, kind="fastfeed", persistent=False, prefetch_factor=2, placement=None,
         first_wait=None, batch_size=16) -> Timeline:  # fmt: skip
    """A timeline of ``epochs`` epochs, each with the given per-batch ``waits`` and ``steps`` (seconds).

    ``worker_s``: each worker's seconds per batch (fastfeed's records); ``worker_cpu``: the cores each worker
    process used (in every sample's ``proc_cpu``); ``samples``: the figures of every system sample (one each
    0.1 s), or a function of the sample's time giving them; ``first_wait``: each epoch's first wait.
    """
    t = 100.0
    start = t
    rec = LoaderRecord(id=0, kind=kind, made_at="train.py:12", num_workers=num_workers,
                       prefetch_factor=prefetch_factor if num_workers else None, batch_size=batch_size,
                       persistent_workers=persistent)  # fmt: skip
    pids = list(range(1000, 1000 + num_workers))
    for e in range(epochs):
        ep = EpochRecord(ready=[] if kind == "fastfeed" else None, pids=pids if kind == "torch" else pids)
        for i, (w, s) in enumerate(zip(waits, steps)):
            if i == 0 and first_wait is not None:
                w = first_wait
            ep.asks.append(t)
            t += w
            ep.returns.append(t)
            if ep.ready is not None:
                ep.ready.append(0 if w > 1e-3 else 1)
            t += s
        if h2d is not None:
            ep.h2d = [h2d] * len(waits)
        if worker_s is not None:
            for wid in range(num_workers):
                n = len(waits) // num_workers
                ends = [ep.returns[min(len(waits) - 1, j * num_workers + wid)] for j in range(n)]
                ep.workers.append(WorkerRecord([worker_s * 0.9] * n, [worker_s * 0.1] * n, ends))
        rec.epochs.append(ep)
        t += 0.5  # between epochs
    out = []
    x = start + 0.1
    while x <= t:
        figures = samples(x - start) if callable(samples) else dict(samples or {})
        sample = {"t": x, "dt": 0.1, **figures}
        if worker_cpu is not None:
            sample["proc_cpu"] = {str(p): worker_cpu for p in pids}
        out.append(sample)
        x += 0.1
    return Timeline(start=start, end=t, loaders=[rec], samples=out, cpus=cpus,
                    gpu={"index": 0, "name": "fake"} if gpu else None, placement=placement)  # fmt: skip
