"""Overhead: what does one batch cost, besides its bytes?

Items of 16 float32 (64 bytes), 64 per batch, so a batch carries 4 KB and its cost is the
loader's own: sampling, fetching, collating, handing over. fastfeed and torch run at the
same worker count, for each of nw = 0, 1, 2. Reported in batches/s.

Run: .venv/bin/python benchmarks/overhead.py [--quick] [--rounds N] [--num-workers 0 1 2] [--out DIR]

Measured:
  (2026-11-29, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/overhead.py`)
  overhead nw=0  fastfeed/torch throughput  median 1.02x (min 1.00x, max 1.51x)  fastfeed 35,827 batch/s  torch 35,247 batch/s
  overhead nw=0  fastfeed/torch main_cpu_s  median 0.98x (min 0.95x, max 1.00x)  fastfeed 0.0558 s  torch 0.0568 s
  overhead nw=0  fastfeed/torch peak_footprint  median n/a  fastfeed 0.041 MB  torch 0.041 MB
  overhead nw=1  fastfeed/torch throughput  median 6.62x (min 6.00x, max 7.65x)  fastfeed 9,732 batch/s  torch 1,490 batch/s
  overhead nw=1  fastfeed/torch main_cpu_s  median 0.24x (min 0.19x, max 0.25x)  fastfeed 0.17 s  torch 0.731 s
  overhead nw=1  fastfeed/torch peak_footprint  median 0.80x (min 0.77x, max 0.82x)  fastfeed 6.57 MB  torch 8.27 MB
  overhead nw=2  fastfeed/torch throughput  median 5.51x (min 4.86x, max 7.29x)  fastfeed 10,653 batch/s  torch 1,917 batch/s
  overhead nw=2  fastfeed/torch main_cpu_s  median 0.19x (min 0.19x, max 0.20x)  fastfeed 0.149 s  torch 0.758 s
  overhead nw=2  fastfeed/torch peak_footprint  median 0.77x (min 0.76x, max 0.77x)  fastfeed 11.8 MB  torch 15.3 MB
"""

from __future__ import annotations

import _runner
import workloads

DEFAULTS = dict(rounds=5, warmup=20, batches=2000, mem_batches=20, num_workers=[0, 1, 2])
QUICK = dict(rounds=2, warmup=5, batches=200, mem_batches=10)
PRINTED = ("throughput", "main_cpu_s", "peak_pss", "peak_footprint", "ttfb")


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int) -> list[_runner.Comparison]:
    """The overhead comparisons: candidate and torch at the same worker count.

    Args:
        num_workers: Worker counts.
        warmup: Untimed batches per trial.
        batches: Timed batches per trial.
        mem_batches: Batches per trial under the PSS sampler.

    Returns:
        One comparison per worker count.
    """
    wl = workloads.overhead()
    # The brief's bar: at nw=2, at least 3x torch's batches/s.
    return [_runner.Comparison(wl, f"nw={nw}", dict(num_workers=nw), dict(num_workers=nw),
                               warmup, batches, mem_batches,
                               {"throughput": (">=", 3.0)} if nw == 2 else {}) for nw in num_workers]


def main(argv=None) -> dict:
    """Run the overhead benchmark from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK)
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches)
    return _runner.run_script("overhead", comps, args, PRINTED)


if __name__ == "__main__":
    main()
