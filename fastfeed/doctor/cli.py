"""``fastfeed doctor [--steps 300] [--out DIR] [--html] [--no-whatif] [--json] (SCRIPT | -m MODULE | --demo) [ARGS...]``

(``--demo`` comes last: what follows it is the scenario's own arguments.)

Runs the script (``python SCRIPT ARGS`` through ``runpy``, in this process) for ``--steps`` batches, then the
what-if runs, then prints the verdict. Works on scripts that use torch's own DataLoader as well as fastfeed's.

``--out DIR`` writes the report there: report.json, report.txt, timeline.png, trace.json (Perfetto) and
report.html, one self-contained HTML page (``--html`` without ``--out`` writes only that page, in the current
directory): the verdict, a zoomable timeline (stalls, steps, workers, CPU and GPU; a lane per rank for a job), the
six questions, the advice (predicted against measured) and the what-if runs. It loads nothing from the network:
open it offline, attach it to an issue or keep it as a CI artifact.

A job of several ranks: ``fastfeed doctor --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint H:P]
[--rdzv-id ID] SCRIPT ARGS`` launches it as torchrun does (``launch``), or ``torchrun ... -m fastfeed doctor SCRIPT
ARGS`` runs the doctor on every rank (``jobrun``); either way rank 0 reports on the whole job (``jobreport``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .. import _script
from . import jobstore, script, whatif
from .report import write_page
from .script import say

DEMO = "fastfeed.doctor.demo"
HTML_NAME = "report.html"  # --html without --out: in the current directory



# torchrun's environment, which a DDP script reads (init_process_group's env://, or os.environ[...] itself)
JOB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_JOB_ENV_MISSING = re.compile(r"environment variable (%s) expected, but not set" % "|".join(JOB_ENV))


def job_hint(error: BaseException | None) -> str | None:
    """For a script run alone that failed for want of torchrun's environment (``RANK`` unset, as torch's env://
    rendezvous says, or a ``KeyError`` on one of its variables): how to run it as a job under the doctor."""
    if error is None:
        return None
    missing = isinstance(error, KeyError) and bool(error.args) and error.args[0] in JOB_ENV
    chain = [error, error.__cause__, error.__context__]
    if not missing and not any(e is not None and _JOB_ENV_MISSING.search(str(e)) for e in chain):
        return None
    return ("the script expects torchrun's environment (RANK, WORLD_SIZE, ...): it is a job of several ranks; "
            "run it as fastfeed doctor --nproc-per-node N SCRIPT ARGS (N ranks on this machine)")


def _failed(e: BaseException) -> None:
    """The doctor's error line: ``e``'s text once prefixed, whether or not it names the command itself."""
    print(f"fastfeed doctor: {str(e).removeprefix('fastfeed doctor: ')}", file=sys.stderr)


def examine(target: str, argv: list[str], module: bool = False, steps: int = 300, whatifs: bool = True):
    """The measured run, then (``whatifs``) the ceilings and the advised setting re-measured. Returns the report."""
    say(f"measuring {target} for up to {steps} batches")
    report, watch, error = script.run(target, argv, module, steps=steps)
    primary = report.timeline.primary()
    script.show_traceback(error)
    hint = job_hint(error)
    if hint:
        say(hint)
    if primary is None or primary.batches == 0:
        watch.hooks.release()
        why = f"it ended with {error!r}" if error else "no DataLoader was iterated"
        raise script.ScriptFailed(f"the script gave the doctor no batches to measure: {why}") from error
    if error is not None:
        say(f"the script stopped early ({error!r}); diagnosing the {primary.batches} batches recorded")
    if not whatifs:
        watch.hooks.release()
        return report
    loader = watch.hooks.loaders()[primary.id]
    say("what-if: the loader alone (input ceiling)")
    report.whatif["input_ceiling"] = whatif.input_ceiling(loader, steps)
    if primary.kind == "torch":
        say("what-if: fastfeed.DataLoader with the same arguments, alone")
        twin = whatif.fastfeed_twin(loader)
        report.whatif["input_ceiling_fastfeed"] = whatif.input_ceiling(twin, steps)
        del twin
    del loader
    watch.hooks.release()
    say("what-if: the script fed one cached batch (compute ceiling)")
    skipped = report.whatif["skipped"] = {}
    report.whatif["compute_ceiling"], why = whatif.compute_ceiling(target, argv, module, steps)
    if why:
        skipped["compute_ceiling"] = why
    verdict = report.verdict()
    best = whatif.closing_choice(verdict.advice)
    if best is None:
        skipped["closing"] = whatif.no_closing(verdict.advice)
        return report
    say(f"what-if: the script again with {best['change']} (closing the loop)")
    run, why = whatif.rerun(target, argv, module, steps, best["setting"])
    if run is None:
        skipped["closing"] = f"with {best['change']}: {why}"
        return report
    report.whatif["closing"] = {**run, "change": best["change"], "setting": best["setting"],
                                "predicted_samples_per_s": best["predicted_samples_per_s"],
                                "predicted_gain": best["predicted_gain"],
                                **whatif.gains(run, verdict.evidence)}  # fmt: skip
    return report


def plain(doc: str) -> str:
    """A docstring as ``--help`` shows it: plain text, without reStructuredText's double backticks."""
    return doc.replace("``", "")


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="run a training script, measure why the GPU idles, and check the advice",
                       description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=300, help="batches to measure (default 300)")
    p.add_argument("--out", help="directory for report.json, report.txt, report.html, timeline.png, trace.json "
                   "(Perfetto)")  # fmt: skip
    p.add_argument("--html", action="store_true", help="write report.html, one self-contained page (verdict, "
                   "zoomable timeline, questions, advice, what-ifs) that opens offline, in the current directory "
                   "(--out writes it there anyway)")  # fmt: skip
    p.add_argument("--no-whatif", dest="whatif", action="store_false", help="measure only; no what-if runs")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the text")
    p.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name, as python -m")
    job = p.add_argument_group("a job of several ranks, launched through torch.distributed.run (torchrun's options)")
    job.add_argument("--nproc-per-node", type=int, help="ranks per node: launch the script as a job and report on it")
    job.add_argument("--nnodes", type=int, default=1, help="nodes (one fastfeed doctor per node, each with its "
                     "--node-rank; default 1)")
    job.add_argument("--node-rank", type=int, default=0, help="this node's rank among the nodes (default 0)")
    job.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0, where the ranks meet (needed with --nnodes > 1)")
    job.add_argument("--rdzv-id", help="the job's id, the same on every node (as torchrun's); each launch adds its "
                     "own part (default: made of --rdzv-endpoint, or random on one node)")  # fmt: skip
    p.add_argument("--overrides", help=argparse.SUPPRESS)  # a job's closing launch: the setting, as JSON
    p.add_argument("--demo", nargs=argparse.REMAINDER, metavar="ARGS",
                   help=f"diagnose the built-in scenario ({DEMO}; ARGS are its own, e.g. --workers 2)")
    p.add_argument("script", nargs="?", help="the training script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(run=main)


def main(args) -> int:
    if args.steps < 1:
        print(f"fastfeed doctor: --steps must be a positive number of batches, got {args.steps}", file=sys.stderr)
        return 2
    if args.demo is not None:
        target, module, argv = DEMO, True, args.demo
    elif args.script:
        target, module, argv = args.script, args.module, args.args
    else:
        print("fastfeed doctor: give a script to run (fastfeed doctor train.py ARGS), -m MODULE, or --demo",
              file=sys.stderr)
        return 2
    if args.nproc_per_node is not None or jobstore.job_env() is not None:
        return _job(args, target, argv, module)
    try:
        report = examine(target, argv, module, args.steps, args.whatif)
    except (script.ScriptFailed, FileNotFoundError) as e:
        _failed(e)
        return 1
    return _show(report, args)


def _show(report, args) -> int:
    if args.out:
        paths = report.save(args.out, html=True)
    elif args.html:
        paths = {"html": write_page(HTML_NAME, report.html())}
    else:
        paths = {}
    for kind, path in paths.items():
        say(f"{kind}: {path}")
    d = report.to_dict()
    print(json.dumps(d, indent=2, default=str) if args.json else report.summary(d))
    return 0


def _job(args, target: str, argv: list[str], module: bool) -> int:
    """The job's report: as its launcher (``--nproc-per-node``), or as one of its ranks (under torchrun)."""
    from . import jobrun, launch

    try:
        _script.check(target, module, "fastfeed doctor")
        if args.nproc_per_node is not None:
            if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
                print("fastfeed doctor: --nproc-per-node and --nnodes must be positive and --node-rank within "
                      f"--nnodes (got {args.nproc_per_node}, {args.nnodes}, {args.node_rank})", file=sys.stderr)
                return 2
            report = launch.examine_job(args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint,
                                        target, argv, module, args.steps, args.whatif, args.rdzv_id)  # fmt: skip
            if report is None:
                say(f"node {args.node_rank}'s ranks are measured; node 0 reports on the job")
                return 0
            return _show(report, args)
        env = jobstore.job_env()
        overrides = json.loads(args.overrides) if args.overrides else None
        report = jobrun.run_rank(env, target, argv, module, args.steps, overrides)
    except (script.ScriptFailed, FileNotFoundError, ValueError, jobstore.JobError, launch.LaunchFailed,
            jobrun.RankFailed) as e:
        _failed(e)
        return 1
    if report is None or os.environ.get(jobrun.JOB_DIR):  # another rank, or fastfeed's launcher reports
        return 0
    if args.whatif and report.closing_advice() is not None:
        report.whatif.setdefault("skipped", {})["closing"] = (
            "a second launch of the job; fastfeed doctor --nproc-per-node N SCRIPT launches the job itself and "
            "measures the advice")  # fmt: skip
    return _show(report, args)

