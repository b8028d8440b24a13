"""Storage: many small files behind latency, the same files on local disk, and token windows from raw files.

  (a) http      2,000 files of ~100 KB served over HTTP on 127.0.0.1 with 5 ms +- 5 ms per request (a real
                server, fastfeed/bench/http.py; fsspec's HTTP client on both sides), batch 32, nw=2, torch's defaults
                (persistent_workers=False). torch runs a plain Dataset that reads each URL with fsspec;
                fastfeed runs fastfeed.io.Files with read-ahead, then Files with a cache whose epoch 2 is timed
                (epoch 1 fills it, untimed).
  (b) local     the same files on local disk, each file's pages dropped from the page cache before each epoch
                (posix_fadvise DONTNEED, which needs no privilege), same loaders.
  (c) tokens    fastfeed.io.ArrayFiles token windows (2049 uint16 tokens, from 3 raw .bin files of 16M tokens, windows
                crossing their boundaries) against the np.memmap Dataset a torch user writes, batch 32, nw=2,
                --token-batches random windows per epoch, page cache warm (a token corpus that fits in RAM).
Every epoch's samples are compared with torch's: nothing lost or reordered (shuffle with the same seed).
Figures: files/s and MB/s, medians over interleaved rounds, and fastfeed/torch ratios from the same round.

Run: .venv/bin/python benchmarks/io.py [--rounds 3] [--files 2000] [--quick] [--workloads http local]

Measured (2026-11-30, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/io.py`):
  | workload | torch files/s | fastfeed read-ahead | fastfeed cached, epoch 2 |
  | (http) | 253 (25 MB/s) | 1950 (195 MB/s) = 7.8x (7.5-7.9) | 5405 (541 MB/s) = 21.1x (20.0-25.6) |
  | (local) | 4623 (463 MB/s) | 6853 (686 MB/s) = 1.9x (1.5-2.7) | 7235 (725 MB/s) = 1.6x (1.5-2.8) |
  (tokens) ArrayFiles 18369 windows/s, np.memmap under torch 12985 windows/s: 1.55x (1.32-1.73)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset


import fastfeed  # noqa: E402
from .. import extras
from ..http import FileServer, make_files
from ..trial import drop_page_cache
from fastfeed.io import ArrayFiles, Files  # noqa: E402

BATCH, WORKERS = 32, 2


def _size(data: bytes) -> torch.Tensor:
    return torch.tensor(len(data))


class FsspecFiles(Dataset):
    """What a torch user writes for files behind a URL (or a path): read each one whole, then decode it."""

    def __init__(self, sources):
        self.sources = sources
        self._fs, self._pid = None, None

    def __len__(self):
        return len(self.sources)

    def __getitem__(self, i):
        source = self.sources[i]
        if "://" not in source:
            with open(source, "rb") as f:
                return _size(f.read())
        if self._pid != os.getpid():
            import fsspec

            self._fs, self._pid = fsspec.filesystem("http", skip_instance_cache=True), os.getpid()
        return _size(self._fs.cat_file(source))


def _serve(root, latency: float, jitter: float, conn) -> None:
    with FileServer(root, latency=latency, jitter=jitter) as server:
        conn.send(server.url)
        conn.recv()  # serve until told to stop


@contextlib.contextmanager
def served(root, latency: float, jitter: float):
    """The file server in a process of its own, so that its threads never compete for the loaders' GIL."""
    ours, theirs = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_serve, args=(root, latency, jitter, theirs))
    proc.start()
    try:
        yield ours.recv()
    finally:
        ours.send("stop")
        proc.join(10)


