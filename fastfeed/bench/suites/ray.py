"""Ray workers: what a batch costs through Ray actors, how the actors scale, and local plus remote together.

Everything runs on a local fake cluster the suite starts itself (``ray.cluster_utils.Cluster`` with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, so every node talks over 127.0.0.1): a head with no CPUs, where this
process (the loop) is the driver, and --nodes worker nodes of --node-cpus declared CPUs each (more than the
machine's cores: a sleeping actor needs none). Every actor therefore runs on a node other than the loop's, and its
batches cross from that node's object store to the head's, as from a remote CPU node (over loopback, not a
network). The cluster is shut down at the end; the result says how many actors, processes and /dev/shm entries
were left behind (none expected).
  overhead  64 uint8 images of 3x224x224 per batch (9.6 MB, as transport.py; a pool of --pool-items images,
            each actor making its own pool from the dataset's spec, not receiving it), worker_type="ray" against
            worker_type="process", both num_workers=2; per round one fresh loader of each, in alternating order,
            --warmup untimed batches, then --batches timed: GB/s, and the loop's CPU per batch (this process,
            every thread: Ray's driver threads are the loop's cost too). Medians over rounds, min-max.
  receive   the rate at which the loop can receive: the scaling batches (64 uint8 of --scale-shape) with no
            cost, from --receive-actors actors: batches/s and GB/s, over --windows timed windows.
  scaling   the same batches, each sample costing a sleep (t_batch / 64: CPU work on a remote node, spent away
            from this machine's cores), 1..16 actors (num_cpus=0.5 each, so all fit); per actor count one loader,
            warm-up, then --windows timed windows of about --window-s each. Against the ideal N / t_batch
            (t_batch measured: one batch fetched and collated in this process) and the ideal capped by the
            receive rate: batches/s, and measured / capped ideal per window (median, min-max).
  mixed     a CPU-bound dataset (each sample spins --spin-ms of its thread's CPU time), local process workers
            plus Ray actors, worker_type=("process", "ray") with num_workers=(L, R), against
            worker_type="process" with L workers, and with L + R: interleaved rounds, batches/s. The actors run
            on this machine's cores too: on a 2-core machine, a remote actor's gain is the cores the local
            workers left idle, no more.

Run: .venv/bin/python benchmarks/ray.py [--quick] [--rounds N] [--actors 1 2 4 8 16] [--parts ...] [--out DIR]
(or fastfeed bench ray, which writes a report). Needs ray: pip install 'fastfeed[ray]'.

Measured:
  (2026-12-02, 2-core VM shared with other runs (load average 4-6), torch 2.13 CPU, ray 2.60.0, commit aada07e
  (main 1561c6f merged), `.venv/bin/python benchmarks/ray.py`: 3 min 24 s; cluster up in 6.9 s)
  overhead 9.6 MB nw=2  process 9.00 GB/s (8.34-9.34), loop CPU 0.20 ms/batch (0.15-0.21), first batch 42 ms
                        ray     0.46 GB/s (0.33-0.48), loop CPU 6.25 ms/batch (5.29-6.86), first batch 2,986 ms
                        ray / process: throughput 0.05x (0.04-0.06), loop CPU per batch 32.3x (25.8-38.4)
  receive 0.79 MB, 8 actors  112.0 batches/s (107.6-121.5), 0.088 GB/s, loop CPU 4.9 ms/batch
  scaling (t_batch 158 ms measured, 150 ms of sleep; no count reached the receive cap), measured / ideal:
    1 actor 6.1 batches/s 0.97x (0.96-0.97)   2: 12.2, 0.96x (0.96-0.97)   4: 23.5, 0.92x (0.87-0.99)
    8: 41.4, 0.81x (0.70-0.84)                16: 66.1 of 101.5, 0.65x (0.64-0.68)
  mixed (rerun with --parts mixed at 80 batches a trial, 5 rounds; 32 ms of CPU a batch):
    process 1 29.8 batches/s; process 1 + ray 1 28.1, 0.92x (0.86-1.50); process 2 49.9, 1.64x (1.16-1.90).
    Here the actor shares the 2 cores with the local worker, the loop and the fake cluster's own processes (three
    raylets, the GCS, their object stores): the core a second process puts to use, the actor mostly did not (the
    cause is not measured: a remote CPU node brings its own cores and its own Ray processes).
  Left behind: 0 actors, 0 processes, 0 /dev/shm entries.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .. import extras, workloads
from .ray_cluster import LocalCluster, wait_actors_gone
from .ray_trials import BATCH, Costly, batch_seconds, new_loader, stats, steady

OVERHEAD_WORKERS = 2
PARTS = ("overhead", "receive", "scaling", "mixed")
SCALING_ACTOR_CPUS = 0.5

# --- the parts ------------------------------------------------------------------------------------------------------


def overhead_part(args, say: Callable = print) -> dict:
    """9.6 MB batches through 2 Ray actors against 2 worker processes, interleaved rounds."""
    n = args.warmup + args.batches
    ds = Costly(n * BATCH, workloads.IMAGE_SHAPE, args.pool_items)
    sides = {"process": lambda: new_loader(ds, "process", OVERHEAD_WORKERS),
             "ray": lambda: new_loader(ds, "ray", OVERHEAD_WORKERS)}  # fmt: skip
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            rec = steady(sides[name], args.warmup, args.batches)
            win = rec.pop("windows")[0]
            runs[name].append(dict(rec, **win, round=r))
            say(f"  ray overhead round {r + 1}: {name:8} {win['bytes_per_s'] / 1e9:6.2f} GB/s, loop CPU "
                f"{win['main_cpu_s_per_batch'] * 1e3:6.2f} ms/batch, first batch {rec['ttfb_s'] * 1e3:6.0f} ms")
    out: dict[str, Any] = {"batch_bytes": BATCH * workloads.IMAGE_BYTES, "num_workers": OVERHEAD_WORKERS,
                           "pool_mb": round(args.pool_items * workloads.IMAGE_BYTES / 1e6, 1)}
    for name, recs in runs.items():
        out[name] = {"gb_per_s": stats([x["bytes_per_s"] / 1e9 for x in recs]),
                     "main_cpu_ms_per_batch": stats([x["main_cpu_s_per_batch"] * 1e3 for x in recs]),
                     "ttfb_s": statistics.median(x["ttfb_s"] for x in recs), "rounds": recs}  # fmt: skip
    pairs = list(zip(runs["ray"], runs["process"]))
    out["vs"] = {"throughput": stats([a["bytes_per_s"] / b["bytes_per_s"] for a, b in pairs]),
                 "main_cpu": stats([a["main_cpu_s_per_batch"] / b["main_cpu_s_per_batch"] for a, b in pairs])}
    return out


def _scale_ds(args, length: int, cost_s: float) -> Costly:
    return Costly(length, tuple(args.scale_shape), pool_items=BATCH, cost_s=cost_s)


def receive_part(args, say: Callable = print) -> dict:
    """The loop's receive rate: the scaling batches at no cost, from many actors."""
    n_actors = args.receive_actors
    batches = args.receive_batches
    warmup = 2 * n_actors
    ds = _scale_ds(args, (warmup + batches * args.windows) * BATCH, 0.0)
    rec = steady(lambda: new_loader(ds, "ray", n_actors, ray_options={"num_cpus": SCALING_ACTOR_CPUS}), warmup,
                 batches, args.windows)  # fmt: skip
    wins = rec.pop("windows")
    for w in wins:
        say(f"  ray receive {n_actors} actors: {w['batches_per_s']:7.1f} batches/s, "
            f"{w['bytes_per_s'] / 1e9:6.3f} GB/s, loop CPU {w['main_cpu_s_per_batch'] * 1e3:5.2f} ms/batch")
    return dict(rec, actors=n_actors, batch_bytes=wins[0]["batch_bytes"],
                batches_per_s=stats([w["batches_per_s"] for w in wins]),
                gb_per_s=stats([w["bytes_per_s"] / 1e9 for w in wins]),
                main_cpu_ms_per_batch=stats([w["main_cpu_s_per_batch"] * 1e3 for w in wins]), windows=wins)


