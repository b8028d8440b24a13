"""The flags every benchmark script shares (``--quick``, ``--rounds``, ``--num-workers``...), with their presets."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_args(doc: str, argv: Sequence[str] | None, defaults: dict, quick: dict,
               extra: Any = None) -> argparse.Namespace:
    """Parse the flags every script shares; unset ones come from ``quick`` or ``defaults``.

    Args:
        doc: The script's docstring, shown by ``--help``.
        argv: Arguments (default ``sys.argv[1:]``).
        defaults: Values of rounds, warmup, batches, mem_batches, num_workers for a full run, and
            epoch_batches (a list; 0 is steady state) for a script that takes ``--epoch-batches``.
        quick: Values that ``--quick`` overrides.
        extra: Optional callable adding script-specific flags to the parser.

    Returns:
        The parsed arguments.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few rounds and batches (what the tests run)")
    p.add_argument("--rounds", type=int, help=f"rounds of interleaved trials (default {defaults.get('rounds')})")
    p.add_argument("--warmup", type=int, help="untimed batches per trial, the first included")
    p.add_argument("--batches", type=int, help="timed batches per trial")
    p.add_argument("--mem-batches", type=int, help="untimed batches per trial, each followed by a PSS sample")
    p.add_argument("--num-workers", type=int, nargs="+", help="worker counts to measure")
    if "epoch_batches" in defaults:  # only scripts whose question has epochs take it
        p.add_argument("--epoch-batches", type=int, nargs="+", metavar="N",
                       help="epoch mode: a trial runs whole epochs of N batches of one loader, each timed "
                            "from iter() to its last batch (start-up included); 0: one steady-state "
                            f"iterator (default {' '.join(map(str, defaults['epoch_batches']))})")
    p.add_argument("--mp-context", choices=("fork", "spawn", "forkserver"),
                   help="multiprocessing_context for both loaders (default: the loaders' own)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for JSON and CSV")
    p.add_argument("--candidate", help=argparse.SUPPRESS)  # e.g. "torch"; see module docstring
    if extra:
        extra(p)
    args = p.parse_args(argv)
    if any(n < 0 for n in getattr(args, "epoch_batches", None) or ()):
        p.error("--epoch-batches: N >= 1 for epochs of N batches, 0 for the steady state")
    preset = {**defaults, **quick} if args.quick else defaults
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args
