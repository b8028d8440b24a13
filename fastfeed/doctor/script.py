"""Running a training script under a watch, as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would."""

from __future__ import annotations

import sys

from .. import _script
from .report import Report
from .watch import Watch


def say(msg: str) -> None:
    """A line of the doctor's progress, on stderr (stdout is the report's)."""
    print(f"fastfeed doctor: {msg}", file=sys.stderr, flush=True)


class ScriptFailed(RuntimeError):
    """The script raised before the doctor had any batch to look at."""


def run(target: str, argv: list[str], module: bool = False,
        **watch_kwargs) -> tuple[Report, Watch, BaseException | None]:  # fmt: skip
    """Run ``target`` with ``argv`` under ``Watch(**watch_kwargs)``, in this process.

    Returns the report, the watch (its hooks still hold the loaders, for the input-ceiling run) and the
    exception the script ended with, if any. ``sys.argv`` and ``sys.path[0]`` are the script's while it runs.
    The measured phase ends with the script, or after the watch's steps (``StopWatch``, swallowed).
    """
    _script.check(target, module, "fastfeed doctor")
    watch = Watch(**watch_kwargs)
    error = None
    with watch as report:
        try:
            _script.run_as_main(target, argv, module)
        except SystemExit as e:
            if e.code not in (0, None):
                error = e
        except Exception as e:  # the report so far is still worth having
            error = e
    report.command = ["fastfeed", "doctor", *(["-m"] if module else []), target, *argv]
    return report, watch, error