def scaling_part(args, receive: dict | None, say: Callable = print) -> dict:
    """Sleeping samples on 1..16 actors against N / t_batch, capped by the receive rate."""
    cost = args.t_batch / BATCH
    t_batch = batch_seconds(_scale_ds(args, 3 * BATCH, cost))
    cap = receive["batches_per_s"]["median"] if receive else None
    say(f"  ray scaling: t_batch {t_batch * 1e3:.0f} ms measured ({args.t_batch * 1e3:.0f} ms of sleep), receive "
        f"cap {'-' if cap is None else f'{cap:.1f} batches/s'}")
    rows = []
    for n in args.actors:
        ideal = n / t_batch
        capped = min(ideal, cap) if cap else ideal
        # Windows of about --window-s at the ideal rate; the warm-up fills every actor's prefetch.
        per_window = max(4, math.ceil(args.window_s * capped))
        warmup = 2 * n + 2
        ds = _scale_ds(args, (warmup + per_window * args.windows) * BATCH, cost)
        rec = steady(lambda: new_loader(ds, "ray", n, ray_options={"num_cpus": SCALING_ACTOR_CPUS}), warmup,
                     per_window, args.windows)  # fmt: skip
        wins = rec.pop("windows")
        row = dict(rec, actors=n, ideal_batches_per_s=ideal, capped_ideal_batches_per_s=capped,
                   capped=bool(cap and cap < ideal), batches_per_window=per_window,
                   batches_per_s=stats([w["batches_per_s"] for w in wins]),
                   gb_per_s=stats([w["bytes_per_s"] / 1e9 for w in wins]),
                   vs_ideal=stats([w["batches_per_s"] / ideal for w in wins]),
                   vs_capped=stats([w["batches_per_s"] / capped for w in wins]), windows=wins)  # fmt: skip
        rows.append(row)
        say(f"  ray scaling {n:2} actors: {row['batches_per_s']['median']:7.1f} batches/s, ideal {ideal:7.1f}"
            f"{f' (capped {capped:.1f})' if row['capped'] else ''}: {row['vs_capped']['median']:.2f}x")
    return {"t_batch_s": t_batch, "sleep_s_per_batch": args.t_batch, "batch_bytes": rows[0]["windows"][0]["batch_bytes"]
            if rows else None, "receive_cap_batches_per_s": cap, "actor_cpus": SCALING_ACTOR_CPUS, "rows": rows}


