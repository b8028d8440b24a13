"""Prefetch: does prefetch_factor mean what it means in torch?

A latency-bound map dataset: each __getitem__ sleeps 2 ms (time.sleep: no CPU, the GIL
released) and returns 16 float32; 16 items per batch, so one worker makes a batch in ~33 ms and
the throughput is set by how many batches are in flight, which is what num_workers and
prefetch_factor decide. persistent_workers=True. fastfeed and torch at the same num_workers and
prefetch_factor, for every prefetch_factor 1-8 and num_workers 1-4 (32 comparisons, labelled
"nw=W pf=P"), in batches/s; bar on each: >= 0.97x torch. A trial times `--batches` x W batches
(default 20 per worker), after 8 untimed ones, so every comparison is timed for ~0.7 s; only the
first comparison of each worker count has priming trials. A loader that reads prefetch_factor
differently (fewer batches in flight per worker) starves its workers and misses the bar at
small factors; one that reads it as more does not show here (the consumer is never the
bottleneck), so the peak memory figures are printed too.

Run: .venv/bin/python benchmarks/prefetch.py [--quick] [--rounds N] [--num-workers 1 2 3 4]
     [--prefetch-factors 1 2 ... 8] [--out DIR]

Measured:
  Pending a full run.
"""

from __future__ import annotations

import sys
import warnings

import _runner
import workloads

# 32 comparisons x 2 x 3 trials, each timing 20 x nw batches (~0.7 s): ~4-5 minutes on 2 cores.
DEFAULTS = dict(rounds=3, warmup=8, batches=20, mem_batches=4, num_workers=[1, 2, 3, 4],
                prefetch_factors=list(range(1, 9)))
QUICK = dict(rounds=2, warmup=2, batches=3, mem_batches=2, num_workers=[1, 2], prefetch_factors=[1, 2])
PRINTED = ("throughput", "main_cpu_s", "peak_footprint")
BAR = {"throughput": (">=", 0.97)}


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
                                          BAR, prime=i == 0))
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
