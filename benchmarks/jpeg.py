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

Measured:
  (2026-11-30, 2-core VM, torch 2.13 CPU, commit 970c6ef, `.venv/bin/python benchmarks/jpeg.py`)
  jpeg nw=2  fastfeed-process/torch throughput  median 0.98x (min 0.92x, max 1.33x)  fastfeed-process 12.5 batch/s  torch 12.6 batch/s
  jpeg nw=2  fastfeed-process/torch main_cpu_s  median 0.22x (min 0.19x, max 0.27x)  fastfeed-process 0.0557 s  torch 0.263 s
  jpeg nw=2  fastfeed-process/torch tree_cpu_s  median 0.96x (min 0.85x, max 1.06x)  fastfeed-process 13.4 s  torch 14.1 s
  jpeg nw=2  fastfeed-process/torch peak_pss  median 1.34x (min 1.16x, max 1.68x)  fastfeed-process 64.2 MB  torch 47.6 MB
  jpeg nw=2  fastfeed-process/torch peak_footprint  median 1.19x (min 1.08x, max 1.30x)  fastfeed-process 64.2 MB  torch 54.4 MB  bar <=1.0x MISSED
  jpeg nw=2  fastfeed-process/torch ttfb  median 0.80x (min 0.40x, max 1.15x)  fastfeed-process 180 ms  torch 209 ms
  jpeg nw=2  fastfeed-thread/torch throughput  median 0.83x (min 0.51x, max 1.14x)  fastfeed-thread 9.46 batch/s  torch 12.6 batch/s
  jpeg nw=2  fastfeed-thread/torch peak_footprint  median 0.85x (min 0.71x, max 1.03x)  fastfeed-thread 48 MB  torch 54.4 MB
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
