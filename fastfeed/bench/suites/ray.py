"""Ray workers: what a batch costs through Ray actors on each of their paths, how the actors scale, and local plus
remote together.

Everything runs on a local fake cluster the suite starts itself (``ray.cluster_utils.Cluster`` with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, so every node talks over 127.0.0.1): a head with no CPUs but a resource of its
own ("trainer_node"), where this process (the loop) is the driver, as on a training node, and --nodes worker nodes
of --node-cpus declared CPUs each (more than the machine's cores: a sleeping actor needs none). An actor lands on
the head only by asking for its resource; every other one runs on a node other than the loop's, as on a remote CPU
node (over loopback, not a network). A batch takes one of three paths to the loader's ring, chosen per actor
(fastfeed/_workers/ray/actor.py): "shm" (an actor on the loop's node writes into a ring slot), "stream" (another
node's sends its bytes over TCP, read straight into a slot), "object store" (returned through Ray's object store,
then copied into a slot). The cluster is shut down at the end; the result says how many actors, processes and
/dev/shm entries were left behind (none expected).
  overhead  64 uint8 images of 3x224x224 per batch (9.6 MB, as transport.py; a pool of --pool-items images,
            each actor making its own pool from the dataset's spec, not receiving it), num_workers=2 of: processes
            (worker_type="process"); Ray actors on the loop's node (the head's resource; path auto: shm); on
            another node (auto: stream); on another node with FASTFEED_RAY_PATH=store (the object store, the
            fallback); and bare TCP between two processes of this machine (ray_trials.wire: the stream's ceiling
            here). Per round one fresh loader of each, each in every place of the order in turn, --warmup
            untimed batches, then --batches timed: GB/s, and CPU per batch of the loop's own thread (the one that
            would launch a GPU's work) and of this whole process (every thread: Ray's driver threads and the
            stream's readers too); each Ray row over the same round's processes, the stream's also over the wire. Medians over rounds, min-max. The path every worker took (stats().worker_paths) is
            recorded, and one that is not its row's stops the run: no row measures another path under its name.
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
  The receive, scaling and mixed parts' actors (all on the other nodes) take the path --path forces (default
  auto: stream); each trial records the paths its workers took.

Run: .venv/bin/python benchmarks/ray.py [--quick] [--rounds N] [--actors 1 2 4 8 16] [--parts ...] [--out DIR]
(or fastfeed bench ray, which writes a report). Needs ray: pip install 'fastfeed[ray]'.

Measured:
  (2026-12-05, 2-core VM, quiet, torch 2.13 CPU, ray 2.60.0, the link change uncommitted on 79bdae5, `fastfeed bench
  ray --out DIR`: 2 min 49 s to the report; docs/bench/ray.json)
  overhead 9.6 MB nw=2        GB/s                / process          loop thread ms/batch  process ms/batch
    process                   12.01 (11.40-12.27)  -                  0.13                  0.13
    ray, loop's node (shm)    12.21 (10.94-12.75)  1.03x (0.94-1.05)  0.21                  0.40
    ray, other node (stream)   3.74 (3.37-3.96)    0.31x (0.27-0.35)  0.35                  2.87
    ray, other node, store     0.70 (0.61-0.72)    0.06x (0.05-0.06)  2.03                  3.82
    bare loopback TCP          4.16 (2.17-4.42)    0.34x (0.18-0.39)  -                     1.19
    the stream over bare loopback TCP: 0.94x (0.81-1.61)
  receive 0.79 MB, 8 actors (stream)  1144.5 batches/s (593.6-1338.5), 0.900 GB/s
  scaling (t_batch 156 ms measured, 150 ms of sleep; stream; no count reached the receive cap), measured / ideal:
    1 actor 6.4 batches/s 1.00x   2: 12.8, 1.00x   4: 25.5, 1.00x   8: 50.5, 0.99x   16: 96.9 of 102.3, 0.95x
  mixed (32 ms of CPU a batch): process 1 30.8 batches/s; process 1 + ray 1 (stream) 58.6, 1.90x (1.81-1.95);
    process 2 58.2, 1.89x (1.82-1.93).
  Left behind: 0 actors, 0 processes, 0 /dev/shm entries.
  Before the link (2026-12-04, tasks and answers through Ray's calls): shm 0.56x at 0.89 ms of the process's CPU,
  stream 0.20x at 3.88 ms, store 0.06x at 4.20 ms; receive 525.5 batches/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .. import extras, workloads
from .ray_cluster import TRAINER_RESOURCE, LocalCluster, wait_actors_gone
from .ray_trials import BATCH, Costly, batch_seconds, new_loader, stats, steady, wire

OVERHEAD_WORKERS = 2
PARTS = ("overhead", "receive", "scaling", "mixed")
SCALING_ACTOR_CPUS = 0.5
TRAINER_SLOTS = 8  # the head's TRAINER_RESOURCE: room for the 2 actors of one overhead loader, and spares
PATH_ENV = "FASTFEED_RAY_PATH"  # read by the loader's Ray pool as it starts (fastfeed/_workers/ray/pool.py)
# The overhead part's Ray rows: (name, FASTFEED_RAY_PATH, ray_options, the path every worker must take, where). The
# trainer node's actors ask for the head's resource (no CPUs: the head has none); the others ask for a CPU, which
# only the other nodes have. The path each row's workers took is checked, so a row that fell back (a stream that
# could not connect, say) fails the run instead of being measured under the wrong name.
WIRE = "loopback TCP"  # the overhead part's reference for the stream: bare bytes over a socket (ray_trials.wire)
OVERHEAD_ROWS = (
    ("trainer node", "auto", {"num_cpus": 0, "resources": {TRAINER_RESOURCE: 1}}, "shm", "the trainer's node"),
    ("other node", "auto", {"num_cpus": 1}, "stream", "another node"),
    ("other node, store", "store", {"num_cpus": 1}, "object store", "another node"),
)

# --- the parts ------------------------------------------------------------------------------------------------------


class _Noted:
    """A loader handed to ``steady`` that notes, as ``steady`` lets go of it (after its timed windows), the path
    each worker's batches took (``stats().worker_paths``). ``iter()`` is the loader's own: the timed loop runs the
    loader's iterator, unwrapped, so the noting costs it nothing."""

    def __init__(self, loader, into: list):
        self.loader, self.into = loader, into

    def __iter__(self):
        return iter(self.loader)

    def __del__(self):
        try:
            self.into.append(tuple(self.loader.stats().worker_paths))
        finally:
            self.loader = None


