"""`fastfeed bench startup` runs the same code; this script is kept for the commands in benchmarks/README.md.

What it measures, and the figures measured: fastfeed/bench/suites/startup.py.
"""

from fastfeed.bench.suites.startup import main

if __name__ == "__main__":
    main()
