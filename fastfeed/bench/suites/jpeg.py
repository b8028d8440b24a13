"""JPEG: CPU-bound decode: throughput, CPU of the whole process tree, memory.

512 generated JPEGs on disk (~57 KB, 400-500 x 320-375 px, quality 90; made once into
benchmarks/.cache/). Each item reads a file, decodes it with PIL, takes a random 224x224 crop
and a random horizontal flip (torch's global RNG, as torchvision does), and returns a uint8
3x224x224 tensor; 64 per batch. For each worker count N, four loaders in the same rounds,
interleaved (the order rotates every round), each with the same CPU budget of N workers:
  fastfeed-process   fastfeed.DataLoader(..., num_workers=N), worker processes (the default);
  fastfeed-thread    fastfeed.DataLoader(..., num_workers=N, worker_type="thread");
  fastfeed-dali      fastfeed.dali.DALILoader over the same files, num_threads=N, on the CPU: DALI
                     decodes only the crop's region (libjpeg-turbo's ROI decoding) where PIL decodes
                     the whole image, then flips and transposes to CHW; the same crops (bit-identical
                     to PIL's at the same corner, the corner uniform), the same flips, the same batches
                     (workloads.dali_jpeg_loader; skipped, saying why, when NVIDIA DALI is not installed);
  torch              torch's DataLoader(..., num_workers=N).
Ratios: each fastfeed side/torch, and fastfeed-thread and fastfeed-dali/fastfeed-process; then each
side's images/s. main_cpu_s counts every thread of the main process, so a thread worker's and DALI's
decoding is in it; tree_cpu_s adds the worker processes: the whole cost of a batch. Memory: peak_pss
(anonymous plus mapped shared memory) and peak_footprint (anonymous PSS plus all shared memory on the
machine, which also counts torch's in-flight batches that no process maps).

Run: .venv/bin/python benchmarks/jpeg.py [--quick] [--rounds N] [--num-workers 1 2 4] [--out DIR]

Measured:
  (2026-11-30, 2-core VM, torch 2.13 CPU, NVIDIA DALI 2.4.0, commit e77b7b8 plus the DALI side,
  `.venv/bin/python benchmarks/jpeg.py`, 8 rounds)
  jpeg nw=2  fastfeed-process/torch throughput  median 1.10x (min 0.98x, max 1.19x)  fastfeed-process 15.6 batch/s  torch 14.3 batch/s
  jpeg nw=2  fastfeed-process/torch main_cpu_s  median 0.20x (min 0.17x, max 0.28x)  fastfeed-process 0.0495 s  torch 0.248 s
  jpeg nw=2  fastfeed-process/torch tree_cpu_s  median 0.92x (min 0.84x, max 1.03x)  fastfeed-process 12.5 s  torch 13.6 s
  jpeg nw=2  fastfeed-process/torch peak_pss  median 1.33x (min 0.96x, max 1.63x)  fastfeed-process 69.7 MB  torch 52.7 MB
  jpeg nw=2  fastfeed-process/torch peak_footprint  median 1.12x (min 0.96x, max 1.45x)  fastfeed-process 69.7 MB  torch 62.6 MB
  jpeg nw=2  fastfeed-process/torch ttfb  median 0.93x (min 0.68x, max 1.28x)  fastfeed-process 185 ms  torch 205 ms
  jpeg nw=2  fastfeed-thread/torch throughput  median 0.89x (min 0.62x, max 1.04x)  fastfeed-thread 12.9 batch/s  torch 14.3 batch/s
  jpeg nw=2  fastfeed-thread/torch tree_cpu_s  median 1.02x (min 0.90x, max 1.06x)  fastfeed-thread 13.5 s  torch 13.6 s
  jpeg nw=2  fastfeed-thread/torch peak_footprint  median 0.64x (min 0.45x, max 0.75x)  fastfeed-thread 37.3 MB  torch 62.6 MB
  jpeg nw=2  fastfeed-dali/torch throughput  median 1.87x (min 1.70x, max 2.08x)  fastfeed-dali 27.3 batch/s  torch 14.3 batch/s
  jpeg nw=2  fastfeed-dali/torch main_cpu_s  median 27.85x (min 26.13x, max 30.25x)  fastfeed-dali 6.76 s  torch 0.248 s
  jpeg nw=2  fastfeed-dali/torch tree_cpu_s  median 0.50x (min 0.47x, max 0.52x)  fastfeed-dali 6.77 s  torch 13.6 s
  jpeg nw=2  fastfeed-dali/torch peak_pss  median 4.98x (min 3.66x, max 6.67x)  fastfeed-dali 248 MB  torch 52.7 MB
  jpeg nw=2  fastfeed-dali/torch peak_footprint  median 4.02x (min 3.40x, max 4.89x)  fastfeed-dali 248 MB  torch 62.6 MB
  jpeg nw=2  fastfeed-dali/torch ttfb  median 0.41x (min 0.34x, max 0.47x)  fastfeed-dali 80.4 ms  torch 205 ms
  jpeg nw=2  images/s (median)  torch 916  fastfeed-process 997  fastfeed-thread 824  fastfeed-dali 1,746
fastfeed-dali's footprint is glibc's, not its queue's: DALI allocates and frees its buffers on every run,
and once a large freed block has raised glibc's dynamic mmap threshold, they come from the heap, which
keeps what is freed. With MALLOC_TRIM_THRESHOLD_=131072 (which fixes the thresholds), for the whole
process tree, 4 rounds the same day: fastfeed-dali/torch 0.56x peak_footprint (30 MB), 1.75x throughput,
0.52x tree_cpu_s.
"""