@contextlib.contextmanager
def _path_env(value: str):
    """``FASTFEED_RAY_PATH=value`` while a trial's loader starts its pool; "auto" also overrides one set outside."""
    was = os.environ.get(PATH_ENV)
    os.environ[PATH_ENV] = value
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(PATH_ENV, None)
        else:
            os.environ[PATH_ENV] = was


def noted_trial(make_loader: Callable[[], Any], path_env: str, warmup: int, batches: int, windows: int = 1):
    """``steady`` over a fresh loader, started with ``FASTFEED_RAY_PATH=path_env``; the record gets its workers'
    paths (empty where FASTFEED_STATS=0 turned stats off)."""
    paths: list[tuple] = []
    with _path_env(path_env):
        rec = steady(lambda: _Noted(make_loader(), paths), warmup, batches, windows)
    rec["worker_paths"] = list(paths[0]) if paths else []
    return rec


def _paths(rec: dict) -> str:
    """The paths a trial's workers took, each once, in order: "stream", or "process, stream"."""
    return ", ".join(dict.fromkeys(rec["worker_paths"])) or "paths not recorded"


def overhead_part(args, say: Callable = print) -> dict:
    """9.6 MB batches through 2 Ray actors on each path against 2 worker processes, interleaved rounds."""
    n = args.warmup + args.batches
    ds = Costly(n * BATCH, workloads.IMAGE_SHAPE, args.pool_items)
    sides: dict[str, tuple] = {"process": (lambda: new_loader(ds, "process", OVERHEAD_WORKERS), "auto", "process")}
    for name, env, options, path, _ in OVERHEAD_ROWS:
        sides[name] = (lambda o=options: new_loader(ds, "ray", OVERHEAD_WORKERS, ray_options=o), env, path)
    names = [*sides, WIRE]
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each side in each place in turn
            if name == WIRE:
                win = wire(BATCH * workloads.IMAGE_BYTES, n)
                runs[name].append(dict(win, round=r))
                say(f"  ray overhead round {r + 1}: {name:17} {'-':12} {win['bytes_per_s'] / 1e9:6.2f} GB/s, "
                    f"process CPU {win['main_cpu_s_per_batch'] * 1e3:6.2f} ms/batch")  # fmt: skip
                continue
            make, env, path = sides[name]
            rec = noted_trial(make, env, args.warmup, args.batches)
            if rec["worker_paths"] != [path] * OVERHEAD_WORKERS:
                raise RuntimeError(
                    f"ray overhead {name!r} (FASTFEED_RAY_PATH={env}): the workers took the paths "
                    f"{rec['worker_paths'] or '(none recorded: is FASTFEED_STATS=0?)'}, not {path!r} each; the "
                    "fastfeed logger says why a worker fell back")  # fmt: skip
            win = rec.pop("windows")[0]
            runs[name].append(dict(rec, **win, round=r))
            say(f"  ray overhead round {r + 1}: {name:17} {path:12} {win['bytes_per_s'] / 1e9:6.2f} GB/s, loop "
                f"thread CPU {win['loop_cpu_s_per_batch'] * 1e3:5.2f} ms/batch, process CPU "
                f"{win['main_cpu_s_per_batch'] * 1e3:5.2f}, first batch {rec['ttfb_s'] * 1e3:6.0f} ms")
    out: dict[str, Any] = {"batch_bytes": BATCH * workloads.IMAGE_BYTES, "num_workers": OVERHEAD_WORKERS,
                           "pool_mb": round(args.pool_items * workloads.IMAGE_BYTES / 1e6, 1), "rows": {}}
    for name, recs in runs.items():
        figs = {"gb_per_s": stats([x["bytes_per_s"] / 1e9 for x in recs]),
                "main_cpu_ms_per_batch": stats([x["main_cpu_s_per_batch"] * 1e3 for x in recs]), "rounds": recs}
        if name == WIRE:
            figs["vs"] = {"throughput": stats([a["bytes_per_s"] / b["bytes_per_s"]
                                               for a, b in zip(recs, runs["process"])])}  # fmt: skip
            out["wire"] = figs
            continue
        figs["loop_cpu_ms_per_batch"] = stats([x["loop_cpu_s_per_batch"] * 1e3 for x in recs])
        figs["ttfb_s"] = statistics.median(x["ttfb_s"] for x in recs)
        if name == "process":
            out["process"] = figs
            continue
        _, env, options, path, where = next(row for row in OVERHEAD_ROWS if row[0] == name)
        pairs = list(zip(recs, runs["process"]))  # the same round's process loader
        figs["vs"] = {"throughput": stats([a["bytes_per_s"] / b["bytes_per_s"] for a, b in pairs]),
                      "main_cpu": stats([a["main_cpu_s_per_batch"] / b["main_cpu_s_per_batch"] for a, b in pairs]),
                      "loop_cpu": stats([a["loop_cpu_s_per_batch"] / b["loop_cpu_s_per_batch"] for a, b in pairs]),
                      "wire": stats([a["bytes_per_s"] / b["bytes_per_s"] for a, b in zip(recs, runs[WIRE])])}
        out["rows"][name] = dict(where=where, path=path, path_env=env, ray_options=options, **figs)
    return out


