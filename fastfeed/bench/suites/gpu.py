"""The GPU check's entry point: ``python -m fastfeed.bench.suites.gpu`` (scripts/gpu_check.sh, ``fastfeed bench gpu``).

The checks live in fastfeed/bench/gpu/, whose docstring says what each one checks and what the exit codes mean.
"""

import sys

from ..gpu.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
