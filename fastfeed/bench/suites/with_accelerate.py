"""Accelerate: the transport workload through ``Accelerator.prepare``, as a training script under Accelerate
iterates it: epochs of 60 batches, torch's default persistent_workers=False, nw=2, on the CPU.

The baseline is torch's loader prepared by Accelerate. Against it, in the same rounds:
  prepare              fastfeed's loader, not prepared; variant "accelerate": fastfeed's loader prepared by
                       Accelerate, which fastfeed.accelerate keeps fastfeed's (its ratio to the unprepared
                       one, "accelerate/candidate", is what Accelerate's wrapper costs);
  prepare, stateful    the same with use_stateful_dataloader=True: torchdata's StatefulDataLoader on torch's
                       side, fastfeed's own state on fastfeed's.

Run: .venv/bin/python benchmarks/with_accelerate.py [--quick] [--rounds N] [--out DIR]   (needs accelerate, torchdata)

Measured:
  (2026-12-01, 2-core VM, torch 2.13 CPU, accelerate 1.15, torchdata 0.11, on commit 948f882 plus this suite,
  `.venv/bin/python benchmarks/with_accelerate.py`)
  transport prepare nw=2  fastfeed/torch+accelerate throughput  median 2.79x (min 2.47x, max 3.27x)  fastfeed 2.96 GB/s  torch+accelerate 1.09 GB/s
  transport prepare nw=2  fastfeed/torch+accelerate main_cpu_s  median 0.35x (min 0.31x, max 0.39x)  fastfeed 0.251 s  torch+accelerate 0.753 s
  transport prepare nw=2  fastfeed/torch+accelerate ttfb  median 0.59x (min 0.26x, max 0.72x)  fastfeed 40 ms  torch+accelerate 88.7 ms
  transport prepare nw=2  fastfeed-accelerate/torch+accelerate throughput  median 2.56x (min 2.31x, max 3.12x)  fastfeed-accelerate 2.83 GB/s  torch+accelerate 1.09 GB/s
  transport prepare nw=2  fastfeed-accelerate/torch+accelerate main_cpu_s  median 0.35x (min 0.33x, max 0.45x)  fastfeed-accelerate 0.268 s  torch+accelerate 0.753 s
  transport prepare nw=2  fastfeed-accelerate/torch+accelerate ttfb  median 0.81x (min 0.37x, max 1.11x)  fastfeed-accelerate 66.9 ms  torch+accelerate 88.7 ms
  transport prepare nw=2  fastfeed-accelerate/fastfeed throughput  median 0.92x (min 0.77x, max 1.07x)  fastfeed-accelerate 2.83 GB/s  fastfeed 2.96 GB/s
  transport prepare nw=2  fastfeed-accelerate/fastfeed main_cpu_s  median 1.05x (min 0.88x, max 1.47x)  fastfeed-accelerate 0.268 s  fastfeed 0.251 s
  transport prepare nw=2  fastfeed-accelerate/fastfeed ttfb  median 1.50x (min 1.06x, max 2.20x)  fastfeed-accelerate 66.9 ms  fastfeed 40 ms
  transport prepare, stateful nw=2  fastfeed/torch+accelerate throughput  median 3.09x (min 2.52x, max 3.23x)  fastfeed 3.15 GB/s  torch+accelerate 1.06 GB/s
  transport prepare, stateful nw=2  fastfeed/torch+accelerate main_cpu_s  median 0.31x (min 0.27x, max 0.35x)  fastfeed 0.243 s  torch+accelerate 0.781 s
  transport prepare, stateful nw=2  fastfeed/torch+accelerate ttfb  median 1.13x (min 0.84x, max 1.75x)  fastfeed 45.9 ms  torch+accelerate 38.1 ms
  transport prepare, stateful nw=2  fastfeed-accelerate/torch+accelerate throughput  median 2.84x (min 2.67x, max 2.98x)  fastfeed-accelerate 3.04 GB/s  torch+accelerate 1.06 GB/s
  transport prepare, stateful nw=2  fastfeed-accelerate/torch+accelerate main_cpu_s  median 0.33x (min 0.28x, max 0.36x)  fastfeed-accelerate 0.253 s  torch+accelerate 0.781 s
  transport prepare, stateful nw=2  fastfeed-accelerate/torch+accelerate ttfb  median 1.71x (min 1.29x, max 3.06x)  fastfeed-accelerate 70.6 ms  torch+accelerate 38.1 ms
  transport prepare, stateful nw=2  fastfeed-accelerate/fastfeed throughput  median 0.92x (min 0.86x, max 1.11x)  fastfeed-accelerate 3.04 GB/s  fastfeed 3.15 GB/s
  transport prepare, stateful nw=2  fastfeed-accelerate/fastfeed main_cpu_s  median 1.04x (min 0.91x, max 1.22x)  fastfeed-accelerate 0.253 s  fastfeed 0.243 s
  transport prepare, stateful nw=2  fastfeed-accelerate/fastfeed ttfb  median 1.44x (min 1.05x, max 2.05x)  fastfeed-accelerate 70.6 ms  fastfeed 45.9 ms
"""

from __future__ import annotations

from torch.utils.data import DataLoader as TorchDataLoader

from ... import DataLoader as FastDataLoader
from .. import runner as _runner
from .. import workloads

DEFAULTS = dict(rounds=7, warmup=10, batches=240, mem_batches=20, num_workers=[2])
QUICK = dict(rounds=2, warmup=3, batches=12, mem_batches=5)
PRINTED = ("throughput", "main_cpu_s", "ttfb")
EPOCH_BATCHES, QUICK_EPOCH_BATCHES = 60, 6


def _prepared(cls, dataset, stateful: bool = False, **kwargs):
    from accelerate import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    return accelerator.prepare(cls(dataset, **kwargs))


def torch_prepared(dataset, **kwargs):
    """torch's DataLoader, prepared by Accelerate (``stateful=True``: with use_stateful_dataloader)."""
    return _prepared(TorchDataLoader, dataset, **kwargs)


def fastfeed_prepared(dataset, **kwargs):
    """fastfeed's DataLoader, prepared by Accelerate (``stateful=True``: with use_stateful_dataloader)."""
    return _prepared(FastDataLoader, dataset, **kwargs)


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int,
                epoch_batches: int = EPOCH_BATCHES) -> list[_runner.Comparison]:
    """Per worker count: plain prepare, and prepare with use_stateful_dataloader."""
    wl = workloads.transport()
    out = []
    for nw in num_workers:
        for label, stateful in (("prepare", False), ("prepare, stateful", True)):
            base = {"num_workers": nw, "stateful": stateful}
            out.append(_runner.Comparison(wl, f"{label} nw={nw}", {"num_workers": nw}, base, warmup, batches,
                                          mem_batches, variants={"accelerate": (fastfeed_prepared, base)},
                                          epoch_batches=epoch_batches))  # fmt: skip
    return out


def main(argv=None) -> dict:
    """Run the Accelerate benchmark from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK)
    epochs = QUICK_EPOCH_BATCHES if args.quick else EPOCH_BATCHES
    comps = comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches, epochs)
    return _runner.run_script("with_accelerate", comps, args, PRINTED, baseline=(torch_prepared, "torch+accelerate"))


if __name__ == "__main__":
    main()
