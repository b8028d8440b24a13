"""Transport: how fast do bytes reach the consumer?

Batches of 64 uint8 images (3x224x224, 9.6 MB) from a pool larger than the L3 cache.
Two comparisons per worker count N:
  nw=N                   fastfeed and torch, both with N workers;
  nw=N vs torch nw=0     fastfeed with N workers against torch in-process (bar: >= 0.9x),
                         since torch at nw=0 only stacks: the bytes never cross a process.

Run: .venv/bin/python benchmarks/transport.py [--quick] [--rounds N] [--num-workers 1 2] [--out DIR]

Measured:
  (2026-11-29, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/transport.py`)
  transport nw=2  fastfeed/torch throughput  median 10.32x (min 9.70x, max 11.63x)  fastfeed 17.6 GB/s  torch 1.71 GB/s
  transport nw=2  fastfeed/torch peak_pss  median 1.97x (min 1.48x, max 2.04x)  fastfeed 50.1 MB  torch 25.6 MB
  transport nw=2  fastfeed/torch peak_footprint  median 0.93x (min 0.88x, max 0.93x)  fastfeed 50.1 MB  torch 54 MB
  transport nw=2  fastfeed/torch ttfb  median 0.56x (min 0.42x, max 0.62x)  fastfeed 23.8 ms  torch 44.4 ms
  transport nw=2 vs torch nw=0  fastfeed/torch throughput  median 0.95x (min 0.78x, max 1.10x)  fastfeed 17.3 GB/s  torch 18.7 GB/s  bar >=0.9x ok
  transport nw=2 vs torch nw=0  fastfeed/torch peak_pss  median 0.74x (min 0.74x, max 5.14x)  fastfeed 49.6 MB  torch 67.4 MB
  transport nw=2 vs torch nw=0  fastfeed/torch peak_footprint  median 0.74x (min 0.73x, max 5.14x)  fastfeed 49.6 MB  torch 67.4 MB
  transport nw=2 vs torch nw=0  fastfeed/torch ttfb  median 6.52x (min 6.27x, max 7.71x)  fastfeed 24.1 ms  torch 3.23 ms
"""

from __future__ import annotations

import _runner
import workloads

DEFAULTS = dict(rounds=5, warmup=10, batches=200, mem_batches=20, num_workers=[2])
QUICK = dict(rounds=2, warmup=3, batches=20, mem_batches=5)
PRINTED = ("throughput", "main_cpu_s", "peak_pss", "peak_footprint", "ttfb")


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int,
                pool_items: int = workloads.TRANSPORT_POOL_ITEMS) -> list[_runner.Comparison]:
    """The transport comparisons for each worker count.

    Args:
        num_workers: Worker counts of the candidate.
        warmup: Untimed batches per trial.
        batches: Timed batches per trial.
        mem_batches: Batches per trial under the PSS sampler.
        pool_items: Number of distinct images in the dataset's pool.

    Returns:
        Same-nw comparisons, each followed by the one against torch at nw=0.
    """
    wl = workloads.transport(pool_items)
    out = []
    for nw in num_workers:
        same = dict(num_workers=nw)
        bars = {"throughput": (">=", 6.0)} if nw == 2 else {}  # the brief's bar at nw=2
        out.append(_runner.Comparison(wl, f"nw={nw}", same, same, warmup, batches, mem_batches, bars))
        if nw:
            out.append(_runner.Comparison(wl, f"nw={nw} vs torch nw=0", same, dict(num_workers=0),
                                          warmup, batches, mem_batches, bars={"throughput": (">=", 0.9)}))
    return out


def main(argv=None) -> dict:
    """Run the transport benchmark from the command line."""
    def extra(p):
        p.add_argument("--pool-items", type=int, default=workloads.TRANSPORT_POOL_ITEMS,
                       help="distinct images in the pool (each 150 KB); keep the pool above L3")

    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK, extra)
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches, args.pool_items)
    return _runner.run_script("transport", comps, args, PRINTED)


if __name__ == "__main__":
    main()
