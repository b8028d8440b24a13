"""`fastfeed bench prefetch` runs the same code; this script is kept for the commands in benchmarks/README.md.

What it measures, and the figures measured: fastfeed/bench/suites/prefetch.py.
"""

from fastfeed.bench.suites.prefetch import main

if __name__ == "__main__":
    main()
