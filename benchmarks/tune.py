"""`fastfeed bench tune` runs the same code; this script is kept for the commands in benchmarks/README.md,
and prints the project's targets (targets.py) after the figures.

What it measures, and the figures measured: fastfeed/bench/suites/tune.py.
"""

import targets
from fastfeed.bench.suites.tune import main

if __name__ == "__main__":
    targets.run(main)  # the figures, then the project's targets for them