def mixed_part(args, say: Callable = print) -> dict:
    """CPU-bound samples: L processes plus R actors against L processes and L + R processes, interleaved."""
    local = args.mixed_local
    cost = args.spin_ms / 1e3
    shape = tuple(args.mixed_shape)
    n = args.warmup + args.mixed_batches
    ds = Costly(n * BATCH, shape, pool_items=BATCH, cost_s=cost, how="spin")
    t_batch = batch_seconds(Costly(3 * BATCH, shape, pool_items=BATCH, cost_s=cost, how="spin"))
    sides: dict[str, Callable[[], Any]] = {f"process {local}": lambda: new_loader(ds, "process", local)}
    for r in args.mixed_remote:
        sides[f"process {local} + ray {r}"] = lambda r=r: new_loader(ds, ("process", "ray"), (local, r))
        sides[f"process {local + r}"] = lambda r=r: new_loader(ds, "process", local + r)
    names = list(sides)
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            rec = steady(sides[name], args.warmup, args.mixed_batches)
            win = rec.pop("windows")[0]
            runs[name].append(dict(rec, **win, round=rnd))
            say(f"  ray mixed round {rnd + 1}: {name:18} {win['batches_per_s']:6.1f} batches/s")
    out: dict[str, Any] = {"local": local, "remote": list(args.mixed_remote), "t_batch_s": t_batch,
                           "cpu_s_per_batch": BATCH * cost, "spin_ms_per_sample": args.spin_ms,
                           "machine_cores": os.cpu_count(), "loaders": {}, "vs": {}}  # fmt: skip
    for name, recs in runs.items():
        out["loaders"][name] = {"batches_per_s": stats([x["batches_per_s"] for x in recs]), "rounds": recs}
    base = runs[f"process {local}"]
    for name in names[1:]:
        out["vs"][name] = stats([a["batches_per_s"] / b["batches_per_s"] for a, b in zip(runs[name], base)])
    return out


# --- the run --------------------------------------------------------------------------------------------------------

DEFAULTS = dict(rounds=5, warmup=10, batches=100, pool_items=None, actors=[1, 2, 4, 8, 16], windows=3,
                window_s=2.0, t_batch=0.15, receive_actors=8, receive_batches=200, mixed_batches=80)
