"""fastfeed's demo: the transport and overhead questions, as a short table of fastfeed/torch ratios, then
``fastfeed run`` on a script written for torch alone (benchmarks/plain_torch.py, run as it is and under
``python -m fastfeed run``), then the doctor's verdict on its built-in scenario (``fastfeed doctor --demo``: a loop
starved by too few workers).

Runs benchmarks/transport.py and benchmarks/overhead.py with their default settings (about a
minute and a half on 2 cores against torch; less as fastfeed is faster), then prints one row
per comparison. Throughput: higher is better; main-process CPU, peak PSS, time to first
batch: lower is better. The full figures go to bench-results/demo-<timestamp>.json and .csv, fastfeed run's to
bench-results/fastfeed-run.json, the doctor's report (text, JSON, HTML page, PNG timeline, Perfetto trace) to
bench-results/doctor-demo/.

Run: .venv/bin/python benchmarks/demo.py [--quick] [--rounds N] [--epoch-batches 0 60] [--out DIR]

Transport runs in steady state (one long iterator) unless --epoch-batches says otherwise
(benchmarks/transport.py's own default is epochs of 60 and 300, which the README's table shows). Under the table,
each transport row says what it compared and why its figure differs from the README's row of that name.

Measured (paste the table of a full run here):
  See docs/benchmarks/standard.md's tables: the demo runs the transport and overhead questions in fewer rounds.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from fastfeed import config
from fastfeed.bench import runner as _runner
from fastfeed.bench.suites import overhead, transport

# Transport in steady state, as the README's table: --epoch-batches 60 runs its epochs instead.
DEFAULTS = dict(rounds=5, epoch_batches=[0])
QUICK = dict(rounds=2)
COLUMNS = (("main_cpu_s", "main CPU"), ("peak_pss", "peak PSS"), ("peak_footprint", "footprint"), ("ttfb", "1st batch"))


def _ratio(stat: dict) -> str:
    return "n/a" if stat["median"] is None else f"{stat['median']:.2f}x"


def table(summary: dict, names: tuple[str, str]) -> str:
    """Render the demo's table from a run's summary.

    Args:
        summary: ``run_script``'s summary: ``"<workload> <label>"`` -> figure -> stats.
        names: Candidate and baseline names.

    Returns:
        The table: a title, a header, one row per comparison.
    """
    cand, base = names
    # The label column is as wide as the longest label and two spaces: a label as long as a fixed width ran into
    # the ratio beside it ("transport nw=2 vs torch nw=018.39x").
    width = max([len(key) for key in summary] + [26]) + 2
    rows = [f"{cand}/{base} ratios, median over rounds; throughput (min-max) and absolute medians",
            f"{'':{width}}{'throughput':>20}" + "".join(f"{title:>11}" for _, title in COLUMNS)
            + f"{cand:>17}{base:>17}"]
    for key, figs in summary.items():
        tput = figs["throughput"]
        spread = "" if tput["min"] is None else f" ({tput['min']:.2f}-{tput['max']:.2f})"
        rows.append(f"{key:{width}}{_ratio(tput) + spread:>20}"
                    + "".join(f"{_ratio(figs[f]):>11}" for f, _ in COLUMNS)
                    + f"{_runner.fmt(tput['candidate']):>9} {tput['unit']:<7}"
                    + f"{_runner.fmt(tput['baseline']):>9} {tput['unit']:<7}")
    return "\n".join(row.rstrip() for row in rows)


def readme_notes(keys, opts: dict, rounds: int) -> list[str]:
    """What each transport row of the demo compares, and why its figure differs from the README's row of that
    name: the README's transport table is ``fastfeed bench``'s, run with transport's own defaults
    (``transport.DEFAULTS``: whole epochs of 60 and 300 batches), the demo's is run with ``opts``.

    Args:
        keys: The table's row keys (``"<workload> <label>"``); only transport's are in the README.
        opts: The transport comparisons' settings: warmup, batches, epoch_batches.
        rounds: Rounds of the demo's run.

    Returns:
        A heading and a line per transport row; none when the table has no transport row.
    """
    readme = transport.DEFAULTS
    ref = (f"fastfeed bench, {readme['batches']} batches a trial, {readme['rounds']} rounds, whole epochs with "
           "persistent_workers=False")
    lines = []
    for key in keys:
        if not key.startswith("transport "):
            continue
        label = key.removeprefix("transport ")
        workers, _, against = label.partition(" vs ")
        workers = workers.split(" epochs of ")[0]
        epochs = label.rsplit("epochs of ", 1)[1] if "epochs of " in label else None
        mode = f"whole epochs of {epochs} batches" if epochs else "steady state (one iterator, workers started once)"
        what = (f"fastfeed at {workers} against torch " + ("loading in the main process (nw=0)" if against else
                                                            f"at {workers}")
                + f", {mode}, {opts['batches']} batches timed after {opts['warmup']} untimed, {rounds} rounds")
        names = " and ".join(f'"{label.split(" epochs of ")[0]} epochs of {n}"' for n in readme["epoch_batches"])
        if epochs is None:
            start = ("which torch at nw=0 never pays, so there fastfeed's figure is lower" if against else
                     "which both loaders pay")
            why = f"The README's {names} ({ref}) count each epoch's worker start, {start}; here the workers start once"
        else:
            why = f"The README's row of this name ({ref}) measures the same, on its own machine and load"
        if opts["batches"] < readme["batches"]:
            why += (f"; with {opts['batches']} timed batches, those the workers made during the warm-up weigh more: "
                    "a higher, wider ratio")
        lines.append(f"  {key}: {what}. {why}.")
    return ["Transport rows against the README's transport table:", *lines] if lines else []


def run_example(rounds: int) -> dict:
    """benchmarks/plain_torch.py as it is and under ``fastfeed run``, in alternating rounds: the median seconds of
    each, their ratio, ``fastfeed run``'s summary line, and what either left behind once it exited (processes still
    running the script, such as orphaned workers; shared-memory segments named for its pid)."""
    script = str(Path(__file__).with_name("plain_torch.py"))
    seconds: dict[str, list[float]] = {"python": [], "fastfeed run": []}
    summary, left = "", {"processes": 0, "segments": 0}
    for _ in range(rounds):
        for how, prefix in (("python", []), ("fastfeed run", ["-m", "fastfeed", "run"])):
            proc = subprocess.Popen([sys.executable, *prefix, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)  # fmt: skip
            out, err = proc.communicate(timeout=300)
            if proc.returncode:
                raise RuntimeError(f"{how} {script} exited with {proc.returncode}:\n{err}")
            seconds[how].append(json.loads(out.splitlines()[-1])["seconds"])
            summary = next((line for line in err.splitlines() if line.startswith("fastfeed run:")), summary)
            left["segments"] += len(glob.glob(os.path.join(config.shm_dir(), f"fastfeed-{proc.pid}-*")))
            left["processes"] += sum(script in _cmdline(pid) for pid in os.listdir("/proc") if pid.isdigit())
    medians = {how: statistics.median(s) for how, s in seconds.items()}
    return {"seconds": medians, "ratio": medians["python"] / medians["fastfeed run"], "summary": summary, "left": left}


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # it exited meanwhile
        return ""


def main(argv=None) -> dict:
    """Run the demo from the command line."""
    args = _runner.parse_args(__doc__, argv, DEFAULTS, QUICK)
    comps = []
    for script in (transport, overhead):
        preset = {**script.DEFAULTS, **(script.QUICK if args.quick else {})}
        # Flags given on the command line win over each script's own settings.
        opts = {k: getattr(args, k) if getattr(args, k) is not None else preset[k]
                for k in ("num_workers", "warmup", "batches", "mem_batches")}
        if script is transport:
            opts["epoch_batches"] = args.epoch_batches
        comps += script.comparisons(**opts)
        if script is transport:
            transport_opts = opts
    result = _runner.run_script("demo", comps, args, quiet=True)
    print(table(result["summary"], (result["params"]["candidate"], "torch")))
    print("\n".join(readme_notes(result["summary"], transport_opts, args.rounds)))
    print("\nfastfeed run on a script written for torch alone (benchmarks/plain_torch.py, unchanged):", flush=True)
    example = run_example(1 if args.quick else 3)
    python, ours = example["seconds"]["python"], example["seconds"]["fastfeed run"]
    print(f"  python {python:.2f} s, python -m fastfeed run {ours:.2f} s: {example['ratio']:.2f}x the speed; "
          f"left behind: {example['left']['processes']} processes, {example['left']['segments']} segments\n"
          f"  {example['summary']}")  # fmt: skip
    (Path(args.out) / "fastfeed-run.json").write_text(json.dumps(example, indent=1))
    print("\nThe doctor on its built-in scenario (fastfeed doctor --demo):", flush=True)
    out = Path(args.out) / "doctor-demo"
    doctor = [sys.executable, "-m", "fastfeed", "doctor", "--out", str(out), *(["--steps", "100"] if args.quick else []),
              "--demo"]  # fmt: skip
    subprocess.run(doctor, check=True, cwd=Path(__file__).resolve().parent.parent)
    print(f"\nThe doctor's {json.loads((out / 'report.json').read_text())['verdict']['line']} (report in {out}; "
          f"open {out / 'report.html'} in a browser)")
    return result


if __name__ == "__main__":
    main()
