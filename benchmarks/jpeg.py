"""JPEG: CPU-bound decode: throughput and main-process CPU.

512 generated JPEGs on disk (~57 KB, 400-500 x 320-375 px, quality 90; made once into
benchmarks/.cache/). Each item reads a file, decodes it with PIL, takes a random 224x224 crop
and a random horizontal flip (torch's global RNG, as torchvision does), and returns a uint8
3x224x224 tensor; 64 per batch. For each worker count N, three loaders in the same rounds,
interleaved (the order rotates every round):
  fastfeed-process   fastfeed.DataLoader(..., num_workers=N), worker processes (the default);
  fastfeed-thread    fastfeed.DataLoader(..., num_workers=N, worker_type="thread");
  torch              torch's DataLoader(..., num_workers=N).
Ratios: fastfeed-process/torch, fastfeed-thread/torch and fastfeed-thread/fastfeed-process.
main_cpu_s counts every thread of the main process, so a thread worker's decoding is in it;
tree_cpu_s adds the worker processes: the whole cost of a batch. Memory: peak_pss (anonymous plus
mapped shared memory) and peak_footprint (anonymous PSS plus all shared memory on the machine, which
also counts torch's in-flight batches that no process maps; bar for fastfeed-process/torch: <= 1.0x).

Run: .venv/bin/python benchmarks/jpeg.py [--quick] [--rounds N] [--num-workers 1 2 4] [--out DIR]

Measured (before peak_footprint had its bar: its fastfeed-process/torch line would now end `bar <=1.0x MISSED`):
  (2026-11-29, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/jpeg.py`)
  jpeg nw=2  fastfeed-process/torch throughput  median 1.14x (min 0.68x, max 1.17x)  fastfeed-process 29 batch/s  torch 25.7 batch/s
  jpeg nw=2  fastfeed-process/torch main_cpu_s  median 0.15x (min 0.12x, max 0.20x)  fastfeed-process 0.0302 s  torch 0.197 s
  jpeg nw=2  fastfeed-process/torch tree_cpu_s  median 0.89x (min 0.86x, max 0.95x)  fastfeed-process 6.81 s  torch 7.57 s
  jpeg nw=2  fastfeed-process/torch peak_pss  median 1.49x (min 1.44x, max 1.84x)  fastfeed-process 79.8 MB  torch 52.7 MB
  jpeg nw=2  fastfeed-process/torch peak_footprint  median 1.25x (min 1.12x, max 1.34x)  fastfeed-process 78.8 MB  torch 63.4 MB
  jpeg nw=2  fastfeed-process/torch ttfb  median 0.98x (min 0.90x, max 1.11x)  fastfeed-process 107 ms  torch 108 ms
  jpeg nw=2  fastfeed-thread/torch throughput  median 1.01x (min 0.62x, max 1.07x)  fastfeed-thread 25.8 batch/s  torch 25.7 batch/s
  jpeg nw=2  fastfeed-thread/torch main_cpu_s  median 36.09x (min 31.79x, max 38.53x)  fastfeed-thread 7.05 s  torch 0.197 s
  jpeg nw=2  fastfeed-thread/torch tree_cpu_s  median 0.93x (min 0.91x, max 0.97x)  fastfeed-thread 7.05 s  torch 7.57 s
  jpeg nw=2  fastfeed-thread/torch peak_pss  median 1.11x (min 1.06x, max 1.33x)  fastfeed-thread 59 MB  torch 52.7 MB
  jpeg nw=2  fastfeed-thread/torch peak_footprint  median 0.92x (min 0.82x, max 0.99x)  fastfeed-thread 57.7 MB  torch 63.4 MB
  jpeg nw=2  fastfeed-thread/torch ttfb  median 0.81x (min 0.70x, max 1.41x)  fastfeed-thread 86.6 ms  torch 108 ms
  jpeg nw=2  fastfeed-thread/fastfeed-process throughput  median 0.89x (min 0.66x, max 1.08x)  fastfeed-thread 25.8 batch/s  fastfeed-process 29 batch/s
  jpeg nw=2  fastfeed-thread/fastfeed-process main_cpu_s  median 235.89x (min 187.40x, max 276.43x)  fastfeed-thread 7.05 s  fastfeed-process 0.0302 s
  jpeg nw=2  fastfeed-thread/fastfeed-process tree_cpu_s  median 1.05x (min 0.96x, max 1.10x)  fastfeed-thread 7.05 s  fastfeed-process 6.81 s
  jpeg nw=2  fastfeed-thread/fastfeed-process peak_pss  median 0.73x (min 0.72x, max 0.76x)  fastfeed-thread 59 MB  fastfeed-process 79.8 MB
  jpeg nw=2  fastfeed-thread/fastfeed-process peak_footprint  median 0.73x (min 0.70x, max 0.77x)  fastfeed-thread 57.7 MB  fastfeed-process 78.8 MB
  jpeg nw=2  fastfeed-thread/fastfeed-process ttfb  median 0.81x (min 0.74x, max 1.40x)  fastfeed-thread 86.6 ms  fastfeed-process 107 ms
"""

