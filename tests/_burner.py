"""A child process that spends a given number of milliseconds of its own CPU time each time it is told to: a worker
that works between two readings of a CPU meter, for less than a clock tick."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Callable, Iterator

_CODE = """
import sys, time
print(flush=True)  # started: Python's start-up is not between the readings
for _ in sys.stdin:
    t = time.process_time()
    while time.process_time() - t < float(sys.argv[1]) / 1000:
        pass
    print(flush=True)
"""


@contextlib.contextmanager
def burner(ms: float) -> Iterator[Callable[[], None]]:
    """Start the child; yield a call that has it burn ``ms`` of CPU and returns once it has."""
    child = subprocess.Popen([sys.executable, "-c", _CODE, str(ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        child.stdout.readline()

        def burn() -> None:
            child.stdin.write("\n")
            child.stdin.flush()
            child.stdout.readline()

        yield burn
    finally:
        child.stdin.close()
        child.wait(timeout=10)
