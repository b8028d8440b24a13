"""``fastfeed bench``: fastfeed against torch's DataLoader on the standard workloads or your own dataset.

fastfeed bench [WORKLOAD ... | module:attr] [--loaders torch,fastfeed,fastfeed-thread,dali]
               [--num-workers 0,2,4|auto] [--rounds N] [--quick] [--step S] [--out DIR] [--plot] [--json] [--markdown]
fastfeed bench --from REPORT.json [--markdown] [--plot] [WORKLOAD ...]    tables or plots of a saved report
fastfeed bench --compare OLD.json NEW.json [--threshold 0.1]             exit 1 when a figure regressed
fastfeed bench gpu [--out DIR]                                           the GPU checks (needs CUDA; exit 2 without)
fastfeed bench shards --scale [--out DIR]                                an epoch's order at 100M and 1B samples
fastfeed bench memory [--quick] [--rounds N] [--out DIR]                 workers' USS and PSS, with fastfeed.share

Workloads: transport (bytes to the consumer), overhead (a batch's own cost), jpeg (decode; fastfeed's
processes, threads and DALI), text (tokenising in Python), startup (time to the first batch), files (storage
behind latency: read-ahead and cache), shards (tar shards: fastfeed.io.Shards against webdataset and Mosaic's
streaming, over HTTP and local disk), tune (the tuner against an exhaustive grid), ray (Ray actors as workers on
a local cluster it starts: their overhead, scaling and local plus remote; needs ray). Without a workload, all of
them. memory (workers' USS and PSS for 1M dicts of metadata, with and without fastfeed.share, and 2 ranks
under torchrun) runs only when named: it takes minutes and gigabytes. Loaders run interleaved in rounds, after
warm-up; every figure is a ratio to torch in the same run (median, min-max over rounds). The report (JSON), its CSV and PNG plots go to --out (default bench-results).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from . import report, runner, standard

LOADERS = ("torch", "fastfeed", "fastfeed-thread", "dali")
VARIANT_TAGS = {"fastfeed-thread": "thread", "dali": "dali"}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="fastfeed against torch's DataLoader: standard workloads or your dataset",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("targets", nargs="*", metavar="WORKLOAD", help=f"{', '.join(standard.STANDARD)}, gpu, or "
                   "module:attr (a Dataset, a DataLoader, or a callable returning one)")  # fmt: skip
    p.add_argument("--loaders", help="comma-separated, from " + ", ".join(LOADERS) + " (default: all; torch and "
                   "fastfeed always run: the figures are their ratio; DALI only where it applies, when installed)")
    p.add_argument("--num-workers", help="comma-separated worker counts, or auto (your dataset only)")
    p.add_argument("--rounds", type=int, help="rounds of interleaved trials")
    p.add_argument("--quick", action="store_true", help="few rounds and batches: every standard workload in minutes")
    p.add_argument("--scale", action="store_true", help="shards only: the memory and time of an epoch's order at "
                   "100M and 1B samples (synthetic indexes), instead of the loaders")  # fmt: skip
    p.add_argument("--step", type=float, default=0.0, help="seconds of synthetic training step after each batch; "
                   "the stall fraction is then reported")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32, help="your dataset's batch size, when not a DataLoader's")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where the report, CSV and PNGs go")
    p.add_argument("--plot", action="store_true", help="require the PNG plots (needs the [plot] extra)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--markdown", action="store_true", help="print README-ready tables")
    p.add_argument("--from", dest="source", type=Path, metavar="REPORT", help="a saved report instead of a run")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"), help="figure by figure, NEW over OLD")
    p.add_argument("--threshold", type=float, default=0.1, help="--compare: the change that counts as a "
                   "regression (default 0.1: 10%% less throughput, or 10%% more CPU, memory or start-up time)")
    p.set_defaults(run=main)


def _fail(message: str) -> int:
    print(f"fastfeed bench: {message}", file=sys.stderr)
    return 2


def main(args) -> int:
    if args.compare:
        return _compare(args)
    if args.source is not None:
        try:
            rep = report.load(args.source)
            return _outputs(rep, args, args.targets or None, saved=False)
        except (OSError, ValueError) as e:
            return _fail(str(e))
    if args.targets == ["gpu"]:
        from .suites import gpu

        return gpu.main(["--out", str(args.out)])
    try:
        loaders = _loaders(args.loaders) if args.loaders else list(LOADERS)
        counts = _counts(args.num_workers)
    except ValueError as e:
        return _fail(str(e))
    if args.rounds is not None and args.rounds < 1:
        return _fail(f"--rounds must be 1 or more, got {args.rounds}")
    targets = args.targets or list(standard.STANDARD)
    if args.scale and targets != ["shards"]:
        return _fail("--scale measures the shards workload's order alone: fastfeed bench shards --scale")
    results = {}
    runner.use_session(runner.Session(progress=True, variants={VARIANT_TAGS[n] for n in loaders if n in VARIANT_TAGS},
                                      step_s=args.step))  # fmt: skip
    try:
        for target in targets:
            if (why := standard.missing_extra(target)) is not None:  # the other workloads and the report go on
                print(f"# {target}: skipped, it {why}")
                continue
            try:
                results[_name(target, results)] = _run(target, args, loaders, counts)
            except (ValueError, ImportError, AttributeError) as e:
                return _fail(f"{target}: {e}")
    finally:
        runner.use_session(runner.Session())
    rep = report.assemble(results, "fastfeed bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                                                  else sys.argv[1:]))  # fmt: skip
    return _outputs(rep, args, None, saved=True)


def _name(target: str, results: dict) -> str:
    name = target.rpartition(":")[2]
    return name if name not in results else f"{name}-{len(results)}"


def _loaders(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LOADERS]
    if bad:
        raise ValueError(f"--loaders: unknown {bad}; choose from {', '.join(LOADERS)}")
    return names


def _counts(text: str | None) -> list | None:
    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "auto":
            out.append("auto")
        elif part.isdigit():
            out.append(int(part))
        else:
            raise ValueError(f"--num-workers: {part!r} is neither a count (0, 2, 4) nor auto")
    return out


def _run(target: str, args, loaders: list[str], counts) -> dict:
    if target == "shards" and args.scale:
        from .suites import shards_scale

        return {"kind": "shards_scale", "result": shards_scale.main(["--quick"] if args.quick else [])}
    if target == "memory":  # named only: it builds 1M-item datasets in many processes, for minutes
        from .suites import memory

        argv = (["--quick"] if args.quick else []) + (["--rounds", str(args.rounds)] if args.rounds else [])
        return {"kind": "memory", "result": memory.main(argv)}
    if target in standard.STANDARD:
        if args.loaders and "dali" in loaders and target != "jpeg":
            print(f"# {target}: no DALI side (DALI decodes images: fastfeed bench jpeg has one)")
        return standard.run(target, quick=args.quick, rounds=args.rounds, num_workers=counts, out=args.out / "parts")
    if target == "gpu":
        raise ValueError("gpu runs alone: fastfeed bench gpu")
    from . import user

    if args.loaders and "dali" in loaders:
        print(f"# {target}: no DALI side (a DALI pipeline does not run a torch Dataset; fastfeed bench jpeg has one)")
    preset = dict(user.DEFAULTS, **(user.QUICK if args.quick else {}))
    if args.rounds is not None:
        preset["rounds"] = args.rounds
    comps = user.comparisons(target, num_workers=counts, batch_size=args.batch_size,
                             threads="fastfeed-thread" in loaders, step_s=args.step, counts=preset)  # fmt: skip
    ns = argparse.Namespace(rounds=preset["rounds"], quick=args.quick, mp_context=None, candidate=None,
                            out=args.out / "parts")  # fmt: skip
    return {"kind": "comparison", "result": runner.run_script(comps[0].workload.name, comps, ns,
                                                              ("throughput", "tree_cpu_s", "peak_footprint", "ttfb"))}


def _outputs(rep: dict, args, names, saved: bool) -> int:
    if saved:
        paths = report.save(rep, args.out)
        print("# report: " + ", ".join(str(p) for p in paths))
    if args.plot or saved:
        try:
            from . import plot

            for path in plot.save(rep, args.out):
                print(f"# plot: {path}")
        except ImportError as e:
            if args.plot:
                return _fail(str(e))
            print(f"# no plots: {e}")
    if args.json:
        print(json.dumps(rep, indent=1, default=str))
    if args.markdown:
        print(report.markdown(rep, names))
    return 0


def _compare(args) -> int:
    try:
        old, new = report.load(args.compare[0]), report.load(args.compare[1])
    except (OSError, ValueError) as e:
        return _fail(str(e))
    lines, regressions = report.compare(old, new, args.threshold)
    print(f"# {args.compare[1]} over {args.compare[0]}: each figure's ratio to torch, new / old")
    report.print_lines(lines)
    if regressions:
        print(f"# {len(regressions)} figure(s) regressed by more than {args.threshold:.0%}", file=sys.stderr)
        return 1
    print(f"# no figure regressed by more than {args.threshold:.0%}")
    return 0
