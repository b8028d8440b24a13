"""The ``fastfeed`` command.

    fastfeed cleanup [--dir DIR]   unlink segments left by fastfeed processes that were killed
"""

from __future__ import annotations

import argparse
import sys

from . import config
from ._ring import segments


def _cleanup(args) -> int:
    removed = segments.reclaim(args.dir)
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} segment(s) of dead fastfeed processes removed from {args.dir or config.shm_dir()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastfeed", description="fastfeed: keep GPUs fed.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cleanup", help="unlink shared memory left by killed fastfeed processes")
    p.add_argument("--dir", help="segment directory (default: FASTFEED_SHM_DIR or /dev/shm)")
    p.set_defaults(run=_cleanup)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
