"""Running a training script under a watch, as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would."""

from __future__ import annotations

import os
import runpy
import sys

from .report import Report
from .watch import Watch


class ScriptFailed(RuntimeError):
    """The script raised before the doctor had any batch to look at."""


def run(target: str, argv: list[str], module: bool = False,
        **watch_kwargs) -> tuple[Report, Watch, BaseException | None]:  # fmt: skip
    """Run ``target`` with ``argv`` under ``Watch(**watch_kwargs)``, in this process.

    Returns the report, the watch (its hooks still hold the loaders, for the input-ceiling run) and the
    exception the script ended with, if any. ``sys.argv`` and ``sys.path[0]`` are the script's while it runs.
    The measured phase ends with the script, or after the watch's steps (``StopWatch``, swallowed).
    """
    saved_argv, saved_path = sys.argv, list(sys.path)
    watch = Watch(**watch_kwargs)
    error = None
    if module:
        sys.argv = [target, *argv]
    else:
        if not os.path.isfile(target):
            raise FileNotFoundError(f"fastfeed doctor: no script at {target!r} (give a path, or -m for a module)")
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    try:
        with watch as report:
            try:
                if module:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    error = e
            except Exception as e:  # the report so far is still worth having
                error = e
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    report.command = ["fastfeed", "doctor", *(["-m"] if module else []), target, *argv]
    return report, watch, error
