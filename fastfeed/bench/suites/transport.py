"""Transport: how fast do bytes reach the consumer, including each epoch's start?

Batches of 64 uint8 images (3x224x224, 9.6 MB) from a pool at least 8x the last-level cache and
at least 300 MB (sized from sysfs; 403 MB for this machine's 48 MiB L3; `--pool-items` overrides).
By default, epoch mode (`--epoch-batches 60 300`): a trial builds one loader with torch's default
persistent_workers=False and runs whole epochs of N batches (a dataset of exactly N x 64 items),
each timed from iter(loader) to its last batch, so every epoch's worker start is in the figure;
epoch 1 is the warm-up, then max(2, ceil(batches / N)) timed epochs. Per worker count W and
epoch length N:
  nw=W epochs of N                   fastfeed and torch, both with W workers;
  nw=W vs torch nw=0 epochs of N     fastfeed with W workers against torch in-process,
                                     since torch at nw=0 only stacks: the bytes never cross a process.
`--epoch-batches 0` adds the steady state (one long iterator, comparisons "nw=W" and
"nw=W vs torch nw=0"). ttfb is epoch 1's time to first batch,
ttfb_hot the median over the timed epochs (epoch 2 and later).

Run: .venv/bin/python benchmarks/transport.py [--quick] [--rounds N] [--num-workers 1 2]
     [--epoch-batches 0 60 300] [--pool-items N] [--out DIR]

Measured:
  (2026-11-30, 2-core VM, torch 2.13 CPU, commit 970c6ef, `.venv/bin/python benchmarks/transport.py`)
  transport nw=2 epochs of 60  fastfeed/torch throughput  median 2.80x (min 2.63x, max 3.16x)  fastfeed 3.05 GB/s  torch 1.03 GB/s
  transport nw=2 epochs of 60  fastfeed/torch main_cpu_s  median 0.36x (min 0.33x, max 0.42x)  fastfeed 0.259 s  torch 0.649 s
  transport nw=2 epochs of 60  fastfeed/torch peak_footprint  median 0.94x (min 0.94x, max 1.11x)  fastfeed 52.4 MB  torch 55.8 MB
  transport nw=2 epochs of 60  fastfeed/torch ttfb  median 0.66x (min 0.57x, max 0.85x)  fastfeed 56.8 ms  torch 74.3 ms
  transport nw=2 epochs of 60  fastfeed/torch ttfb_hot  median 0.72x (min 0.54x, max 0.86x)  fastfeed 56.5 ms  torch 75.8 ms
  transport nw=2 vs torch nw=0 epochs of 60  fastfeed/torch throughput  median 0.48x (min 0.29x, max 0.49x)  fastfeed 2.12 GB/s  torch 6.07 GB/s
  transport nw=2 vs torch nw=0 epochs of 60  fastfeed/torch main_cpu_s  median 0.34x (min 0.32x, max 0.47x)  fastfeed 0.292 s  torch 0.748 s
  transport nw=2 vs torch nw=0 epochs of 60  fastfeed/torch peak_footprint  median 5.41x (min 5.40x, max 6.43x)  fastfeed 52.1 MB  torch 9.63 MB
  transport nw=2 vs torch nw=0 epochs of 60  fastfeed/torch ttfb  median 1.58x (min 0.98x, max 5.22x)  fastfeed 76.9 ms  torch 35.2 ms
  transport nw=2 vs torch nw=0 epochs of 60  fastfeed/torch ttfb_hot  median 40.73x (min 26.02x, max 65.00x)  fastfeed 73.8 ms  torch 1.84 ms
  transport nw=2 epochs of 300  fastfeed/torch throughput  median 3.60x (min 3.34x, max 6.10x)  fastfeed 4.15 GB/s  torch 1.08 GB/s
  transport nw=2 epochs of 300  fastfeed/torch main_cpu_s  median 0.18x (min 0.13x, max 0.19x)  fastfeed 0.278 s  torch 1.61 s
  transport nw=2 epochs of 300  fastfeed/torch peak_footprint  median 0.94x (min 0.83x, max 0.98x)  fastfeed 52.1 MB  torch 55.6 MB
  transport nw=2 epochs of 300  fastfeed/torch ttfb  median 0.64x (min 0.40x, max 1.03x)  fastfeed 54.2 ms  torch 110 ms
  transport nw=2 epochs of 300  fastfeed/torch ttfb_hot  median 0.70x (min 0.36x, max 0.91x)  fastfeed 65.1 ms  torch 93.6 ms
  transport nw=2 vs torch nw=0 epochs of 300  fastfeed/torch throughput  median 0.69x (min 0.48x, max 0.76x)  fastfeed 5.23 GB/s  torch 6.92 GB/s
  transport nw=2 vs torch nw=0 epochs of 300  fastfeed/torch main_cpu_s  median 0.17x (min 0.15x, max 0.20x)  fastfeed 0.247 s  torch 1.62 s
  transport nw=2 vs torch nw=0 epochs of 300  fastfeed/torch peak_footprint  median 5.41x (min 5.41x, max 6.41x)  fastfeed 52.1 MB  torch 9.63 MB
  transport nw=2 vs torch nw=0 epochs of 300  fastfeed/torch ttfb  median 8.32x (min 5.71x, max 9.82x)  fastfeed 54.8 ms  torch 7.93 ms
  transport nw=2 vs torch nw=0 epochs of 300  fastfeed/torch ttfb_hot  median 28.01x (min 21.32x, max 34.31x)  fastfeed 51.3 ms  torch 2.15 ms
"""

from __future__ import annotations

from .. import runner as _runner
from .. import workloads

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
            out.append(_runner.Comparison(wl, f"nw={nw}{suffix}", same, same, warmup, batches, mem_batches,
                                          epoch_batches=n))
            if nw:
                out.append(_runner.Comparison(wl, f"nw={nw} vs torch nw=0{suffix}", same, dict(num_workers=0, **own),
                                              warmup, batches, mem_batches, epoch_batches=n))
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
