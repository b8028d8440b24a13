"""Overhead: what does one batch cost, besides its bytes?

Items of 16 float32 (64 bytes), 64 per batch, so a batch carries 4 KB and its cost is the
loader's own: sampling, fetching, collating, handing over. fastfeed and torch run at the
same worker count, for each of nw = 0, 1, 2. Reported in batches/s.

Run: .venv/bin/python benchmarks/overhead.py [--quick] [--rounds N] [--num-workers 0 1 2] [--out DIR]

Measured (paste the figure lines of a full run here):
  (to be filled by the lead)
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
    return [_runner.Comparison(wl, f"nw={nw}", dict(num_workers=nw), dict(num_workers=nw),
                               warmup, batches, mem_batches) for nw in num_workers]


def main(argv=None) -> dict:
    """Run the overhead benchmark from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK)
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches)
    return _runner.run_script("overhead", comps, args, PRINTED)


if __name__ == "__main__":
    main()
