"""What ``fastfeed bench`` asks of every comparison a suite builds: progress bars, variants, a step.

The command sets it for its run with :func:`use`; the scripts under ``benchmarks/`` leave the defaults.
Readers take ``session.SESSION`` at call time, never a copy from import time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass
class Session:
    """What ``fastfeed bench`` asks of every comparison a suite builds (the scripts leave the defaults).

    Attributes:
        progress: a tqdm bar per comparison on stderr, its postfix the latest trial's loader and figure.
        variants: the variant tags to run (``{"thread", "dali"}``); None runs every one the suite builds.
        step_s: a synthetic training step after each timed batch, for comparisons that set none.
    """

    progress: bool = False
    variants: set | None = None
    step_s: float = 0.0


SESSION = Session()


def progress(total: int, desc: str):
    """A tqdm bar on stderr when the session asks for bars, else None."""
    if not SESSION.progress:
        return None
    from tqdm import tqdm

    # disable=None: a bar on a terminal only; a log gets the figure lines, not a bar's every redraw
    return tqdm(total=total, desc=desc, unit="trial", leave=False, file=sys.stderr, disable=None)


def use(session: Session) -> Session:
    """Make ``session`` the one every comparison reads from now on; returns the one it replaces."""
    global SESSION
    before, SESSION = SESSION, session
    return before
