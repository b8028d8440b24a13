"""Shared benchmark runner: a candidate loader against torch's DataLoader, in the same run.

Absolute times do not carry between runs on shared machines, so every figure is a ratio
measured here and now: each round runs torch and the candidate back to back, alternating
which goes first (A B, B A, ...), and the summary is the median, min and max of the
per-round ratios (the method is in benchmarks/README.md).

The candidate is ``fastfeed.DataLoader``. ``FASTFEED_BENCH_CANDIDATE=torch`` (or the hidden
``--candidate torch`` flag) substitutes torch's own DataLoader, named ``torch*``, which checks
the harness itself: every ratio should then be ~1.0x. Any ``module`` or ``module:Class`` works too.

This module is the suites' one import; each concern lives in a module of its own:

- ``accounting``: the process tree, its PSS and footprint, its CPU seconds;
- ``trial``: how one trial is timed (:func:`run_trial`, steady state; :func:`run_epochs`, whole epochs);
- ``comparison``: :class:`Comparison` and its interleaved rounds (:func:`compare`);
- ``summary``: records to ratios (:func:`summarize`) and their printed lines;
- ``results``: a script's run end to end, written as JSON and CSV (:func:`run_script`);
- ``flags``: the flags every script shares (:func:`parse_args`);
- ``session``: what ``fastfeed bench`` asks of every comparison (progress bars, variants, a step).
"""

from __future__ import annotations

from . import session as _session
from .accounting import MB, PeakPss, footprint_mb, process_tree, pss_mb, shmem_mb
from .comparison import CANDIDATE_ENV, Comparison, compare, resolve_candidate, timed_epochs
from .flags import parse_args
from .results import REPO, run_script, write_results
from .session import Session, progress
from .summary import FIGURES, GBPS, fmt, format_line, summarize
from .trial import run_epochs, run_trial, touch

__all__ = ["CANDIDATE_ENV", "FIGURES", "GBPS", "MB", "REPO", "Comparison", "PeakPss", "Session", "compare",
           "fmt", "footprint_mb", "format_line", "parse_args", "process_tree", "progress", "pss_mb",
           "resolve_candidate", "run_epochs", "run_script", "run_trial", "shmem_mb", "summarize", "timed_epochs",
           "touch", "use_session", "write_results"]


def use_session(session: Session) -> Session:
    """Make ``session`` the one every comparison reads (``fastfeed bench`` sets its own); returns the previous."""
    return _session.use(session)


def __getattr__(name: str):
    # SESSION is read where it is used, in session.py; reading it here follows that one.
    if name == "SESSION":
        return _session.SESSION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
