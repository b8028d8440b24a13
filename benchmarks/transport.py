"""Transport: how fast do bytes reach the consumer, including each epoch's start?

Batches of 64 uint8 images (3x224x224, 9.6 MB) from a pool at least 8x the last-level cache and
at least 300 MB (sized from sysfs; 403 MB for this machine's 48 MiB L3; `--pool-items` overrides).
By default, epoch mode (`--epoch-batches 60 300`): a trial builds one loader with torch's default
persistent_workers=False and runs whole epochs of N batches (a dataset of exactly N x 64 items),
each timed from iter(loader) to its last batch, so every epoch's worker start is in the figure;
epoch 1 is the warm-up, then max(2, ceil(batches / N)) timed epochs. Per worker count W and
epoch length N:
  nw=W epochs of N                   fastfeed and torch, both with W workers (bar at nw=2: >= 6.0x);
  nw=W vs torch nw=0 epochs of N     fastfeed with W workers against torch in-process (bar: >= 1.0x),
                                     since torch at nw=0 only stacks: the bytes never cross a process.
`--epoch-batches 0` adds the steady state (one long iterator, comparisons "nw=W" and
"nw=W vs torch nw=0", bars >= 6.0x and >= 0.9x). ttfb is epoch 1's time to first batch,
ttfb_hot the median over the timed epochs (epoch 2 and later).

Run: .venv/bin/python benchmarks/transport.py [--quick] [--rounds N] [--num-workers 1 2]
     [--epoch-batches 0 60 300] [--pool-items N] [--out DIR]

Measured:
  Epoch-mode figures (403 MB pool) pending a full run.
  Before issue 9 (steady state, a 256-image 38.5 MB pool, which this machine's 48 MiB L3 holds):
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

# Epoch mode: one warm-up epoch, then ceil(batches / N) timed epochs (at least 2): 4 of 60, 2 of 300.
DEFAULTS = dict(rounds=5, warmup=10, batches=200, mem_batches=20, num_workers=[2], epoch_batches=[60, 300])
QUICK = dict(rounds=2, warmup=3, batches=20, mem_batches=5, epoch_batches=[6, 12])
PRINTED = ("throughput", "main_cpu_s", "peak_pss", "peak_footprint", "ttfb", "ttfb_hot")


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int,
                pool_items: int | None = None, epoch_batches: list[int] = (0,)) -> list[_runner.Comparison]:
    """The transport comparisons for each worker count and epoch length.

    Args:
        num_workers: Worker counts of the candidate.
        warmup: Untimed batches per trial (steady state only).
        batches: Timed batches per trial (in epoch mode: about, in whole epochs).
        mem_batches: Batches per trial under the PSS sampler.
        pool_items: Number of distinct images in the dataset's pool (default: 8x the LLC, >= 300 MB).
        epoch_batches: Epoch lengths; 0 is the steady state.

    Returns:
        For each epoch length and worker count, the same-nw comparison, followed (nw > 0) by the
        one against torch at nw=0.
    """
    wl = workloads.transport(pool_items)
    out = []
    for n in epoch_batches:
        suffix = f" epochs of {n}" if n else ""
        # torch's default, spelled out: every epoch starts its workers again.
        own = dict(persistent_workers=False) if n else {}
        for nw in num_workers:
            same = dict(num_workers=nw, **own)
            bars = {"throughput": (">=", 6.0)} if nw == 2 else {}  # the brief's bar at nw=2
            out.append(_runner.Comparison(wl, f"nw={nw}{suffix}", same, same, warmup, batches, mem_batches, bars,
                                          epoch_batches=n))
            if nw:
                # The brief's bar against torch in-process: 0.9x in steady state, 1.0x over whole epochs.
                bar0 = {"throughput": (">=", 1.0 if n else 0.9)}
                out.append(_runner.Comparison(wl, f"nw={nw} vs torch nw=0{suffix}", same, dict(num_workers=0, **own),
                                              warmup, batches, mem_batches, bar0, epoch_batches=n))
    return out


def main(argv=None) -> dict:
    """Run the transport benchmark from the command line."""
    def extra(p):
        p.add_argument("--pool-items", type=int,
                       help="distinct images in the pool (each 150,528 bytes); "
                            "default: at least 8x the last-level cache and 300 MB")

    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK, extra)
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches, args.pool_items,
                        args.epoch_batches)
    return _runner.run_script("transport", comps, args, PRINTED)


if __name__ == "__main__":
    main()