def _scale_ds(args, length: int, cost_s: float) -> Costly:
    return Costly(length, tuple(args.scale_shape), pool_items=BATCH, cost_s=cost_s)


def receive_part(args, say: Callable = print) -> dict:
    """The loop's receive rate: the scaling batches at no cost, from many actors."""
    n_actors = args.receive_actors
    batches = args.receive_batches
    warmup = 2 * n_actors
    ds = _scale_ds(args, (warmup + batches * args.windows) * BATCH, 0.0)
    rec = noted_trial(lambda: new_loader(ds, "ray", n_actors, ray_options={"num_cpus": SCALING_ACTOR_CPUS}),
                      args.path, warmup, batches, args.windows)  # fmt: skip
    wins = rec.pop("windows")
    for w in wins:
        say(f"  ray receive {n_actors} actors ({_paths(rec)}): {w['batches_per_s']:7.1f} batches/s, "
            f"{w['bytes_per_s'] / 1e9:6.3f} GB/s, loop CPU {w['main_cpu_s_per_batch'] * 1e3:5.2f} ms/batch")
    return dict(rec, actors=n_actors, batch_bytes=wins[0]["batch_bytes"], path_env=args.path,
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
        rec = noted_trial(lambda: new_loader(ds, "ray", n, ray_options={"num_cpus": SCALING_ACTOR_CPUS}),
                          args.path, warmup, per_window, args.windows)  # fmt: skip
        wins = rec.pop("windows")
        row = dict(rec, actors=n, ideal_batches_per_s=ideal, capped_ideal_batches_per_s=capped,
                   capped=bool(cap and cap < ideal), batches_per_window=per_window,
                   batches_per_s=stats([w["batches_per_s"] for w in wins]),
                   gb_per_s=stats([w["bytes_per_s"] / 1e9 for w in wins]),
                   vs_ideal=stats([w["batches_per_s"] / ideal for w in wins]),
                   vs_capped=stats([w["batches_per_s"] / capped for w in wins]), windows=wins)  # fmt: skip
        rows.append(row)
        say(f"  ray scaling {n:2} actors ({_paths(rec)}): {row['batches_per_s']['median']:7.1f} batches/s, ideal "
            f"{ideal:7.1f}{f' (capped {capped:.1f})' if row['capped'] else ''}: {row['vs_capped']['median']:.2f}x")
    return {"t_batch_s": t_batch, "sleep_s_per_batch": args.t_batch, "path_env": args.path,
            "batch_bytes": rows[0]["windows"][0]["batch_bytes"] if rows else None, "receive_cap_batches_per_s": cap,
            "actor_cpus": SCALING_ACTOR_CPUS, "rows": rows}


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
            rec = noted_trial(sides[name], args.path, args.warmup, args.mixed_batches)
            win = rec.pop("windows")[0]
            runs[name].append(dict(rec, **win, round=rnd))
            say(f"  ray mixed round {rnd + 1}: {name:18} {win['batches_per_s']:6.1f} batches/s ({_paths(rec)})")
    out: dict[str, Any] = {"local": local, "remote": list(args.mixed_remote), "t_batch_s": t_batch,
                           "path_env": args.path, "cpu_s_per_batch": BATCH * cost, "spin_ms_per_sample": args.spin_ms,
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
# --quick: each Ray loader starts its actors afresh (a Python importing torch each, seconds of CPU on 2 cores), so it
# keeps the fewest that still show each part: 1 and 2 scaling actors against their ideal, 2 receiving.
QUICK = dict(rounds=2, warmup=3, batches=10, pool_items=256, actors=[1, 2], windows=1, window_s=1.0,
             t_batch=0.1, receive_actors=2, receive_batches=40, mixed_batches=8)


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few rounds, batches and actors: 1 and 2 scaling "
                   "actors, 2 receiving (under a minute)")  # fmt: skip
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
    p.add_argument("--path", default="auto", choices=("auto", "shm", "stream", "store"),
                   help="FASTFEED_RAY_PATH of the receive, scaling and mixed parts' loaders (the overhead part "
                   "measures each path on its own rows)")  # fmt: skip
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
    with LocalCluster(args.nodes, args.node_cpus, head_resources={TRAINER_RESOURCE: TRAINER_SLOTS}) as cluster:
        import ray

        result["cluster"] = cluster.describe()
        head = [n["node_id"] for n in result["cluster"]["nodes"] if n["head"]]
        if head != [result["cluster"]["driver_node"]]:  # Ray attaches a driver to the head of its host's nodes
            raise RuntimeError(f"the loop runs on Ray node {result['cluster']['driver_node']}, not on the head "
                               f"({head}): the overhead part's trainer-node actors would not be beside it")
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
