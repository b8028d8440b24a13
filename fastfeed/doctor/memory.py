"""Memory: each worker's private growth over the run, the machine's headroom, and copy-on-read named.

A map-style dataset that keeps its metadata as Python objects (a million dicts of file names and labels) is
shared with forked workers page by page, until a worker reads an object: reading writes its reference count, so
the page holding it is copied into that worker (pytorch/pytorch#13246). Each worker's private memory (USS) then
grows with the samples it reads, toward the size of those objects, and the machine holds workers x ranks copies.
Users cut ``num_workers`` to survive it, and the GPU starves.

The sampler reads each worker's USS and the machine's available memory beside the stall records
(``fastfeed.doctor.sampler``: ``proc_uss``, ``mem_available``). From them:

- each worker's USS at its first reading, at its last and at its peak, and its growth (last - first);
- the machine's memory and what was available (at the start, the lowest, at the end): its headroom;
- **copy-on-read**, when the workers' mean growth is at least ``COPY_ON_READ_MIN`` and it tracks the batches read
  (Pearson ``r`` >= ``TRACKS`` between a worker's growth since its first reading and the batches the loop took
  meanwhile, over the readings while it grew: once every page is copied it grows no more, however much it reads),
  and every worker still holds at the end at least ``KEPT`` of its peak growth (copied pages stay copied). It names
  the dataset's largest Python container (``LoaderRecord.containers``, found by
  ``fastfeed.sharing.large_containers`` before the workers were forked) and advises ``fastfeed.share``, with the
  memory it saves (the workers x their growth) and the workers that memory would hold at a worker's own cost.
"""

from __future__ import annotations

import bisect
import statistics

from .evidence import Evidence, pearson
from .timeline import Timeline

COPY_ON_READ_MIN = 16 << 20  # mean growth per worker below this is not worth naming
TRACKS = 0.6  # correlation of growth with the batches read that calls the growth copy-on-read
GROWN = 0.9  # the share of its growth by which a worker counts as grown (the rest is the plateau)
KEPT = 0.8  # the share of its peak growth a copying worker still holds at the end
LOW_HEADROOM = 0.1  # the lowest available memory under this share of the machine's is said to be low
MIN_WORKER_BYTES = 1 << 20  # a worker's own cost is taken as at least this, for the workers that saving holds
NEEDS = ("the script changed where it builds the dataset: the what-if runs change the loader's arguments, "
         "not the dataset")  # fmt: skip


def mb(n) -> str:
    """Bytes as text in MB (MiB), or GB past 10 GB."""
    if n is None:
        return "n/a"
    return f"{n / 2**30:,.1f} GB" if abs(n) >= 10 * 2**30 else f"{n / 2**20:,.0f} MB"


def _series(tl: Timeline, pid: int) -> list[tuple[float, int]]:
    key = str(pid)
    return [(s["t"], s["proc_uss"][key]) for s in tl.samples if key in (s.get("proc_uss") or {})]