class MemmapTokens(Dataset):
    """What a torch user writes for token files: one np.memmap over their concatenation, sliced per window."""

    def __init__(self, paths, window: int):
        self.paths, self.window = paths, window
        self._maps = None

    def _open(self):
        if self._maps is None:
            self._maps = [np.memmap(p, dtype=np.uint16, mode="r") for p in self.paths]
            self._starts = np.cumsum([0] + [len(m) for m in self._maps])
        return self._maps

    def __len__(self):
        self._open()
        return int(self._starts[-1]) - self.window + 1

    def __getitem__(self, i):
        maps, parts, want = self._open(), [], self.window
        f = int(np.searchsorted(self._starts, i, side="right")) - 1
        offset = i - int(self._starts[f])
        while want:
            part = maps[f][offset:offset + want]
            parts.append(part)
            want -= len(part)
            f, offset = f + 1, 0
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))


class Tokens(Dataset):
    """ArrayFiles' windows as the same int64 tensors (the cast is the model's input dtype, in both)."""

    def __init__(self, arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays)

    def __getitem__(self, i):
        return self.arrays[i].to(torch.int64)


def tokens(tmp: Path, rounds: int, batches: int) -> dict:
    rng = np.random.default_rng(0)
    paths = []
    for k in range(3):
        p = tmp / f"tokens{k}.bin"
        rng.integers(0, 50_000, 16_000_000, dtype=np.uint16).tofile(p)
        paths.append(str(p))
    window = 2049
    base = {"torch": MemmapTokens(paths, window), "fastfeed": Tokens(ArrayFiles(paths, np.uint16, (), window=window))}
    n = batches * BATCH
    figures: dict[str, list] = {"torch": [], "fastfeed": []}
    for r in range(rounds):
        order = ["torch", "fastfeed"] if r % 2 == 0 else ["fastfeed", "torch"]
        sums = {}
        for label in order:
            cls = TorchLoader if label == "torch" else fastfeed.DataLoader
            # Random windows (a permutation of 48M windows would cost seconds of its own): the same for both.
            sampler = torch.randint(0, len(base[label]), (n,), generator=torch.Generator().manual_seed(r)).tolist()
            loader = cls(base[label], batch_size=BATCH, sampler=sampler, num_workers=WORKERS)
            t0 = time.perf_counter()
            sums[label] = [int(b.sum()) for b in loader]
            figures[label].append(time.perf_counter() - t0)
            print(f"  tokens round {r + 1}: {label:9} {n / figures[label][-1]:8.0f} windows/s", flush=True)
        if sums["torch"] != sums["fastfeed"]:
            raise SystemExit("tokens: ArrayFiles windows differ from the memmap's")
    t, f = statistics.median(figures["torch"]), statistics.median(figures["fastfeed"])
    ratios = [a / b for a, b in zip(figures["torch"], figures["fastfeed"])]
    return {"torch": n / t, "fastfeed": n / f, "ratio": statistics.median(ratios), "min": min(ratios),
            "max": max(ratios), "mb_per_s": n * window * 2 / f / 1e6}  # fmt: skip


