"""`fastfeed bench shards` runs the same code; this script is kept for the commands in benchmarks/README.md,
and prints the project's targets (targets.py) after the figures.

What it measures, and the figures measured: fastfeed/bench/suites/shards.py.
"""

import targets
from fastfeed.bench.suites.shards import main

if __name__ == "__main__":
    targets.run(main)  # the figures, then the project's targets for them
