"""Prefetch: does prefetch_factor mean what it means in torch?

A latency-bound map dataset: each __getitem__ sleeps 2 ms (time.sleep: no CPU, the GIL
released) and returns 16 float32; 16 items per batch, so one worker makes a batch in ~33 ms and
the throughput is set by how many batches are in flight, which is what num_workers and
prefetch_factor decide. persistent_workers=True. fastfeed and torch at the same num_workers and
prefetch_factor, for every prefetch_factor 1-8 and num_workers 1-4 (32 comparisons, labelled
"nw=W pf=P"), in batches/s. A trial times `--batches` x W batches
(default 20 per worker), after 8 untimed ones, so every comparison is timed for ~0.7 s; only the
first comparison of each worker count has priming trials. A loader that reads prefetch_factor
differently (fewer batches in flight per worker) starves its workers and falls behind torch at
small factors; one that reads it as more does not show here (the consumer is never the
bottleneck), so the peak memory figures are printed too.

Run: .venv/bin/python benchmarks/prefetch.py [--quick] [--rounds N] [--num-workers 1 2 3 4]
     [--prefetch-factors 1 2 ... 8] [--out DIR]

Measured:
  (2026-11-30, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/prefetch.py`)
  throughput medians, fastfeed/torch: lowest 0.96x (prefetch nw=4 pf=3), median of medians 1.01x, highest 1.15x
  rerun of nw=4 alone (`--num-workers 4`): all 8 >= 0.97x, lowest 0.98x (prefetch nw=4 pf=4)
  prefetch nw=1 pf=1  fastfeed/torch throughput  median 1.04x (min 1.02x, max 1.07x)  fastfeed 25.2 batch/s  torch 24.6 batch/s
  prefetch nw=1 pf=2  fastfeed/torch throughput  median 1.00x (min 1.00x, max 1.03x)  fastfeed 27.4 batch/s  torch 27.5 batch/s
  prefetch nw=1 pf=3  fastfeed/torch throughput  median 0.99x (min 0.89x, max 1.02x)  fastfeed 26 batch/s  torch 26.2 batch/s
  prefetch nw=1 pf=4  fastfeed/torch throughput  median 1.00x (min 0.99x, max 1.05x)  fastfeed 28.3 batch/s  torch 28.2 batch/s
  prefetch nw=1 pf=5  fastfeed/torch throughput  median 1.03x (min 1.00x, max 1.09x)  fastfeed 27.7 batch/s  torch 25.6 batch/s
  prefetch nw=1 pf=6  fastfeed/torch throughput  median 1.01x (min 0.96x, max 1.03x)  fastfeed 26.1 batch/s  torch 26.6 batch/s
  prefetch nw=1 pf=7  fastfeed/torch throughput  median 1.02x (min 1.00x, max 1.04x)  fastfeed 28.1 batch/s  torch 28.1 batch/s
  prefetch nw=1 pf=8  fastfeed/torch throughput  median 1.03x (min 1.01x, max 1.03x)  fastfeed 28 batch/s  torch 27.6 batch/s
  prefetch nw=2 pf=1  fastfeed/torch throughput  median 1.04x (min 1.03x, max 1.04x)  fastfeed 55 batch/s  torch 52.8 batch/s
  prefetch nw=2 pf=2  fastfeed/torch throughput  median 0.99x (min 0.97x, max 1.01x)  fastfeed 55.5 batch/s  torch 56.3 batch/s
  prefetch nw=2 pf=3  fastfeed/torch throughput  median 1.01x (min 0.98x, max 1.02x)  fastfeed 55.6 batch/s  torch 55 batch/s
  prefetch nw=2 pf=4  fastfeed/torch throughput  median 1.00x (min 0.99x, max 1.07x)  fastfeed 55.6 batch/s  torch 56.4 batch/s
  prefetch nw=2 pf=5  fastfeed/torch throughput  median 0.99x (min 0.97x, max 1.02x)  fastfeed 54.7 batch/s  torch 55.2 batch/s
  prefetch nw=2 pf=6  fastfeed/torch throughput  median 1.12x (min 1.00x, max 1.15x)  fastfeed 49.2 batch/s  torch 43.5 batch/s
  prefetch nw=2 pf=7  fastfeed/torch throughput  median 1.03x (min 1.02x, max 1.13x)  fastfeed 55 batch/s  torch 54 batch/s
  prefetch nw=2 pf=8  fastfeed/torch throughput  median 1.08x (min 1.05x, max 1.09x)  fastfeed 53.7 batch/s  torch 49.1 batch/s
  prefetch nw=3 pf=1  fastfeed/torch throughput  median 1.11x (min 0.88x, max 1.18x)  fastfeed 77.8 batch/s  torch 77.8 batch/s
  prefetch nw=3 pf=2  fastfeed/torch throughput  median 0.98x (min 0.98x, max 1.02x)  fastfeed 85.8 batch/s  torch 85.6 batch/s
  prefetch nw=3 pf=3  fastfeed/torch throughput  median 0.99x (min 0.98x, max 1.00x)  fastfeed 85.4 batch/s  torch 85.8 batch/s
  prefetch nw=3 pf=4  fastfeed/torch throughput  median 1.03x (min 0.92x, max 1.05x)  fastfeed 85.9 batch/s  torch 83.5 batch/s
  prefetch nw=3 pf=5  fastfeed/torch throughput  median 0.99x (min 0.98x, max 0.99x)  fastfeed 84 batch/s  torch 84.9 batch/s
  prefetch nw=3 pf=6  fastfeed/torch throughput  median 0.99x (min 0.98x, max 1.02x)  fastfeed 83.5 batch/s  torch 81.6 batch/s
  prefetch nw=3 pf=7  fastfeed/torch throughput  median 1.05x (min 0.92x, max 1.14x)  fastfeed 79.9 batch/s  torch 79.8 batch/s
  prefetch nw=3 pf=8  fastfeed/torch throughput  median 1.00x (min 0.97x, max 1.07x)  fastfeed 84.4 batch/s  torch 86.7 batch/s
  prefetch nw=4 pf=1  fastfeed/torch throughput  median 1.02x (min 1.01x, max 1.03x)  fastfeed 114 batch/s  torch 111 batch/s
  prefetch nw=4 pf=2  fastfeed/torch throughput  median 1.00x (min 0.92x, max 1.02x)  fastfeed 117 batch/s  torch 117 batch/s
  prefetch nw=4 pf=3  fastfeed/torch throughput  median 0.96x (min 0.93x, max 1.01x)  fastfeed 116 batch/s  torch 121 batch/s
  prefetch nw=4 pf=4  fastfeed/torch throughput  median 1.00x (min 1.00x, max 1.02x)  fastfeed 117 batch/s  torch 117 batch/s
  prefetch nw=4 pf=5  fastfeed/torch throughput  median 0.97x (min 0.97x, max 1.03x)  fastfeed 119 batch/s  torch 118 batch/s
  prefetch nw=4 pf=6  fastfeed/torch throughput  median 1.00x (min 0.92x, max 1.00x)  fastfeed 117 batch/s  torch 119 batch/s
  prefetch nw=4 pf=7  fastfeed/torch throughput  median 1.02x (min 0.88x, max 1.14x)  fastfeed 114 batch/s  torch 113 batch/s
  prefetch nw=4 pf=8  fastfeed/torch throughput  median 1.15x (min 1.06x, max 1.25x)  fastfeed 104 batch/s  torch 86.4 batch/s
"""

