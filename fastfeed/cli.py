"""The ``fastfeed`` command.

fastfeed cleanup [--dir DIR]   unlink segments left by fastfeed processes that were killed
fastfeed info [--json]         the machine, this rank's placement plan, what is available
fastfeed tune module:attr ...  measure loader settings for a dataset; print them, save the best (--out)
fastfeed tune --show|--clear   list or empty the tuning cache
fastfeed doctor SCRIPT [ARGS]  run a training script, say why the GPU idles, check the advice by measuring it
fastfeed bench [WORKLOAD ...]  fastfeed against torch's DataLoader on standard workloads or your dataset
fastfeed run SCRIPT [ARGS]     run a script with every torch DataLoader it builds replaced by fastfeed's
"""

from __future__ import annotations

import argparse
import json
import sys

from . import config
from . import run as run_cli
from ._ring import segments
from .bench import cli as bench_cli
from .doctor import cli as doctor_cli
from .tuning import cli as tune_cli


def _cleanup(args) -> int:
    removed = segments.reclaim(args.dir)
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} segment(s) of dead fastfeed processes removed from {args.dir or config.shm_dir()}")
    return 0


def _info(args) -> int:
    from . import info

    report = info.report()
    print(json.dumps(report, indent=2) if args.json else info.render(report))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastfeed", description="fastfeed: keep GPUs fed.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cleanup", help="unlink shared memory left by killed fastfeed processes")
    p.add_argument("--dir", help="segment directory (default: FASTFEED_SHM_DIR or /dev/shm)")
    p.set_defaults(run=_cleanup)
    p = sub.add_parser("info", help="topology, placement plan and what is available (paste it into bug reports)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=_info)
    tune_cli.add_parser(sub)
    doctor_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    run_cli.add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