from __future__ import annotations

import sys

import _runner
import workloads
from torch.utils.data import DataLoader as TorchDataLoader

# Three sides: a multiple of 3 rounds runs each side in each position equally often.
DEFAULTS = {
    "rounds": 6,
    "warmup": 5,
    "batches": 100,
    "mem_batches": 10,
    "num_workers": [2],
}
QUICK = {"rounds": 2, "warmup": 2, "batches": 8, "mem_batches": 3}
PRINTED = (
    "throughput",
    "main_cpu_s",
    "tree_cpu_s",
    "peak_pss",
    "peak_footprint",
    "ttfb",
)


def comparisons(
    num_workers: list[int],
    warmup: int,
    batches: int,
    mem_batches: int,
    threads: bool = True,
    files: int = workloads.JPEG_FILES,
) -> list[_runner.Comparison]:
    """The jpeg comparisons for each worker count.

    Args:
        num_workers: Worker counts, the same for all three loaders.
        warmup: Untimed batches per trial.
        batches: Timed batches per trial.
        mem_batches: Batches per trial under the PSS sampler.
        threads: Include fastfeed with thread workers (needs a candidate that takes ``worker_type``).
        files: Number of distinct JPEG files.

    Returns:
        One comparison per worker count: fastfeed's worker processes against torch's, with
        fastfeed's worker threads as a variant in the same rounds.
    """
    wl = workloads.jpeg(files)
    out = []
    for nw in num_workers:
        procs = {"num_workers": nw}
        variants = {}
        if threads:
            # A thread side takes no multiprocessing_context, even under --mp-context.
            thread = {"worker_type": "thread", "multiprocessing_context": None}
            variants["thread"] = {**procs, **thread}
        comp = _runner.Comparison(
            wl,
            f"nw={nw}",
            candidate_kwargs=procs,
            baseline_kwargs=procs,
            warmup=warmup,
            batches=batches,
            mem_batches=mem_batches,
            bars={"peak_footprint": ("<=", 1.0)},  # the brief's bar, fastfeed-process/torch
            candidate_tag="process",
            variants=variants,
        )
        out.append(comp)
    return out


def main(argv=None) -> dict:
    """Run the jpeg benchmark from the command line."""

    def extra(p):
        text = "distinct JPEG files (~57 KB each)"
        p.add_argument("--files", type=int, default=workloads.JPEG_FILES, help=text)

    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK, extra)
    try:
        import PIL  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/jpeg.py needs Pillow: .venv/bin/pip install pillow")
    if 0 in args.num_workers:
        sys.exit("benchmarks/jpeg.py compares workers: --num-workers must be >= 1")
    # torch's own DataLoader (the harness check) has no thread workers: two sides only.
    candidate, _ = _runner.resolve_candidate(args.candidate)
    threads = candidate is not TorchDataLoader
    if not threads:
        print(
            "# the candidate is torch's DataLoader, without worker_type: no thread side"
        )
    counts = args.warmup, args.batches, args.mem_batches
    comps = comparisons(args.num_workers, *counts, threads=threads, files=args.files)
    return _runner.run_script("jpeg", comps, args, PRINTED)


if __name__ == "__main__":
    main()
