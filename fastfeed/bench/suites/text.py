"""Text: sentences tokenized in ``__getitem__`` (plain Python, 40-200 words each), 64 per batch of
``(ids, mask)``, 128 tokens: the per-sample Python of NLP pipelines. fastfeed (processes and threads) and
torch at the same worker counts; throughput in batch/s, CPU of the main process and of the whole tree.

Run: .venv/bin/python -m fastfeed bench text [--quick] [--rounds N] [--num-workers 0,2]
"""

from __future__ import annotations

from .. import runner as _runner
from .. import workloads

DEFAULTS = dict(rounds=4, warmup=5, batches=60, mem_batches=5, num_workers=[0, 2])
QUICK = dict(rounds=2, warmup=2, batches=8, mem_batches=2)
PRINTED = ("throughput", "main_cpu_s", "tree_cpu_s", "peak_footprint", "ttfb")


def comparisons(num_workers: list[int], warmup: int, batches: int, mem_batches: int) -> list[_runner.Comparison]:
    """fastfeed's worker processes against torch's, with worker threads in the same rounds where there are workers."""
    wl = workloads.text()
    out = []
    for nw in num_workers:
        thread = {"num_workers": nw, "worker_type": "thread", "multiprocessing_context": None}
        variants = {"thread": thread} if nw else {}
        out.append(_runner.Comparison(wl, f"nw={nw}", {"num_workers": nw}, {"num_workers": nw}, warmup, batches,
                                      mem_batches, candidate_tag="process" if nw else "", variants=variants))
    return out


def main(argv=None) -> dict:
    """Run the text benchmark from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK)
    return _runner.run_script("text", comparisons(args.num_workers, args.warmup, args.batches, args.mem_batches), args,
                              PRINTED)


if __name__ == "__main__":
    main()
