"""Running a script in this process as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would: as
``__main__``, with its ``sys.argv`` and ``sys.path[0]``, both restored after. ``fastfeed run`` and the doctor use it."""

from __future__ import annotations

import os
import runpy
import sys


def check(target: str, module: bool, command: str) -> None:
    """Raise FileNotFoundError, naming ``command``, when ``target`` is a script path that does not exist."""
    if not module and not os.path.isfile(target):
        raise FileNotFoundError(f"{command}: no script at {target!r} (give a path, or -m for a module)")


def run_as_main(target: str, argv: list[str], module: bool) -> None:
    """Run ``target``; its exceptions and ``SystemExit`` reach the caller."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [target, *argv]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
