"""Overhead: what does one batch cost, besides its bytes?

Items of 16 float32 (64 bytes), 64 per batch, so a batch carries 4 KB and its cost is the
loader's own: sampling, fetching, collating, handing over. fastfeed and torch run at the
same worker count, for each of nw = 0, 1, 2. Reported in batches/s.

Run: .venv/bin/python benchmarks/overhead.py [--quick] [--rounds N] [--num-workers 0 1 2] [--out DIR] [--stats]

--stats asks another question: what does fastfeed's always-on measurement layer (loader.stats())
cost? The baseline is then fastfeed with FASTFEED_STATS=0.

Measured:
  (2026-11-30, 2-core VM, torch 2.13 CPU, commit 970c6ef, `.venv/bin/python benchmarks/overhead.py`)
  overhead nw=0  fastfeed/torch throughput  median 1.15x (min 0.90x, max 1.33x)  fastfeed 16,011 batch/s  torch 16,902 batch/s
  overhead nw=0  fastfeed/torch main_cpu_s  median 0.87x (min 0.75x, max 1.11x)  fastfeed 0.125 s  torch 0.118 s
  overhead nw=0  fastfeed/torch peak_footprint  median n/a  fastfeed 0.0205 MB  torch 0.0164 MB
  overhead nw=1  fastfeed/torch throughput  median 5.13x (min 3.85x, max 10.96x)  fastfeed 2,883 batch/s  torch 347 batch/s
  overhead nw=1  fastfeed/torch main_cpu_s  median 0.27x (min 0.14x, max 0.28x)  fastfeed 0.445 s  torch 2.49 s
  overhead nw=1  fastfeed/torch peak_footprint  median 0.90x (min 0.87x, max 0.91x)  fastfeed 7.61 MB  torch 8.42 MB
  overhead nw=2  fastfeed/torch throughput  median 4.56x (min 3.64x, max 5.40x)  fastfeed 3,768 batch/s  torch 980 batch/s
  overhead nw=2  fastfeed/torch main_cpu_s  median 0.23x (min 0.20x, max 0.25x)  fastfeed 0.345 s  torch 1.39 s
  overhead nw=2  fastfeed/torch peak_footprint  median 0.88x (min 0.88x, max 0.89x)  fastfeed 13.6 MB  torch 15.5 MB
"""

from __future__ import annotations

import os

from .. import runner as _runner
from .. import workloads

import fastfeed


class StatsOff(fastfeed.DataLoader):
    """fastfeed with its measurement layer off (FASTFEED_STATS=0 while each iterator is made)."""

    def _get_iterator(self):
        before = os.environ.get("FASTFEED_STATS")
        os.environ["FASTFEED_STATS"] = "0"
        try:
            return super()._get_iterator()
        finally:
            if before is None:
                del os.environ["FASTFEED_STATS"]
            else:
                os.environ["FASTFEED_STATS"] = before

DEFAULTS = dict(rounds=5, warmup=20, batches=2000, mem_batches=20, num_workers=[0, 1, 2])
QUICK = dict(rounds=2, warmup=5, batches=200, mem_batches=10)
PRINTED = ("throughput", "main_cpu_s", "peak_pss", "peak_footprint", "ttfb")


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int,
                stats: bool = False) -> list[_runner.Comparison]:
    """The overhead comparisons: candidate and torch at the same worker count.

    Args:
        num_workers: Worker counts.
        warmup: Untimed batches per trial.
        batches: Timed batches per trial.
        mem_batches: Batches per trial under the PSS sampler.
        stats: The baseline is fastfeed without stats, not torch.

    Returns:
        One comparison per worker count.
    """
    wl = workloads.overhead()
    return [_runner.Comparison(wl, f"nw={nw}", dict(num_workers=nw), dict(num_workers=nw),
                               warmup, batches, mem_batches) for nw in num_workers]


def main(argv=None) -> dict:
    """Run the overhead benchmark from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK, extra=lambda p: p.add_argument(
        "--stats", action="store_true", help="baseline: fastfeed with FASTFEED_STATS=0 (the measurement layer's cost)"))
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches, args.stats)
    if args.stats:
        return _runner.run_script("overhead-stats", comps, args, ("throughput", "main_cpu_s"),
                                  baseline=(StatsOff, "fastfeed-nostats"))
    return _runner.run_script("overhead", comps, args, PRINTED)


if __name__ == "__main__":
    main()
