"""`fastfeed bench tune` runs the same code; this script is kept for the commands in benchmarks/README.md.

What it measures, and the figures measured: fastfeed/bench/suites/tune.py.
"""

from fastfeed.bench.suites.tune import main

if __name__ == "__main__":
    main()
