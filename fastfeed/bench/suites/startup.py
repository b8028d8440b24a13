"""Startup: how long from ``iter(loader)`` to the first batch, of the first epoch and of later ones,
and how much memory does it take?

The transport dataset (64 uint8 images of 3x224x224 per batch; a 256-image pool, 38.5 MB: this
question is not about bandwidth), nw=2. A trial builds one loader with torch's default
persistent_workers=False and runs 3 epochs of 30 batches (`--epoch-batches`, see _runner.run_epochs):
the first epoch as before, its first batch then 29 batches each followed by a PSS sample; then two
epochs that each start their workers again. Figures:
  ttfb            time to the first batch of epoch 1, from iter(loader);
  ctor_ttfb       the same plus the loader's constructor (work moved into __init__ is not hidden);
  ttfb_hot        time to the first batch of epoch 2 and later, from iter(loader), the median of
                  the two;
  peak_pss        peak PSS over the trial minus the PSS just before the loader is made;
  peak_footprint  the same for anonymous PSS plus all shared memory.
`--epoch-batches 0` runs the old single 30-batch iterator (no ttfb_hot).

Run: .venv/bin/python benchmarks/startup.py [--quick] [--rounds N] [--num-workers 2] [--epoch-batches 30]
     [--mp-context spawn] [--out DIR]

Measured:
  (2026-11-30, 2-core VM, torch 2.13 CPU, commit 970c6ef, `.venv/bin/python benchmarks/startup.py`)
  startup nw=2 epochs of 30  fastfeed/torch ttfb  median 0.61x (min 0.43x, max 0.77x)  fastfeed 37.4 ms  torch 62.4 ms
  startup nw=2 epochs of 30  fastfeed/torch ctor_ttfb  median 0.62x (min 0.43x, max 0.77x)  fastfeed 37.5 ms  torch 62.6 ms
  startup nw=2 epochs of 30  fastfeed/torch ttfb_hot  median 0.58x (min 0.35x, max 1.21x)  fastfeed 37.7 ms  torch 62.9 ms
  startup nw=2 epochs of 30  fastfeed/torch peak_pss  median 2.12x (min 1.53x, max 2.13x)  fastfeed 51.6 MB  torch 24.4 MB
  startup nw=2 epochs of 30  fastfeed/torch peak_footprint  median 0.97x (min 0.83x, max 0.97x)  fastfeed 51.6 MB  torch 53.3 MB
  startup nw=2 epochs of 30  fastfeed/torch peak_pss_abs  median 1.13x (min 1.08x, max 1.13x)  fastfeed 243 MB  torch 216 MB
"""

from __future__ import annotations

from .. import runner as _runner
from .. import workloads

# A trial: 3 epochs of 30 batches, the first with a PSS sample after each of its last 29 (nothing
# timed for throughput: batches=0 leaves the minimum of 2 timed epochs, which give ttfb_hot).
DEFAULTS = dict(rounds=10, warmup=1, batches=0, mem_batches=29, num_workers=[2], epoch_batches=[30])
QUICK = dict(rounds=3, mem_batches=9, epoch_batches=[10])
PRINTED = ("ttfb", "ctor_ttfb", "ttfb_hot", "peak_pss", "peak_footprint", "peak_pss_abs")


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int,
                epoch_batches: list[int] = (30,)) -> list[_runner.Comparison]:
    """The startup comparisons: candidate and torch at the same worker count.

    Args:
        num_workers: Worker counts.
        warmup: Untimed batches per trial, the first included (steady state only).
        batches: Timed batches per trial (0: startup needs none).
        mem_batches: Batches per trial under the PSS sampler.
        epoch_batches: Epoch lengths; 0 is the steady state (one iterator, no ttfb_hot).

    Returns:
        One comparison per epoch length and worker count.
    """
    wl = workloads.startup()
    out = []
    for n in epoch_batches:
        own = dict(persistent_workers=False) if n else {}  # torch's default, spelled out
        suffix = f" epochs of {n}" if n else ""
        out += [_runner.Comparison(wl, f"nw={nw}{suffix}", dict(num_workers=nw, **own), dict(num_workers=nw, **own),
                                   warmup, batches, mem_batches, epoch_batches=n) for nw in num_workers]
    return out


def main(argv=None) -> dict:
    """Run the startup benchmark from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK)
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches, args.epoch_batches)
    return _runner.run_script("startup", comps, args, PRINTED)


if __name__ == "__main__":
    main()
