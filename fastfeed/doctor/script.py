"""Running a training script under a watch, as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would."""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from .. import _script
from .report import Report
from .watch import Watch


def say(msg: str) -> None:
    """A line of the doctor's progress, on stderr (stdout is the report's)."""
    print(f"fastfeed doctor: {msg}", file=sys.stderr, flush=True)


BRIEF = 160  # characters of an exception's message in a one-line account of it


def brief(error: BaseException) -> str:
    """An exception as one line: its type and its message's first line, cut at ``BRIEF`` characters (a failed
    what-if run is one line of the report, never a traceback or a page of text)."""
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > BRIEF:
        first = first[:BRIEF].rsplit(" ", 1)[0] + " ..."
    elif len(text) > 1:
        first += " ..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


_RUNNER_FILES = {os.path.abspath(_script.__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def script_traceback(error: BaseException) -> str:
    """``error``'s traceback as Python prints it for ``python SCRIPT``: from the script's own frame (the doctor's
    and runpy's frames that ran it left out), file and line of each call, then the exception."""
    tb = start = error.__traceback__
    while tb is not None:  # the script's frames begin after the last of those that ran it
        name = tb.tb_frame.f_code.co_filename
        if (name in _RUNNER_FILES or os.path.abspath(name) in _RUNNER_FILES) and tb.tb_next is not None:
            start = tb.tb_next
        tb = tb.tb_next
    tb = start
    return "".join(traceback.format_exception(type(error), error, tb)).rstrip()


def show_traceback(error: BaseException | None, who: str = "the script") -> None:
    """Say ``error``'s traceback (``script_traceback``), for an exception the script raised; a ``SystemExit`` is
    the script's own way out and has none worth showing."""
    if error is None or isinstance(error, SystemExit):
        return
    say(f"{who} raised:\n{script_traceback(error)}")


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
