"""The doctor: what its recording costs a training loop, and how long a full diagnosis takes.

1. Overhead (bar: the watched loop runs at >= 0.98x the unwatched one). The same training loop over a
   fastfeed.DataLoader, with and without ``fastfeed.doctor.watch()`` (records, 10 Hz NVML and /proc sampling),
   interleaved in rounds, in one process. Two loops:
     step     a CPU step (matmuls, ~1 ms) fed by 2 workers: the main thread is busy, so a sampler thread
              competing for the GIL would show (4x --batches per run);
     input    the doctor's demo scenario (1 worker decoding, an 8 ms step the host sleeps through): input-bound.
2. Speed (bar: < 180 s): ``fastfeed doctor --demo`` end to end, what-ifs included, as a user runs it.

Run: .venv/bin/python benchmarks/doctor.py [--rounds 5] [--batches 300] [--quick]

Measured (2026-11-30, 2-core VM, torch 2.13 CPU, `.venv/bin/python benchmarks/doctor.py --rounds 7`; bars met):
  | overhead, step loop: watched/unwatched rate | 0.998x (0.897-1.082) | >= 0.98x ok |
  | overhead, input loop: watched/unwatched rate | 1.000x (0.983-1.010) | >= 0.98x ok |
  | fastfeed doctor --demo, end to end | 18 s | < 180 s ok |
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import fastfeed  # noqa: E402
from fastfeed import doctor  # noqa: E402
from fastfeed.doctor.demo import Decoded  # noqa: E402

OVERHEAD_BAR, SPEED_BAR_S = 0.98, 180.0


def _matmul_step(batch, w):
    x = batch[0].flatten(1)[:, :512]
    for _ in range(8):
        x = torch.tanh(x @ w)
    return x


def _sleep_step(batch, _w):
    time.sleep(0.008)


LOOPS = {  # options, step, batches per run relative to --batches (each run lasts a few seconds)
    "step": (dict(sample_ms=0.05, workers=2), _matmul_step, 4),
    "input": (dict(sample_ms=1.0, workers=1), _sleep_step, 1),
}


def run_loop(name: str, batches: int, watched: bool) -> float:
    """Batches/s of ``batches`` training steps (epochs of 64 batches, torch's defaults otherwise)."""
    opts, step, _ = LOOPS[name]
    loader = fastfeed.DataLoader(Decoded(64 * 16, opts["sample_ms"], 0.0), batch_size=16, shuffle=True,
                                 num_workers=opts["workers"])  # fmt: skip
    w = torch.randn(512, 512) / 23
    done = 0
    t0 = time.perf_counter()
    ctx = doctor.watch() if watched else None
    if ctx is not None:
        ctx.__enter__()
    try:
        while done < batches:
            for batch in loader:
                step(batch, w)
                done += 1
                if done >= batches:
                    break
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return done / (time.perf_counter() - t0)


def overhead(rounds: int, batches: int) -> dict:
    out = {}
    torch.set_num_threads(1)
    for name, (_, _, scale) in LOOPS.items():
        n = batches * scale
        run_loop(name, n // 4, False)  # warm-up: page cache, imports, the ring
        ratios = []
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            rate = {watched: run_loop(name, n, watched) for watched in order}
            ratios.append(rate[True] / rate[False])
            print(f"  {name} round {r + 1}: watched/unwatched {ratios[-1]:.3f}", flush=True)
        med = statistics.median(ratios)
        out[name] = {"median": med, "min": min(ratios), "max": max(ratios), "meets_bar": med >= OVERHEAD_BAR}
    return out


def speed() -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "doctor", "--json", "--demo"], capture_output=True,
                          text=True, cwd=REPO)  # fmt: skip
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"fastfeed doctor --demo failed:\n{proc.stderr}")
    report = json.loads(proc.stdout[proc.stdout.index('{\n  "schema"'):])
    closing = report["whatif"].get("closing") or {}
    return {"seconds": elapsed, "meets_bar": elapsed < SPEED_BAR_S, "verdict": report["verdict"]["line"],
            "closing": closing.get("change"), "predicted_gain": closing.get("predicted_gain"),
            "measured_gain": closing.get("gain")}  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="2 rounds of 100 batches")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.batches = 2, 100
    print("overhead: the same loop with and without fastfeed.doctor.watch()", flush=True)
    result = {"overhead": overhead(args.rounds, args.batches)}
    print("speed: fastfeed doctor --demo, what-ifs included", flush=True)
    result["speed"] = speed()
    print("\n| figure | measured | bar |\n|---|---|---|")
    for name, o in result["overhead"].items():
        print(f"| overhead, {name} loop: watched/unwatched rate | {o['median']:.3f}x ({o['min']:.3f}-{o['max']:.3f}) "
              f"| >= {OVERHEAD_BAR}x {'ok' if o['meets_bar'] else 'MISSED'} |")
    s = result["speed"]
    print(f"| fastfeed doctor --demo, end to end | {s['seconds']:.0f} s | < {SPEED_BAR_S:.0f} s "
          f"{'ok' if s['meets_bar'] else 'MISSED'} |")
    if s["closing"] is None:  # the verdict advised no setting to force (on a saturated machine: cheaper samples)
        print(f"\n{s['verdict']}\nclosing the loop: no setting advised, nothing to re-run")
    else:
        print(f"\n{s['verdict']}\nclosing the loop: {s['closing']}: predicted {s['predicted_gain']:.2f}x, "
              f"measured {s['measured_gain']:.2f}x")
    return result


if __name__ == "__main__":
    main()