from __future__ import annotations

import statistics
import sys

from .. import extras
from .. import runner as _runner
from .. import workloads
from torch.utils.data import DataLoader as TorchDataLoader

# Four sides: a multiple of 4 rounds runs each side in each position equally often.
DEFAULTS = {
    "rounds": 8,
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
    dali: bool = False,
) -> list[_runner.Comparison]:
    """The jpeg comparisons for each worker count.

    Args:
        num_workers: Worker counts, the same for every loader (DALI's ``num_threads``).
        warmup: Untimed batches per trial.
        batches: Timed batches per trial.
        mem_batches: Batches per trial under the PSS sampler.
        threads: Include fastfeed with thread workers (needs a candidate that takes ``worker_type``).
        files: Number of distinct JPEG files.
        dali: Include fastfeed.dali's DALILoader on the CPU (needs NVIDIA DALI).

    Returns:
        One comparison per worker count: fastfeed's worker processes against torch's, with
        fastfeed's worker threads and the DALI pipeline as variants in the same rounds.
    """
    wl = workloads.jpeg(files)
    out = []
    for nw in num_workers:
        procs = {"num_workers": nw}
        variants = {}
        # A thread side takes no multiprocessing_context, even under --mp-context; nor does DALI's.
        no_context = {"multiprocessing_context": None}
        if threads:
            variants["thread"] = {**procs, "worker_type": "thread", **no_context}
        if dali:
            variants["dali"] = (workloads.dali_jpeg_loader, {**procs, **no_context})
        comp = _runner.Comparison(
            wl,
            f"nw={nw}",
            candidate_kwargs=procs,
            baseline_kwargs=procs,
            warmup=warmup,
            batches=batches,
            mem_batches=mem_batches,
            candidate_tag="process",
            variants=variants,
        )
        out.append(comp)
    return out


def dali_missing() -> str | None:
    """Why there can be no DALI side here (``fastfeed.dali`` does not import), or None."""
    try:
        import fastfeed.dali  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def check_dali_output(wl, nw: int) -> None:
    """Exit unless a DALI batch has the shape and dtype torch's would: the sides must make the same batches.

    torch collates ``batch_size`` items of the dataset into one tensor, so one item says what
    its batch is without decoding the other 63.
    """
    batch_size = wl.loader_kwargs["batch_size"]
    dataset = wl.make_dataset(batch_size)
    item = dataset[0]
    loader = workloads.dali_jpeg_loader(dataset, batch_size=batch_size, num_workers=nw)
    try:
        (images,) = next(iter(loader))
    finally:
        loader.close()
    want, got = ((batch_size, *item.shape), item.dtype), (tuple(images.shape), images.dtype)
    if got != want:
        sys.exit(f"benchmarks/jpeg.py: a DALI batch is {got}, torch's would be {want}: not the same workload")


def print_images_per_s(result: dict) -> None:
    """One line per comparison: each side's median images/s (batch/s times the batch size, the issue's unit)."""
    for name, describe in result["workload"].items():
        by_side: dict[tuple[str, str], list[float]] = {}
        for rec in result["rounds"]:
            if rec["workload"] == name:
                by_side.setdefault((rec["comparison"], rec["loader"]), []).append(rec["batches_per_s"])
        for label in dict.fromkeys(comp for comp, _ in by_side):
            rates = [f"{loader} {_runner.fmt(statistics.median(v) * describe['batch_size'])}"
                     for (comp, loader), v in by_side.items() if comp == label]  # fmt: skip
            print(f"{name} {label}  images/s (median)  " + "  ".join(rates))


def main(argv=None) -> dict:
    """Run the jpeg benchmark from the command line."""

    def extra(p):
        text = "distinct JPEG files (~57 KB each)"
        p.add_argument("--files", type=int, default=workloads.JPEG_FILES, help=text)

    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK, extra)
    why = extras.missing_for("jpeg")
    if why:
        sys.exit(f"the jpeg workload {why}")
    if 0 in args.num_workers:
        sys.exit("benchmarks/jpeg.py compares workers: --num-workers must be >= 1")
    # torch's own DataLoader (the harness check) has no thread workers and is not fastfeed: two sides only.
    candidate, _ = _runner.resolve_candidate(args.candidate)
    threads = candidate is not TorchDataLoader
    why_no_dali = dali_missing() if threads else "the candidate is torch's DataLoader"
    if not threads:
        print("# the candidate is torch's DataLoader, without worker_type: no thread side")
    if why_no_dali:
        print(f"# no DALI side: {why_no_dali}")
    counts = args.warmup, args.batches, args.mem_batches
    comps = comparisons(args.num_workers, *counts, threads=threads, files=args.files, dali=not why_no_dali)
    if not why_no_dali:
        for comp in comps:
            check_dali_output(comp.workload, comp.candidate_kwargs["num_workers"])
    result = _runner.run_script("jpeg", comps, args, PRINTED)
    print_images_per_s(result)
    return result


if __name__ == "__main__":
    main()