def analyse(tl: Timeline, ev: Evidence) -> dict | None:
    """The memory figures of the training loader's workers and the machine (see the module docstring); None
    when nothing about memory was sampled."""
    rec = ev.loader
    available = [s["mem_available"] for s in tl.samples if s.get("mem_available") is not None]
    pids = list(dict.fromkeys(p for ep in rec.epochs for p in ep.pids)) if rec is not None else []
    series = {pid: pts for pid in pids if (pts := _series(tl, pid))}
    if not series and not available:
        return None
    returns = sorted(r for _, r in ev.ends)
    workers, pairs, read = [], [], []
    for pid, pts in series.items():
        (t0, first), (t1, last) = pts[0], pts[-1]
        workers.append({"pid": pid, "start_bytes": first, "end_bytes": last, "peak_bytes": max(b for _, b in pts),
                        "growth_bytes": last - first, "readings": len(pts)})  # fmt: skip
        before = bisect.bisect_right(returns, t0)
        # Each reading against the batches the loop took since the worker's first: copy-on-read grows with them
        # until the pages are all copied, then stays, however much more is read; so the readings are taken while
        # the worker grew (up to the first at GROWN of its growth), not along the plateau after.
        top = max(b for _, b in pts) - first
        grew = next((k for k, (_, b) in enumerate(pts) if b - first >= GROWN * top), len(pts) - 1) if top > 0 else 0
        pairs += [(bisect.bisect_right(returns, t) - before, b - first) for t, b in pts[: grew + 1]]
        if len(pts) > 1:
            read.append(bisect.bisect_right(returns, t1) - before)
    grown = [w for w in workers if w["readings"] > 1]
    growth = statistics.fmean(w["growth_bytes"] for w in grown) if grown else None
    start = statistics.fmean(w["start_bytes"] for w in workers) if workers else None
    r = pearson([x for x, _ in pairs], [y for _, y in pairs]) if len(pairs) >= 4 else None
    local = max(1, rec.local_workers if rec is not None else 1)
    # The samples one worker read while it grew: the batches the loop took meanwhile, shared among the workers.
    per_worker = statistics.fmean(read) * ev.batch_size / local if read else 0.0
    containers = rec.containers if rec is not None else None
    # Copied pages stay copied: a worker whose memory went back down (a buffer allocated and freed) is not it.
    kept = all(w["end_bytes"] - w["start_bytes"] >= KEPT * (w["peak_bytes"] - w["start_bytes"]) for w in grown)
    copy_on_read = (growth is not None and growth >= COPY_ON_READ_MIN and r is not None and r >= TRACKS
                    and kept)  # fmt: skip
    out = {
        "workers": workers,
        "worker_start_bytes": None if start is None else int(start),
        "worker_growth_bytes": None if growth is None else int(growth),
        "workers_growth_bytes": None if growth is None else int(growth * len(grown)),
        "growth_per_sample_bytes": growth / per_worker if growth is not None and per_worker > 0 else None,
        "tracks_reads_r": r,
        "mem_total": tl.mem_total,
        "available_start": available[0] if available else None,
        "available_min": min(available) if available else None,
        "available_end": available[-1] if available else None,
        "headroom": min(available) / tl.mem_total if available and tl.mem_total else None,
        "containers": containers,
        "copy_on_read": copy_on_read,
        "culprit": None,
        "saving_bytes": None,
        "more_workers": None,
    }
    if copy_on_read:
        n = len(grown)
        out["saving_bytes"] = int(n * growth)
        out["more_workers"] = int(n * growth // max(start or 0, MIN_WORKER_BYTES))
        if containers:  # None: not looked for; []: none found
            name, kind, count, est = containers[0]
            out["culprit"] = {"name": name, "kind": kind, "count": count, "est_bytes": est}
    return out


def lines(m: dict | None) -> list[str]:
    """The report's text lines on memory: the workers' growth and the headroom, then copy-on-read when found."""
    if not m:
        return []
    parts = []
    if m["workers"]:
        n = len(m["workers"])
        g = m["worker_growth_bytes"]
        text = f"workers' private memory (USS) {mb(m['worker_start_bytes'])} at start"
        if g is not None:
            text += (f", {'+' if g >= 0 else ''}{mb(g)} each over the run"
                     + (f" ({n} workers: {mb(m['workers_growth_bytes'])})" if n > 1 else ""))  # fmt: skip
        parts.append(text)
    if m["available_min"] is not None:
        text = f"machine {mb(m['available_min'])} available at the lowest"
        if m["mem_total"]:
            text += f" of {mb(m['mem_total'])} ({m['headroom']:.0%} headroom)"
            if m["headroom"] < LOW_HEADROOM:
                text += ", low"
        parts.append(text)
    out = ["memory: " + "; ".join(parts)] if parts else []
    if m["copy_on_read"]:
        per = m["growth_per_sample_bytes"]
        text = ("copy-on-read: the workers' private memory grew with the samples they read "
                f"(r={m['tracks_reads_r']:.2f}" + (f", {per:,.0f} B per sample read" if per else "") + ")")
        c = m["culprit"]
        if c:
            text += (f": dataset.{c['name']} ({c['kind']} of {c['count']:,} Python objects, ~{mb(c['est_bytes'])}) "
                     "is copied into every worker as it is read")
        elif m["containers"] is None:
            text += (": the dataset's containers were not looked for (its workers were running before the watch, "
                     "and walking its objects then would copy them into the workers)")
        else:
            text += ": no large list, tuple or dict found among the dataset's attributes to name"
        out.append(text)
    return out


def advice(m: dict | None) -> dict | None:
    """``fastfeed.share`` advised with its predicted saving, when the workers copy on read; else None."""
    if not m or not m["copy_on_read"]:
        return None
    n, growth, saving = len([w for w in m["workers"] if w["readings"] > 1]), m["worker_growth_bytes"], m["saving_bytes"]
    c = m["culprit"]
    what = (f"dataset.{c['name']} ({c['kind']} of {c['count']:,} objects, ~{mb(c['est_bytes'])})" if c
            else "the dataset's Python objects")  # fmt: skip
    why = (f"each of the {n} workers copied {mb(growth)} of {what} as it read it (copy-on-read: reading an object "
           f"writes its reference count); held once in shared memory, that saves ~{mb(saving)} ({n} x {mb(growth)})")
    if c and c["est_bytes"] > growth:
        why += f", and up to {mb(n * c['est_bytes'])} once every worker has read all of it"
    start = max(m["worker_start_bytes"] or 0, MIN_WORKER_BYTES)
    why += f": room for {m['more_workers']} more workers at {mb(start)} each"
    return {"change": "dataset = fastfeed.share(dataset)", "setting": None, "why": why,
            "predicted_samples_per_s": None, "predicted_gain": None, "needs": NEEDS,
            "predicted_saving_bytes": saving, "more_workers": m["more_workers"]}  # fmt: skip


def job(ranks: list[tuple[int, str, dict | None]]) -> dict | None:
    """A job's memory over its ranks, from each rank's ``analyse`` (``(rank, host, memory)``); None when no rank
    sampled memory.

    Every rank forks its own workers from its own copy of the dataset, so a job holds ranks x workers copies of
    what they copy on read: the job's figures are sums over the ranks (the workers' private memory at the end and
    their growth; ``fastfeed.share``'s saving), and each machine's headroom is the lowest any of its ranks saw."""
    seen = [(rank, host, m) for rank, host, m in ranks if m]
    if not seen:
        return None
    hosts: dict[str, dict] = {}
    for rank, host, m in seen:
        h = hosts.setdefault(host, {"host": host, "ranks": [], "mem_total": m["mem_total"], "available_min": None})
        h["ranks"].append(rank)
        if m["available_min"] is not None:
            low = h["available_min"]
            h["available_min"] = m["available_min"] if low is None else min(low, m["available_min"])
    for h in hosts.values():
        h["headroom"] = h["available_min"] / h["mem_total"] if h["available_min"] is not None and h["mem_total"] else None
    copying = [(rank, m) for rank, _, m in seen if m["copy_on_read"]]
    culprit = next((m["culprit"] for _, m in copying if m["culprit"]), None)
    return {
        "ranks": [rank for rank, _, _ in seen],
        "workers": sum(len(m["workers"]) for _, _, m in seen),
        "workers_end_bytes": sum(w["end_bytes"] for _, _, m in seen for w in m["workers"]),
        "workers_growth_bytes": sum(m["workers_growth_bytes"] or 0 for _, _, m in seen),
        "hosts": list(hosts.values()),
        "copy_on_read_ranks": [rank for rank, _ in copying],
        "copying_workers": sum(len([w for w in m["workers"] if w["readings"] > 1]) for _, m in copying),
        "culprit": culprit,
        "saving_bytes": sum(m["saving_bytes"] or 0 for _, m in copying) if copying else None,
        "more_workers": sum(m["more_workers"] or 0 for _, m in copying) if copying else None,
    }


def job_lines(j: dict | None) -> list[str]:
    """The job report's text lines on memory, summed over the ranks (``job``)."""
    if not j:
        return []
    ranks = len(j["ranks"])
    text = (f"memory, job: {j['workers']} workers over {ranks} rank{'s' * (ranks > 1)} hold {mb(j['workers_end_bytes'])}"
            f" of private memory (USS) at the end, {mb(j['workers_growth_bytes'])} of it grown over the run")
    for h in j["hosts"]:
        if h["available_min"] is not None:
            text += f"; {h['host'] or 'this machine'}: {mb(h['available_min'])} available at the lowest"
            if h["headroom"] is not None:
                text += f" ({h['headroom']:.0%} headroom{', low' if h['headroom'] < LOW_HEADROOM else ''})"
    out = [text]
    if j["copy_on_read_ranks"]:
        c = j["culprit"]
        what = f"dataset.{c['name']} ({c['kind']} of {c['count']:,} objects)" if c else "the dataset's Python objects"
        out.append(f"copy-on-read on rank{'s' * (len(j['copy_on_read_ranks']) > 1)} "
                   f"{', '.join(map(str, j['copy_on_read_ranks']))}: {j['copying_workers']} workers each copy {what} "
                   f"as they read it; held once per machine (fastfeed.share), that saves ~{mb(j['saving_bytes'])} "
                   "over the job")  # fmt: skip
    return out


def job_advice(j: dict | None) -> dict | None:
    """``fastfeed.share`` for the whole job, with its saving summed over the ranks; None without copy-on-read."""
    if not j or not j["copy_on_read_ranks"]:
        return None
    c = j["culprit"]
    what = f"dataset.{c['name']}" if c else "the dataset's Python objects"
    n, ranks = j["copying_workers"], len(j["copy_on_read_ranks"])
    why = (f"{n} workers over {ranks} rank{'s' * (ranks > 1)} each copied {what} as they read it; held once per "
           f"machine in shared memory (fastfeed.share: local rank 0 writes it, the other ranks map it), that saves "
           f"~{mb(j['saving_bytes'])}: room for {j['more_workers']} more workers")
    return {"change": "dataset = fastfeed.share(dataset)", "setting": None, "why": why, "rank": None,
            "predicted_samples_per_s": None, "predicted_gain": None, "needs": NEEDS,
            "predicted_saving_bytes": j["saving_bytes"], "more_workers": j["more_workers"]}  # fmt: skip
