"""`fastfeed bench ray` runs the same code; this script is kept for the commands in benchmarks/README.md,
and prints the project's targets (targets.py) after the figures.

What it measures, and the figures measured: fastfeed/bench/suites/ray.py.
"""

import os
import sys

import targets

# This file is named ray.py: with its folder first on sys.path, `import ray` would import this script again, not
# Ray (and Ray hands the driver's sys.path to its workers). targets is imported; the folder is no longer needed.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from fastfeed.bench.suites.ray import main  # noqa: E402

if __name__ == "__main__":
    targets.run(main)  # the figures, then the project's targets for them
