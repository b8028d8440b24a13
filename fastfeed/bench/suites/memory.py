"""Memory: workers' private memory (USS) and proportional memory (PSS) for a dataset of 1M dicts of metadata,
against torch's DataLoader, with and without ``fastfeed.share``; and on 2 ranks of one machine.

Each configuration runs in a fresh process (so that no copy of the metadata from another configuration is
mapped there): it builds the dataset, shares it or not, runs one shuffled epoch, and samples its workers' USS and
PSS from /proc/PID/smaps_rollup every twentieth of the epoch and after the last batch (the peak is kept).
Configurations are interleaved: round after round, each worker count runs every loader, in an order that
alternates. Loaders:
  torch            torch's DataLoader
  fastfeed         fastfeed.DataLoader (gc.freeze() around the fork; the copy-on-read warning)
  fastfeed-nofreeze  the same without the gc.freeze() (what the freeze saves on its own)
  fastfeed+share   fastfeed.DataLoader over dataset = fastfeed.share(dataset)
  torch+share      torch's DataLoader over the shared dataset (share works with any loader)
Every configuration's batches are hashed: equal digests are equal batches. The freeze's own saving shows where a
worker makes a full collection: 2 workers that read 2 batches and call gc.collect() once (torch, fastfeed,
fastfeed-nofreeze).

Ranks: torchrun --standalone --nproc-per-node 2 (gloo), each rank builds the metadata, shares it or not, reads a
shuffled epoch itself, and reports its PSS growth; the sum over ranks is compared with one copy (one process's
growth from building the metadata as Python objects).

Run: fastfeed bench memory [--quick]      (or .venv/bin/python -m fastfeed.bench.suites.memory [--quick] [--out F])
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ITEMS = 1_000_000
QUICK_ITEMS = 200_000
WORKERS = (2, 4, 8)
QUICK_WORKERS = (2, 4)
LOADERS = ("torch", "fastfeed", "fastfeed-nofreeze", "fastfeed+share", "torch+share")
BATCH = 256
SAMPLES = 20  # memory samples per epoch
MB = 1e6


class Metadata:
    """A map-style dataset that keeps its metadata as Python objects: one dict per sample (pytorch#13246)."""

    def __init__(self, n: int):
        self.items = [
            {"file": f"train/n{i % 1000:08d}/img_{i:07d}.JPEG", "label": i % 1000, "box": [i % 640, i % 480, 64, 48]}
            for i in range(n)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        # Reads every field (the copies come from reading), and leaves the tensors to collate: the epoch's time
        # is then mostly the reading this benchmark is about.
        item = self.items[i]
        return item["label"], len(item["file"]), item["box"]


def smaps(pid: int) -> dict:
    """A process's USS (private pages, its alone) and PSS (each shared page divided among its users), in bytes."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    uss = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0) + fields.get("Private_Hugetlb", 0)
    return {"uss": uss, "pss": fields.get("Pss", 0)}


def workers_of(parent: int) -> list[int]:
    """The forked worker processes of ``parent``: its children running the same command line."""
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        cmdline = f.read()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if f.read() == cmdline:
                    out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
    return sorted(out)


def _digest(batch, h) -> None:
    for part in batch:
        if isinstance(part, (list, tuple)):
            _digest(part, h)
        else:
            h.update(part.numpy().tobytes())


def one_config(loader: str, workers: int, items: int, seed: int = 0) -> dict:
    """Run one configuration in this process: build, maybe share, one shuffled epoch; returns its figures."""
    import torch
    import torch.utils.data

    import fastfeed

    dataset = Metadata(items)
    shared = loader.endswith("+share")
    if shared:
        dataset = fastfeed.share(dataset)  # the original is freed: only the shared copy is left
    gc.collect()
    if loader == "fastfeed-nofreeze":
        import contextlib

        from fastfeed._workers import pool

        pool._frozen_for_fork = lambda context: contextlib.nullcontext()  # the ablation: no gc.freeze()
    cls = torch.utils.data.DataLoader if loader.startswith("torch") else fastfeed.DataLoader
    made = cls(dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
               generator=torch.Generator().manual_seed(seed), multiprocessing_context="fork")  # fmt: skip
    main_before = smaps(os.getpid())
    h = hashlib.sha256()
    peak_uss = peak_pss = 0
    n = len(made)
    every = max(1, n // SAMPLES)
    start = time.perf_counter()
    it = iter(made)
    pids: list[int] = []
    for k in range(n):
        _digest(next(it), h)
        if k % every == 0 or k == n - 1:
            pids = pids or workers_of(os.getpid())
            figures = [smaps(p) for p in pids]
            peak_uss = max(peak_uss, sum(f["uss"] for f in figures))
            peak_pss = max(peak_pss, sum(f["pss"] for f in figures))
    epoch_s = time.perf_counter() - start
    for _ in it:  # StopIteration: the workers exit
        pass
    del it, made
    block = 0
    if shared:
        block = dataset.items.nbytes
    return {"loader": loader, "workers": workers, "items": items, "workers_found": len(pids),
            "peak_uss": peak_uss, "peak_pss": peak_pss, "main_uss": main_before["uss"],
            "epoch_s": round(epoch_s, 2), "digest": h.hexdigest(), "shared_bytes": block}  # fmt: skip


def _collect_in_worker(worker_id: int) -> None:
    gc.collect()  # what a worker's own allocations trigger sooner or later in a long epoch


def one_collect(loader: str, items: int) -> dict:
    """What gc.freeze() saves on its own: 2 workers that read 2 batches only, then make one full collection.

    A full collection writes to the header of every object it walks; without the freeze, a worker's first one
    copies every page of the dataset's dicts, read or not.
    """
    import torch
    import torch.utils.data

    import fastfeed

    dataset = Metadata(items)
    gc.collect()
    if loader == "fastfeed-nofreeze":
        import contextlib

        from fastfeed._workers import pool

        pool._frozen_for_fork = lambda context: contextlib.nullcontext()
    cls = torch.utils.data.DataLoader if loader == "torch" else fastfeed.DataLoader
    made = cls(dataset, batch_size=BATCH, sampler=range(2 * BATCH), num_workers=2,
               worker_init_fn=_collect_in_worker, multiprocessing_context="fork")  # fmt: skip
    it = iter(made)
    next(it)
    next(it)  # both workers have started, collected and fetched a batch
    pids = workers_of(os.getpid())
    figures = [smaps(p) for p in pids]
    for _ in it:
        pass
    return {"loader": loader, "items": items, "workers_found": len(pids),
            "uss": sum(f["uss"] for f in figures), "pss": sum(f["pss"] for f in figures)}  # fmt: skip


def run_config(loader: str, workers: int, items: int, timeout: float = 900, collect: bool = False) -> dict:
    """``one_config`` (or ``one_collect``) in a fresh interpreter: nothing of another configuration is mapped."""
    cmd = [sys.executable, "-m", "fastfeed.bench.suites.memory", "--collect" if collect else "--one", loader,
           str(workers), str(items)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"fastfeed bench memory: {loader} with {workers} workers failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- ranks ---------------------------------------------------------------------------------------------------


def rank_job(items: int, shared: bool, out: str) -> None:
    """One rank under torchrun: its PSS growth from the metadata, after a shuffled epoch read by itself."""
    import torch
    import torch.distributed as dist

    import fastfeed

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gc.collect()
    dist.barrier()  # every rank has imported torch: the libraries' PSS is split the same way before and after
    before = smaps(os.getpid())["pss"]
    dataset = Metadata(items)
    gc.collect()
    one_copy = smaps(os.getpid())["pss"] - before  # the metadata as Python objects, in one process
    if shared:
        dataset = fastfeed.share(dataset)
        gc.collect()
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(rank)).tolist()
    total = 0
    for i in order:
        total += dataset[i][0]
    del order
    gc.collect()
    dist.barrier()  # every rank has read its epoch and still maps what it holds
    grown = smaps(os.getpid())["pss"] - before
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, {"rank": rank, "one_copy": one_copy, "pss_growth": grown, "sum": total,
                                     "shared_bytes": dataset.items.nbytes if shared else 0,
                                     # the same inode on every rank: one block, mapped by all
                                     "block": [dataset.items.handle.dev, dataset.items.handle.ino] if shared
                                     else None})  # fmt: skip
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.destroy_process_group()


def run_ranks(items: int, shared: bool, nproc: int = 2, timeout: float = 900) -> dict:
    """A torchrun job of ``nproc`` ranks on this machine; the summed PSS growth against one copy."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "fastfeed.bench.suites.memory", "--rank", str(items), "1" if shared else "0", out]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"fastfeed bench memory: the {nproc}-rank job failed:\n{done.stderr[-3000:]}")
        with open(out) as f:
            ranks = json.load(f)
    one_copy = ranks[0]["one_copy"]
    summed = sum(r["pss_growth"] for r in ranks)
    return {"ranks": nproc, "shared": shared, "items": items, "one_copy": one_copy, "pss_summed": summed,
            "over_one_copy": round(summed / one_copy, 3), "shared_bytes": ranks[0]["shared_bytes"],
            "one_block": shared and len({tuple(r["block"]) for r in ranks}) == 1,
            "per_rank": ranks}  # fmt: skip


# --- the suite -----------------------------------------------------------------------------------------------


def run(items: int, workers, loaders=LOADERS, rounds: int = 1, ranks: bool = True, progress=print) -> dict:
    """Every configuration, interleaved; then the ranks. Returns the report's result."""
    rows = []
    for r in range(rounds):
        for w in workers:
            order = list(loaders) if (r + workers.index(w)) % 2 == 0 else list(reversed(loaders))
            for loader in order:
                row = run_config(loader, w, items)
                row["round"] = r
                rows.append(row)
                progress(f"# memory {loader:18s} nw={w}  workers' peak USS {row['peak_uss'] / MB:8.1f} MB  "
                         f"PSS {row['peak_pss'] / MB:8.1f} MB  epoch {row['epoch_s']:.1f} s")
    summary = {}
    for w in workers:
        base = [x for x in rows if x["workers"] == w and x["loader"] == "torch"]
        torch_uss = min(x["peak_uss"] for x in base)
        torch_digest = base[0]["digest"]
        for loader in loaders:
            mine = [x for x in rows if x["workers"] == w and x["loader"] == loader]
            uss, pss = min(x["peak_uss"] for x in mine), min(x["peak_pss"] for x in mine)
            summary[f"nw={w} {loader}"] = {
                "peak_uss_mb": round(uss / MB, 1), "peak_pss_mb": round(pss / MB, 1),
                "uss_over_torch": round(uss / torch_uss, 3),
                "batches_equal_torch": all(x["digest"] == torch_digest for x in mine),
            }  # fmt: skip
    result = {"items": items, "workers": list(workers), "loaders": list(loaders), "rounds": rounds,
              "rows": rows, "summary": summary}  # fmt: skip
    result["collect"] = [run_config(loader, 2, items, collect=True) for loader in ("torch", "fastfeed",
                                                                                   "fastfeed-nofreeze")]
    for row in result["collect"]:
        progress(f"# memory one gc.collect() per worker, {row['loader']:18s} workers' USS {row['uss'] / MB:8.1f} MB")
    if ranks:
        result["ranks"] = [run_ranks(items, shared) for shared in (False, True)]
        for rk in result["ranks"]:
            progress(f"# memory 2 ranks {'share' if rk['shared'] else 'no share'}: PSS summed "
                     f"{rk['pss_summed'] / MB:.1f} MB = {rk['over_one_copy']:.2f}x one copy "
                     f"({rk['one_copy'] / MB:.1f} MB)")  # fmt: skip
    return result


def markdown(result: dict) -> str:
    lines = [f"Workers' peak memory, {result['items']:,} dicts of metadata, one shuffled epoch (min over "
             f"{result['rounds']} round(s))", "", "| workers | loader | USS (MB) | PSS (MB) | USS / torch | "
             "batches = torch |", "|---|---|---|---|---|---|"]  # fmt: skip
    for key, s in result["summary"].items():
        nw, loader = key.split(" ", 1)
        lines.append(f"| {nw[3:]} | {loader} | {s['peak_uss_mb']:.1f} | {s['peak_pss_mb']:.1f} | "
                     f"{s['uss_over_torch']:.2f}x | {'yes' if s['batches_equal_torch'] else 'NO'} |")
    if result.get("collect"):
        lines.append("\nOne full gc.collect() in each of 2 workers that read 2 batches (what gc.freeze() saves):")
        for row in result["collect"]:
            lines.append(f"- {row['loader']}: workers' USS {row['uss'] / MB:.1f} MB, PSS {row['pss'] / MB:.1f} MB")
    for rk in result.get("ranks", []):
        lines.append(f"\n2 ranks, {'share' if rk['shared'] else 'no share'}: PSS summed {rk['pss_summed'] / MB:.1f} "
                     f"MB, {rk['over_one_copy']:.2f}x one copy ({rk['one_copy'] / MB:.1f} MB)")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ITEMS:,} items at {QUICK_WORKERS} workers")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-ranks", action="store_true", help="leave out the torchrun job")
    p.add_argument("--out", help="also write the result here, as JSON")
    args = p.parse_args(argv)
    items, workers = (QUICK_ITEMS, QUICK_WORKERS) if args.quick else (ITEMS, WORKERS)
    result = run(items, list(workers), rounds=args.rounds, ranks=not args.no_ranks)
    result["quick"] = args.quick
    print(markdown(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one_config(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    elif sys.argv[1:2] == ["--collect"]:
        print(json.dumps(one_collect(sys.argv[2], int(sys.argv[4]))))
    elif sys.argv[1:2] == ["--rank"]:
        rank_job(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4])
    else:
        main()
