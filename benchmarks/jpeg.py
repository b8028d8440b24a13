"""`fastfeed bench jpeg` runs the same code; this script is kept for the commands in benchmarks/README.md.

What it measures, and the figures measured: fastfeed/bench/suites/jpeg.py.
"""

from fastfeed.bench.suites.jpeg import main

if __name__ == "__main__":
    main()
