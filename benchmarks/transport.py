"""Transport: how fast do bytes reach the consumer?

Batches of 64 uint8 images (3x224x224, 9.6 MB) from a pool larger than the L3 cache.
Two comparisons per worker count N:
  nw=N                   fastfeed and torch, both with N workers;
  nw=N vs torch nw=0     fastfeed with N workers against torch in-process (bar: >= 0.9x),
                         since torch at nw=0 only stacks: the bytes never cross a process.

Run: .venv/bin/python benchmarks/transport.py [--quick] [--rounds N] [--num-workers 1 2] [--out DIR]

Measured (paste the figure lines of a full run here):
  (to be filled by the lead)
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
        out.append(_runner.Comparison(wl, f"nw={nw}", same, same, warmup, batches, mem_batches))
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