from __future__ import annotations

import sys
import warnings

from .. import runner as _runner
from .. import workloads

# 32 comparisons x 2 x 3 trials, each timing 20 x nw batches (~0.7 s): ~4-5 minutes on 2 cores.
DEFAULTS = dict(rounds=3, warmup=8, batches=20, mem_batches=4, num_workers=[1, 2, 3, 4],
                prefetch_factors=list(range(1, 9)))
QUICK = dict(rounds=2, warmup=2, batches=3, mem_batches=2, num_workers=[1, 2], prefetch_factors=[1, 2])
PRINTED = ("throughput", "main_cpu_s", "peak_footprint")


def comparisons(num_workers: list[int], prefetch_factors: list[int], warmup: int, batches: int,
                mem_batches: int) -> list[_runner.Comparison]:
    """The prefetch comparisons: candidate and torch at the same num_workers and prefetch_factor.

    Args:
        num_workers: Worker counts (each >= 1: prefetch_factor needs workers).
        prefetch_factors: Values of prefetch_factor.
        warmup: Untimed batches per trial, the first included.
        batches: Timed batches per trial and worker: a trial at nw=W times ``batches * W``.
        mem_batches: Batches per trial under the PSS sampler.

    Returns:
        One comparison per (num_workers, prefetch_factor), num_workers outermost.
    """
    wl = workloads.prefetch()
    out = []
    for nw in num_workers:
        for i, pf in enumerate(prefetch_factors):
            kwargs = dict(num_workers=nw, prefetch_factor=pf)
            out.append(_runner.Comparison(wl, f"nw={nw} pf={pf}", kwargs, kwargs, warmup, batches * nw, mem_batches,
                                          prime=i == 0))
    return out


def main(argv=None) -> dict:
    """Run the prefetch benchmark from the command line."""
    def extra(p):
        p.add_argument("--prefetch-factors", type=int, nargs="+", metavar="P",
                       help="prefetch_factor values to measure (default 1-8)")

    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK, extra)
    # nw=3 and 4 exceed the 2 CPUs of the machine this was written on: on purpose, the workers sleep.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if min(args.num_workers) < 1 or min(args.prefetch_factors) < 1:
        sys.exit("benchmarks/prefetch.py: --num-workers and --prefetch-factors must be >= 1")
    comps = comparisons(args.num_workers, args.prefetch_factors, args.warmup, args.batches, args.mem_batches)
    return _runner.run_script("prefetch", comps, args, PRINTED)


if __name__ == "__main__":
    main()