def epoch(loader_cls, dataset, seed: int) -> tuple[float, list[int]]:
    """Seconds for one shuffled epoch (new workers, as torch's defaults), and the samples' sizes in order."""
    torch.manual_seed(seed)
    loader = loader_cls(dataset, batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    t0 = time.perf_counter()
    sizes = [s for batch in loader for s in batch.tolist()]
    return time.perf_counter() - t0, sizes


def run(name: str, sources: list[str], rounds: int, cache_root: Path, before_epoch=lambda: None) -> dict:
    nbytes = None
    figures: dict[str, list] = {"torch": [], "readahead": [], "cached": []}
    for r in range(rounds):
        seed = 100 + r
        cache_dir = cache_root / f"{name}-{r}"
        runs = {
            "torch": (TorchLoader, FsspecFiles(sources)),
            "readahead": (fastfeed.DataLoader, Files(sources, decode=_size)),
            "cached": (fastfeed.DataLoader, Files(sources, decode=_size, cache_dir=cache_dir)),
        }
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        expected = None
        for label in order:
            cls, ds = runs[label]
            if label == "cached":
                before_epoch()
                epoch(cls, ds, seed)  # epoch 1 fills the cache, untimed
            before_epoch()
            seconds, sizes = epoch(cls, ds, seed)
            if expected is None:
                expected = sizes
            elif sizes != expected:
                raise SystemExit(f"{name}: {label} yielded other samples, or in another order, than torch")
            nbytes = sum(sizes)
            figures[label].append(seconds)
            print(f"  {name} round {r + 1}: {label:9} {len(sources) / seconds:8.0f} files/s", flush=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
    out = {}
    for label, seconds in figures.items():
        med = statistics.median(seconds)
        out[label] = {"files_per_s": len(sources) / med, "mb_per_s": nbytes / med / 1e6}
        if label != "torch":
            ratios = [t / s for t, s in zip(figures["torch"], seconds)]
            out[label].update(ratio=statistics.median(ratios), min=min(ratios), max=max(ratios))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--jitter-ms", type=float, default=5.0)
    p.add_argument("--token-batches", type=int, default=300)
    p.add_argument("--workloads", nargs="+", default=["http", "local", "tokens"], choices=["http", "local", "tokens"])
    p.add_argument("--quick", action="store_true", help="1 round of 400 files, 60 token batches")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.files, args.token_batches = 1, 400, 60
    why = extras.missing(extras.HTTP) if "http" in args.workloads else None
    if why:  # the other parts need nothing beyond the base install
        print(f"# files http: skipped, it {why}", flush=True)
        args.workloads = [w for w in args.workloads if w != "http"]
    result = {}
    with tempfile.TemporaryDirectory(prefix="fastfeed-io-") as tmp:
        root = Path(tmp) / "files"
        rel = make_files(root, args.files, args.size)
        cache_root = Path(tmp) / "cache"
        if "http" in args.workloads:
            with served(root, args.latency_ms / 1e3, args.jitter_ms / 1e3) as url:
                urls = [f"{url}/{r}" for r in rel]
                print(f"(a) http: {args.files} files behind {args.latency_ms} +- {args.jitter_ms} ms", flush=True)
                result["http"] = run("http", urls, args.rounds, cache_root)
        if "local" in args.workloads:
            paths = [str(root / r) for r in rel]
            print(f"(b) local: {args.files} files, page cache dropped before each epoch", flush=True)
            result["local"] = run("local", paths, args.rounds, cache_root, lambda: drop_page_cache(paths))
        if "tokens" in args.workloads:
            print(f"(c) tokens: {args.token_batches} batches of {BATCH} windows of 2049 tokens", flush=True)
            result["tokens"] = tokens(Path(tmp), args.rounds, args.token_batches)
    print(f"\n| workload | torch files/s | fastfeed read-ahead | fastfeed cached, epoch 2 |\n|---|---|---|---|")
    for name, figs in result.items():
        if name == "tokens":
            continue
        t, ra, ca = figs["torch"], figs["readahead"], figs["cached"]
        print(f"| ({name}) | {t['files_per_s']:.0f} ({t['mb_per_s']:.0f} MB/s) | {ra['files_per_s']:.0f} "
              f"({ra['mb_per_s']:.0f} MB/s) = {ra['ratio']:.1f}x ({ra['min']:.1f}-{ra['max']:.1f})"
              " | "
              f"{ca['files_per_s']:.0f} ({ca['mb_per_s']:.0f} MB/s) = {ca['ratio']:.1f}x "
              f"({ca['min']:.1f}-{ca['max']:.1f}) |")
    if "tokens" in result:
        tk = result["tokens"]
        print(f"\n(tokens) ArrayFiles {tk['fastfeed']:.0f} windows/s ({tk['mb_per_s']:.0f} MB/s), "
              f"np.memmap under torch {tk['torch']:.0f} windows/s: {tk['ratio']:.2f}x ({tk['min']:.2f}-{tk['max']:.2f})")
    return result


if __name__ == "__main__":
    main()
