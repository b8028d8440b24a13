"""Startup: how long from ``iter(loader)`` to the first batch, and how much memory does it take?

The transport dataset (64 uint8 images of 3x224x224 per batch), a fresh loader per trial,
nw=2. Figures: time to first batch (bar: <= 1.0x torch), the same plus the loader's
constructor (so work moved into ``__init__`` is not hidden), and peak PSS over a 30-batch run
minus the PSS just before the loader is made (bar: <= 1.0x torch).

Run: .venv/bin/python benchmarks/startup.py [--quick] [--rounds N] [--num-workers 2] [--mp-context spawn] [--out DIR]

Measured:
  (2026-11-29, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/startup.py`)
  startup nw=2  fastfeed/torch ttfb  median 0.61x (min 0.39x, max 0.86x)  fastfeed 21.8 ms  torch 38.5 ms  bar <=1.0x ok
  startup nw=2  fastfeed/torch peak_pss  median 2.06x (min 1.51x, max 2.07x)  fastfeed 50.2 MB  torch 24.4 MB  bar <=1.0x MISSED
  startup nw=2  fastfeed/torch peak_footprint  median 0.94x (min 0.80x, max 0.94x)  fastfeed 50.2 MB  torch 53.4 MB  bar <=1.0x ok
"""

from __future__ import annotations

import _runner
import workloads

# A 30-batch run: the first batch, then 29 under the PSS sampler; nothing is timed for throughput.
DEFAULTS = dict(rounds=10, warmup=1, batches=0, mem_batches=29, num_workers=[2])
QUICK = dict(rounds=3)
PRINTED = ("ttfb", "ctor_ttfb", "peak_pss", "peak_footprint", "peak_pss_abs")
BARS = {"ttfb": ("<=", 1.0), "peak_pss": ("<=", 1.0), "peak_footprint": ("<=", 1.0)}


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int) -> list[_runner.Comparison]:
    """The startup comparisons: candidate and torch at the same worker count.

    Args:
        num_workers: Worker counts.
        warmup: Untimed batches per trial, the first included.
        batches: Timed batches per trial (0: startup needs none).
        mem_batches: Batches per trial under the PSS sampler.

    Returns:
        One comparison per worker count.
    """
    wl = workloads.startup()
    return [_runner.Comparison(wl, f"nw={nw}", dict(num_workers=nw), dict(num_workers=nw),
                               warmup, batches, mem_batches, BARS) for nw in num_workers]


def main(argv=None) -> dict:
    """Run the startup benchmark from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK)
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches)
    return _runner.run_script("startup", comps, args, PRINTED)


if __name__ == "__main__":
    main()
