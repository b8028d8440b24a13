"""GPUDirect Storage (reader="gds", kvikio): the stall of a step fed from a file that is not in the page cache."""

from __future__ import annotations

import contextlib
import os
import tempfile

from .harness import stage_copier
from .report import Check, Skip
from .sizes import Sizes


def _uncached(path: str) -> None:
    """Drop ``path`` from the page cache: written pages must reach the disk first, or they stay cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _gds_counts(it) -> dict:
    """The GDS iterator's own account of its reads (kvikio's mode and threads, aligned, widened and POSIX reads)."""
    stats = getattr(it, "gds_stats", None)
    return stats() if callable(stats) else {}


def _kvikio_compat() -> str:
    import kvikio

    defaults = getattr(kvikio, "defaults", None)
    for name in ("compat_mode", "is_compat_mode_preferred", "get"):
        fn = getattr(defaults, name, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                return str(fn("compat_mode") if name == "get" else fn())
    return "unknown (this kvikio has no compat-mode query)"


def check_gds(cuda, c: Check, z: Sizes) -> None:
    """reader="gds": the share of a 20 ms step spent waiting for reads, kvikio's mode, aligned and widened reads."""
    import numpy as np

    from fastfeed import DataLoader
    from fastfeed.io import ArrayFiles, gds

    ok, why = gds.available()
    reader = "gds"
    if cuda.dry_run:
        reader = "posix"  # the dry run's stand-in: the same file, loop and figures without kvikio
        c.line("GDS (dry run)", f"reader='posix' stands in for 'gds' (kvikio here: {why})")
    elif not ok:
        raise Skip(f"GPUDirect Storage cannot run here: {why}")
    floats = z.gds_record_floats
    with tempfile.TemporaryDirectory(dir=os.environ.get("FASTFEED_GDS_DIR")) as tmp:
        path = os.path.join(tmp, "records.bin")
        np.random.default_rng(0).random((z.gds_records, floats), dtype=np.float32).tofile(path)
        rows = {}
        for name in ([reader] if cuda.dry_run else [reader, "posix"]):
            _uncached(path)
            loader = DataLoader(ArrayFiles(path, np.float32, (floats,)), batch_size=16, device=cuda.loader_device(),
                                reader=name, num_workers=0 if name == "gds" else min(4, z.workers))  # fmt: skip
            with stage_copier(cuda):
                it = iter(loader)
                for batch in it:
                    cuda.sleep(z.gds_step_ms)
                    batch.sum()
                    cuda.synchronize()  # the step ends on the host, as a loss.item() would end it
                counts = _gds_counts(it)
            del it, batch
            rows[name] = (loader.stats().stall_fraction, counts)
    stall, counts = rows[reader]
    c.figure("stall_fraction", stall)
    c.figure("aligned_reads", counts.get("aligned"))
    c.figure("widened_reads", counts.get("widened"))
    mode = counts.get("compat_mode", _kvikio_compat()) if reader == "gds" else "n/a (posix)"
    c.figure("kvikio_compat_mode", mode)
    c.figure("kvikio_threads", counts.get("threads"))
    c.line(f"reader={reader!r}, {z.gds_step_ms:.0f} ms step", f"stall {stall:.1%}; kvikio compat mode: {mode}, "
           f"threads {counts.get('threads', 'n/a')}; reads aligned {counts.get('aligned', 'n/a')}, widened "
           f"{counts.get('widened', 'n/a')}, POSIX {counts.get('posix', 'n/a')}")  # fmt: skip
    if reader == "gds" and "KVIKIO_NTHREADS" not in os.environ and (os.cpu_count() or 1) > 1:
        threads = counts.get("threads")
        c.line("kvikio threads", c.verdict("kvikio_threads", threads not in (None, 1),
                                           f"{threads} (from the rank's CPUs), bar > 1"))
    if "posix" in rows and reader != "posix":
        c.figure("posix_stall_fraction", rows["posix"][0])
        c.line("reader='posix', same step", f"stall {rows['posix'][0]:.1%} ({min(4, z.workers)} workers, the ring, "
               "H2D)")
