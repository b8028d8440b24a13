"""The order of an epoch of tar shards at internet scale: memory and time from ``set_epoch`` to the first position.

``fastfeed.io.Shards`` decides every sample's place before reading anything: an epoch's order is a pure function of
(index, seed, epoch). This part measures what that costs each process (every worker of every rank computes it) on
synthetic indexes of --shards shards of --per-shard samples, shuffled, windows of 8 shards:
  - window  the order made window by window (``order.ORDER``): the shards permuted, each window's samples shuffled
            when the window is reached;
  - whole   fastfeed's first order (``order.LEGACY``, kept to resume positions saved by it): every sample id at once,
            as ``Shards`` made it before. Run only up to --whole-max samples: at a billion it needs 8 GB for the
            array alone, and more while it is made.
Each measurement is a fresh process (so nothing is shared or cached): the index's counts built first, then
``epoch_order(...)`` and its first position, timed (wall) and traced (tracemalloc: numpy reports its buffers there):
``peak`` is the most memory the order held at once while being made, ``kept`` what it holds after (one epoch; a
``Shards`` keeps this epoch's and the next one's). Then positions are read in order for a while: ns per position.
Medians over --rounds processes.

Run: fastfeed bench shards --scale (~1 min on 2 cores), or python -m fastfeed.bench.suites.shards_scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

WINDOW = 8
SCALES = ((100_000, 1_000), (1_000_000, 1_000))  # (shards, samples per shard): 100M and 1B samples
WHOLE_MAX = 200_000_000  # samples up to which the whole-epoch order runs (its array is 8 bytes a sample)
READ = 2_000_000  # positions read in order after the first, for the cost per position


def _one(shards: int, per_shard: int, version: int) -> dict:
    """One measurement, in this (fresh) process."""
    import time
    import tracemalloc

    import numpy as np

    from fastfeed.io.shards import order

    counts = np.full(shards, per_shard, np.int64)
    starts = np.zeros(shards + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    tracemalloc.start()
    t0 = time.perf_counter()
    epoch = order.epoch_order(counts, starts, seed=17, epoch=3, shuffle=True, window=WINDOW, version=version)
    first = epoch.sample(0)
    first_s = time.perf_counter() - t0
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    n = min(READ, epoch.n_samples)
    t0 = time.perf_counter()
    total = 0
    for p in range(n):
        total += epoch.sample(p)
    per_position = (time.perf_counter() - t0) / n
    return {"first_s": first_s, "peak_bytes": peak, "kept_bytes": kept, "ns_per_position": per_position * 1e9,
            "first": int(first), "checksum": int(total)}


def measure(shards: int, per_shard: int, version: int) -> dict:
    code = (f"import json; from fastfeed.bench.suites.shards_scale import _one; "
            f"print(json.dumps(_one({shards}, {per_shard}, {version})))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"shards --scale: the measurement of {shards} x {per_shard} (order {version}) failed:\n"
                           f"{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv=None) -> dict:
    from fastfeed.io.shards import order

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scales", nargs="+", default=[f"{s}x{n}" for s, n in SCALES], metavar="SHARDSxPER_SHARD")
    p.add_argument("--whole-max", type=int, default=WHOLE_MAX)
    p.add_argument("--quick", action="store_true", help="1 round")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    say = print
    rows = []
    for text in args.scales:
        shards, per_shard = (int(x) for x in text.lower().split("x"))
        samples = shards * per_shard
        row: dict[str, Any] = {"shards": shards, "per_shard": per_shard, "samples": samples}
        sides = [("window", order.ORDER)] + ([("whole", order.LEGACY)] if samples <= args.whole_max else [])
        runs: dict[str, list[dict]] = {name: [] for name, _ in sides}
        for r in range(rounds):
            for name, version in sides[r % len(sides):] + sides[:r % len(sides)]:  # interleaved, rotated
                runs[name].append(measure(shards, per_shard, version))
        for name, _ in sides:
            got = runs[name]
            row[name] = {k: _median(got, k) for k in ("first_s", "peak_bytes", "kept_bytes", "ns_per_position")}
            row[name]["rounds"] = got
            say(f"  shards --scale {samples / 1e6:,.0f}M samples in {shards:,} shards: {name:6} first position "
                f"{row[name]['first_s'] * 1e3:8.1f} ms, peak {row[name]['peak_bytes'] / 1e6:8.1f} MB, kept "
                f"{row[name]['kept_bytes'] / 1e6:8.1f} MB, {row[name]['ns_per_position']:5.0f} ns/position")
        if "whole" in row:
            w, old = row["window"], row["whole"]
            row["whole_over_window"] = {"first_s": old["first_s"] / w["first_s"],
                                        "peak_bytes": old["peak_bytes"] / w["peak_bytes"]}  # fmt: skip
        else:
            row["whole"] = f"not run: its array alone is {samples * 8 / 1e9:.0f} GB (8 bytes a sample)"
        rows.append(row)
    result = {"workload": "shards-scale", "window": WINDOW, "rounds": rounds, "rows": rows}
    say("")
    say(markdown(result))
    return result


def markdown(res: dict) -> str:
    lines = ["**shards --scale**: an epoch's order, per process (fresh process, shuffled, windows of "
             f"{res['window']} shards; median of {res['rounds']})", "",
             "| samples | shards | order | set_epoch to first position | peak memory | kept | per position |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in res["rows"]:
        for name in ("window", "whole"):
            figs = row[name]
            if isinstance(figs, str):
                lines.append(f"| {row['samples']:,} | {row['shards']:,} | {name} | {figs} | | | |")
                continue
            lines.append(f"| {row['samples']:,} | {row['shards']:,} | {name} | {figs['first_s'] * 1e3:,.1f} ms | "
                         f"{figs['peak_bytes'] / 1e6:,.1f} MB | {figs['kept_bytes'] / 1e6:,.1f} MB | "
                         f"{figs['ns_per_position']:,.0f} ns |")  # fmt: skip
        if "whole_over_window" in row:
            r = row["whole_over_window"]
            lines.append(f"| | | whole / window | {r['first_s']:,.0f}x | {r['peak_bytes']:,.0f}x | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