QUICK = dict(rounds=2, warmup=3, batches=10, pool_items=256, actors=[1, 2, 4], windows=1, window_s=1.0,
             t_batch=0.1, receive_actors=4, receive_batches=40, mixed_batches=8)


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few rounds, batches and actor counts (about a minute)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (overhead, mixed)")
    p.add_argument("--warmup", type=int, help="untimed batches per trial, the first included")
    p.add_argument("--batches", type=int, help="timed batches per overhead trial")
    p.add_argument("--pool-items", type=int, help="distinct images in the overhead pool (default: as transport.py, "
                   "at least 8x the last-level cache and 300 MB)")  # fmt: skip
    p.add_argument("--actors", type=int, nargs="+", help="actor counts of the scaling part")
    p.add_argument("--windows", type=int, help="timed windows per loader (receive, scaling)")
    p.add_argument("--window-s", type=float, help="about how long each scaling window is, at the ideal rate")
    p.add_argument("--t-batch", type=float, help="seconds of sleep per scaling batch (split over its samples)")
    p.add_argument("--scale-shape", type=int, nargs="+", default=[3, 64, 64], help="a scaling sample's shape")
    p.add_argument("--receive-actors", type=int)
    p.add_argument("--receive-batches", type=int, help="batches per receive window")
    p.add_argument("--mixed-local", type=int, default=1, help="local worker processes of the mixed part")
    p.add_argument("--mixed-remote", type=int, nargs="+", default=[1], help="Ray actors added to them")
    p.add_argument("--mixed-batches", type=int, help="timed batches per mixed trial")
    p.add_argument("--mixed-shape", type=int, nargs="+", default=[3, 32, 32])
    p.add_argument("--spin-ms", type=float, default=0.5, help="CPU milliseconds per mixed sample")
    p.add_argument("--nodes", type=int, default=2, help="worker nodes of the local cluster")
    p.add_argument("--node-cpus", type=float, default=8, help="CPUs each node declares")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--out", type=Path, help="write the result there as ray-<time>.json (fastfeed bench ray writes "
                   "its own report instead)")  # fmt: skip
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.pool_items is None:
        args.pool_items = workloads.transport_pool_items()
    for name in ("rounds", "warmup", "batches", "windows", "receive_actors", "receive_batches", "mixed_batches",
                 "mixed_local", "nodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more, got {getattr(args, name)}")
    if min(args.actors) < 1 or min(args.mixed_remote) < 1:
        p.error("--actors and --mixed-remote take counts of 1 or more")
    need = max(max(args.actors), args.receive_actors) * SCALING_ACTOR_CPUS
    if need > args.nodes * args.node_cpus:
        p.error(f"{max(args.actors)} actors of {SCALING_ACTOR_CPUS} CPU need {need:g} CPUs; the cluster declares "
                f"{args.nodes} x {args.node_cpus:g}: raise --node-cpus or --nodes")
    return args


def main(argv=None) -> dict:
    """Run the ray benchmark: start the local cluster, run the parts, shut it down; returns the result."""
    args = _parse(argv)
    say = print
    why = extras.missing(("ray",))
    if why:
        raise ImportError(f"the ray benchmark {why}")
    result: dict[str, Any] = {"workload": "ray"}
    result["params"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["params"].update(batch_size=BATCH, python=sys.version.split()[0])
    say(f"# ray: a local cluster of a CPU-less head and {args.nodes} nodes of {args.node_cpus:g} CPUs, on "
        f"{os.cpu_count()} cores; parts {', '.join(args.parts)}")
    with LocalCluster(args.nodes, args.node_cpus) as cluster:
        import ray

        result["cluster"] = cluster.describe()
        result["versions"] = {"ray": ray.__version__}
        say(f"# ray: cluster up in {cluster.start_s:.1f} s, {result['cluster']['cpus']:g} CPUs declared")
        if "overhead" in args.parts:
            say("(overhead) 9.6 MB batches, nw=2: Ray actors against worker processes")
            result["overhead"] = overhead_part(args, say)
        receive = None
        if "receive" in args.parts:
            say("(receive) the loop's receive rate: no cost per sample, many actors")
            receive = result["receive"] = receive_part(args, say)
        if "scaling" in args.parts:
            say("(scaling) sleeping samples on 1..N actors, against N / t_batch")
            result["scaling"] = scaling_part(args, receive, say)
        if "mixed" in args.parts:
            say("(mixed) CPU-bound samples: local processes plus Ray actors")
            result["mixed"] = mixed_part(args, say)
        result["actors_left"] = wait_actors_gone()
    result["left_behind"] = cluster.left_behind()
    say("")
    from ..report import ray_markdown

    say(ray_markdown(result))
    if args.out is not None:
        say(f"# result: {save(result, args.out)}")
    return result


def save(result: dict, out: Path) -> Path:
    """``result`` as ``<out>/ray-<time>.json`` (benchmarks/targets.py reads it)."""
    from ..report import portable

    out.mkdir(parents=True, exist_ok=True)
    stem = f"ray-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = out / f"{stem}.json", 1
    while path.exists():  # two runs in one second must not overwrite
        n += 1
        path = out / f"{stem}-{n}.json"
    path.write_text(json.dumps(portable(result), indent=1, default=str) + "\n")
    return path


if __name__ == "__main__":
    main()
